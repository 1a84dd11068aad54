"""The engine options shared by the `forkpoint` subcommands: argparse flags named as vLLM's and the
`LLM(...)` keyword arguments they stand for. Imported by `cli.py` and `bench_cli.py` (it imports
neither), so the server's modules import in one direction.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from forkpoint.speculative_config import SpeculativeConfig


def add_engine_args(parser: argparse.ArgumentParser, *, positional_model: bool, title: str = "engine") -> None:
    """The engine options (the keyword arguments of `LLM`)."""
    group = parser.add_argument_group(title)
    model_help = ("local Hugging Face model directory or Hub name such as Qwen/Qwen3.5-35B-A3B, downloaded into the "
                  "Hub cache (HF_HUB_OFFLINE=1: the cache only) (default: the embedded random-weight Qwen3.5-MoE "
                  "model)")
    if positional_model:
        parser.add_argument("model", nargs="?", default=None, metavar="MODEL", help=model_help)
    else:
        group.add_argument("--model", default=None, help=model_help)
    group.add_argument("--tokenizer", default=None, help="tokenizer directory or Hub name (default: the model's)")
    group.add_argument("--revision", default=None,
                       help="branch, tag or commit of a Hub model (default: main)")
    group.add_argument("--tokenizer-revision", default=None,
                       help="branch, tag or commit of a Hub tokenizer (default: main)")
    group.add_argument("--download-dir", default=None,
                       help="Hub cache directory to read and download models into (default: HF_HUB_CACHE, else "
                            "~/.cache/huggingface/hub)")
    group.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="weights and activations dtype; auto is float32 on CPU, bfloat16 on CUDA (default: auto)")
    group.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: auto)")
    group.add_argument("--seed", type=int, default=0, help="seed of weights for --load-format dummy and of sampling "
                                                           "without a request seed (default: 0)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt plus output in tokens (default: the model's max_position_embeddings)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="most sequences per step (default: 256)")
    group.add_argument("--max-num-batched-tokens", type=int, default=8192,
                       help="most tokens per step (default: 8192)")
    group.add_argument("--long-prefill-token-threshold", type=int, default=None, metavar="N",
                       help="most prefill tokens of one request per step, so a long prompt shares steps with "
                            "other streams instead of stalling them (vLLM's name; default: no cap beyond "
                            "--max-num-batched-tokens)")
    group.add_argument("--max-prefill-tokens-with-decodes", type=int, default=None, metavar="N",
                       help="most prefill tokens (all prompts together) in a step that also decodes, so a long "
                            "prompt keeps running streams' token gaps near their step time; a step with no decode "
                            "takes --max-num-batched-tokens; prefills of at most 16 x N tokens run whole (default for "
                            "serve: 64 on the CPU, measured; no cap on CUDA; none for offline commands)")
    group.add_argument("--attention-parity-tokens", type=int, default=None, metavar="C",
                       help="the context length at which a prefill token's attention costs what its matrix "
                            "products do: under --max-prefill-tokens-with-decodes N, a long prompt's chunk at "
                            "position c takes at most N / (1 + c / C) tokens (default: counted from the model's "
                            "shape)")
    group.add_argument("--max-decode-share", type=int, default=None, metavar="N",
                       help="while other clients (`user`, else each request) have work, a client decodes at most "
                            "max(N, the largest other client's running sequences) sequences a step, the rest in turn "
                            "(default for serve: 16 on the CPU, measured; no cap on CUDA; none for offline commands)")
    group.add_argument("--prompt-score-bytes", type=int, default=None, metavar="BYTES",
                       help="bytes of float32 prompt-logit rows one step computes for prompt logprobs (echo + "
                            "logprobs, prompt_logprobs): a scored prompt runs in chunks of that many rows, so its "
                            "memory does not grow with prompt length x vocabulary (default: 64 MiB on the CPU, "
                            "1 GiB on CUDA); in a step where other sequences decode, at most 1/8 of the prefill "
                            "budget beside decodes in scored rows")
    group.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default: 16)")
    group.add_argument("--checkpoint-token", default="<|mamba_checkpoint|>",
                       help="the checkpoint marker string (default: <|mamba_checkpoint|>)")
    group.add_argument("--no-checkpoints", action="store_true",
                       help="disable checkpoints: markers and checkpoint controls are ignored, nothing is reused")
    group.add_argument("--max-checkpoints-per-request", type=int, default=4,
                       help="most checkpoints one prompt may carry (default: 4)")
    group.add_argument("--auto-checkpoints", action=argparse.BooleanOptionalAction, default=True,
                       help="let the engine checkpoint shared prefixes, junctions, prompt ends and turn ends "
                            "without markers (default: on)")
    group.add_argument("--checkpoint-host-bytes", type=int, default=None,
                       help="bytes of host memory that checkpoints evicted from the device spill to and return "
                            "from on a hit; 0: no host tier (default: a quarter of the machine's memory, at most "
                            "64 GiB, split over the tensor-parallel ranks; none on the CPU). `serve` pins it at "
                            "start-up, in the background")
    group.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                       help="keep checkpoints as files in DIR (written through when they are made, read back on a "
                            "miss in memory), keyed by prefix, model, dtype, layout and tokenizer: a restarted "
                            "server reuses them; a damaged or foreign file is a miss (default: no disk tier)")
    group.add_argument("--checkpoint-dir-bytes", type=int, default=None, metavar="BYTES",
                       help="most bytes of checkpoint files in --checkpoint-dir, least recently used leave first "
                            "(default: a quarter of the file system's free space at start-up)")
    group.add_argument("--checkpoint-restore-rule", action=argparse.BooleanOptionalAction, default=True,
                       help="take a checkpoint from the host or disk tier only when moving it back costs no more "
                            "than computing the tokens it saves, at the rates the engine measures (default: on; "
                            "off: every tier hit is restored)")
    group.add_argument("--checkpoint-exact", action="store_true",
                       help="GPU: keep checkpoint states at scan-chunk boundaries so consumers' bf16 results are "
                            "bit-identical to a run without checkpoints (recomputes up to 63 tokens per consumer)")
    group.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"],
                       help="auto/safetensors read the weights; dummy builds seeded random weights from "
                            "config.json alone (default: auto)")
    group.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                       help="split the model over N ranks, one process each: GPUs 0..N-1 (NCCL) or the CPU "
                            "(gloo); every model family, images included (default: 1)")
    group.add_argument("--async-scheduling", action="store_true",
                       help="in steady decoding, schedule and enqueue the next step while the device runs the "
                            "current one, overlapping the engine's host work with the forward (default: off)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run every step eagerly: no CUDA graphs of the forward's token-wise parts "
                            "(faster start-up, slower small steps; CUDA only)")
    group.add_argument("--startup-compile-workers", type=int, default=None, metavar="N",
                       help="on a cold start (empty kernel caches), compile the kernels in N worker processes "
                            "before the engine warms up; 0: none (default: half the CPUs, at most 8, as GPU "
                            "memory allows; CUDA graphs only; a warm start runs none)")
    group.add_argument("--speculative-config", type=_speculative_config, default=None, metavar="JSON",
                       help="speculative decoding with the model's multi-token-prediction head, as vLLM's: "
                            "'{\"method\": \"mtp\", \"num_speculative_tokens\": K}' drafts K tokens (1 to 16) per "
                            "step and verifies them in one forward; outputs keep the model's distribution (greedy: "
                            "the same tokens). Needs a Qwen3.5 / Qwen3-Next checkpoint with its mtp.* weights; not "
                            "with --async-scheduling or --tensor-parallel-size > 1 yet (default: off)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.85, metavar="F",
                       help="CUDA: the share (0 < F <= 1) of the GPU memory free after the weights that the KV "
                            "blocks, request states and checkpoint states take together, less what the CUDA graphs "
                            "and activations reserve; vLLM's name, but vLLM counts it of the whole GPU "
                            "(default: 0.85)")
    group.add_argument("--quantization", default=None, choices=["fp8"],
                       help="fp8: block-wise FP8 weights, as Qwen's FP8 releases store them (with --load-format "
                            "dummy: random FP8 weights from a bf16 config) (default: what the checkpoint's "
                            "quantization_config says)")
    group.add_argument("--kv-cache-dtype", default="auto",
                       help="the KV cache's dtype: auto, the model's dtype, is the only one (FP8 KV caches are "
                            "not implemented; another value is an error naming it) (default: auto)")
    group.add_argument("--mamba-ssm-cache-dtype", default="auto", choices=["auto", "float32"],
                       help="vLLM's option for the recurrent (Mamba2 / Gated DeltaNet) states: forkpoint keeps them "
                            "in float32 always, so auto and float32 are the same and no other dtype is taken")
    group.add_argument("--enable-prefix-caching", dest="auto_checkpoints", action=argparse.BooleanOptionalAction,
                       default=argparse.SUPPRESS,
                       help="vLLM's name for --auto-checkpoints / --no-auto-checkpoints: reuse of shared prefixes "
                            "without markers (the last of these flags wins)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="accepted so that vLLM command lines run: forkpoint runs no Python code from a checkpoint "
                            "(its model classes are its own), so the flag changes nothing")
    group.add_argument("--structured-outputs-config", type=_json_object, default=None, metavar="JSON",
                       help="how JSON schemas read, as vLLM's: '{\"disable_additional_properties\": false}' gives "
                            "strict JSON Schema semantics (extra properties allowed unless the schema forbids "
                            "them; default true: only the listed ones, as vLLM's default backend), "
                            "'{\"disable_any_whitespace\": false}' lets the model put whitespace between JSON "
                            "tokens (default true: compact JSON)")


def _json_object(text: str, example: str = '{"disable_any_whitespace": false}') -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"not JSON ({err}): pass a JSON object such as '{example}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{example}'")
    return value


def _speculative_config(text: str) -> dict:
    """--speculative-config: a JSON object that `SpeculativeConfig.from_value` accepts (its message
    names the key that is wrong), kept as the dict so that replicas get plain data."""
    value = _json_object(text, example='{"method": "mtp", "num_speculative_tokens": 3}')
    try:
        SpeculativeConfig.from_value(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(**engine_kwargs(args))`."""
    return dict(
        model=args.model, tokenizer=args.tokenizer, revision=args.revision,
        tokenizer_revision=args.tokenizer_revision, download_dir=args.download_dir, dtype=args.dtype,
        device=args.device, seed=args.seed,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        long_prefill_token_threshold=args.long_prefill_token_threshold, prompt_score_bytes=args.prompt_score_bytes,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        attention_parity_tokens=args.attention_parity_tokens,
        max_decode_share=args.max_decode_share,
        enable_checkpoints=not args.no_checkpoints, checkpoint_token=args.checkpoint_token,
        max_checkpoints_per_request=args.max_checkpoints_per_request, load_format=args.load_format,
        enforce_eager=args.enforce_eager, startup_compile_workers=args.startup_compile_workers,
        auto_checkpoints=args.auto_checkpoints,
        checkpoint_host_bytes=args.checkpoint_host_bytes, checkpoint_exact=args.checkpoint_exact,
        checkpoint_dir=args.checkpoint_dir, checkpoint_dir_bytes=args.checkpoint_dir_bytes,
        checkpoint_restore_rule=args.checkpoint_restore_rule,
        tensor_parallel_size=args.tensor_parallel_size, async_scheduling=args.async_scheduling,
        structured_outputs_config=args.structured_outputs_config, speculative_config=args.speculative_config,
        gpu_memory_utilization=args.gpu_memory_utilization, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
    )


def server_engine_kwargs(args: argparse.Namespace, *, replicas: bool = False) -> dict[str, Any]:
    """`engine_kwargs(args)` with `forkpoint serve`'s defaults where they differ from `LLM`'s (scripts and
    tests may hold several engines in one process, and batches want throughput):
    - on the CPU, `max_prefill_tokens_with_decodes` CPU_SERVE_PREFILL_TOKENS_WITH_DECODES (config.py:
      a long prompt keeps running streams' token gaps near their step time; short prefills run whole)
      and `max_decode_share` CPU_SERVE_DECODE_SHARE (one request's large n keeps other clients' decode
      steps small);
    - on a GPU, the default host tier's size (cache/sizing.py), so the engine pins it ahead before the
      server serves (engine/builder.py; pinning as the tier first fills stalled the steps, issue 32),
      except for `replicas`, which split the machine's tier between them (server/replicas/launch.py)."""
    from forkpoint.cache.sizing import default_host_tier_bytes, physical_memory_bytes
    from forkpoint.config import (  # imports torch
        CPU_SERVE_DECODE_SHARE,
        CPU_SERVE_PREFILL_TOKENS_WITH_DECODES,
        EngineConfig,
    )

    kwargs = engine_kwargs(args)
    config = EngineConfig(**kwargs)
    device = config.torch_device().type
    if config.max_prefill_tokens_with_decodes is None and device == "cpu":
        kwargs["max_prefill_tokens_with_decodes"] = CPU_SERVE_PREFILL_TOKENS_WITH_DECODES
    if config.max_decode_share is None and device == "cpu":
        kwargs["max_decode_share"] = CPU_SERVE_DECODE_SHARE
    if not replicas and config.checkpoint_host_bytes is None and config.enable_checkpoints and device == "cuda":
        kwargs["checkpoint_host_bytes"] = default_host_tier_bytes(physical_memory_bytes(), True,
                                                                  config.tensor_parallel_size)
    return kwargs


def check_engine_kwargs(kwargs: dict[str, Any]) -> None:
    """Validate `kwargs` as `LLM` will (`EngineConfig`), before anything loads: a refused option or
    combination (e.g. --speculative-config with --async-scheduling) is a ValueError naming it at once,
    also where the engines start in other processes (replicas, tensor-parallel ranks)."""
    from forkpoint.config import EngineConfig  # imports torch: only when a command runs

    EngineConfig(**kwargs)
