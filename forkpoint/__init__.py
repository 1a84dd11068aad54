"""forkpoint: an inference engine for hybrid recurrent/attention LLMs with application-directed
prefix checkpoints.

Start here: `llm.py` (the offline API), then `engine/` (step loop, scheduler), `cache/` (KV blocks,
recurrent state slots, checkpoints), `runner/` (per-step batch metadata, sampling), `models/`,
`kernels/` (reference PyTorch ops and their GPU variants), `inputs/` (tokenizer, markers, chat,
images), `server/` (OpenAI-compatible HTTP API and CLI).

The public names are imported on first use (PEP 562), so `forkpoint --help` does not pay for
importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput", "Logprob"]
__version__ = "0.1.0"

_HOMES = {
    "LLM": "forkpoint.llm",
    "SamplingParams": "forkpoint.sampling_params",
    "StructuredOutputsParams": "forkpoint.sampling_params",
    "RequestOutput": "forkpoint.outputs",
    "CompletionOutput": "forkpoint.outputs",
    "Logprob": "forkpoint.outputs",
}

if TYPE_CHECKING:
    from forkpoint.llm import LLM
    from forkpoint.outputs import CompletionOutput, Logprob, RequestOutput
    from forkpoint.sampling_params import SamplingParams, StructuredOutputsParams


def __getattr__(name: str):
    if name in _HOMES:
        return getattr(importlib.import_module(_HOMES[name]), name)
    raise AttributeError(f"module 'forkpoint' has no attribute {name!r}")
