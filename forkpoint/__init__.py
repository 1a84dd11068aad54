"""forkpoint: an inference engine for hybrid recurrent/attention LLMs with application-directed
prefix checkpoints.

Start here: `llm.py` (the offline API), then `engine/` (step loop, scheduler), `cache/` (KV blocks,
recurrent state slots, checkpoints), `runner/` (per-step batch metadata, sampling), `models/`,
`kernels/` (reference PyTorch ops and their GPU variants), `inputs/` (tokenizer, markers, chat),
`server/` (OpenAI-compatible HTTP API and CLI).
"""

from forkpoint.llm import LLM
from forkpoint.outputs import CompletionOutput, Logprob, RequestOutput
from forkpoint.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"
