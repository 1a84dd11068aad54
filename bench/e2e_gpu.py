"""End-to-end 1-to-N on one GPU at Qwen3.5-35B-A3B shapes (or, with --shape nemotron3-nano, at
NVIDIA-Nemotron-3-Nano-30B-A3B shapes: e2e_gpu_shapes.py), seeded random bf16 weights. The FP8
shapes (--shape qwen3.5-35b-a3b-fp8, qwen3-next-80b-a3b-fp8) add the `quantization_config` of Qwen's
block-wise FP8 releases to the config, so the dummy weights are FP8 (e2e_gpu_shapes.py); they have no
peer (transformers does not run forkpoint's FP8 tensors) and no --tiny-parity. The engine's start-up
phases (weights loaded, graphs captured, warm-up), the bytes its weights take and the peak of GPU
memory are recorded with it (`engine` in the JSON). bench/run_gpu_fp8.sh runs 35B bf16, 35B FP8 and
80B FP8 side by side in one device call; e2e_gpu_compare.py tables their ratios.

Workload (DESIGN.md section 2): an anchor of P random token ids, the checkpoint marker, then N
suffixes of random ids, greedy, all N requests added at once. Every run draws a fresh anchor, so
nothing is cached from an earlier run.

- checkpoints ON: prompts `anchor + marker + suffix`; the first request produces the checkpoint,
  the others consume it (in the same step when the token budget allows, else from the ready one).
- checkpoints OFF: the same prompts without the marker, on the same engine. Without a marker no
  checkpoint is registered and the fresh anchor matches none from before, so every request
  computes its whole prompt (checked: prompt_tokens_computed grows by N*P + sum S). One engine
  serves both (the 35B model is 70 GB in bf16: two do not fit beside their caches).

Rows, in the order they run (each an on/off pair; a pair predicted to overrun the time budget is
skipped and recorded with the reason, and later, cheaper pairs still run):
  1. main:   P in --p (4096, 624), S = --s (256), N in --n (1 ... 256), max_tokens 1 (scoring)
  2. decode: P in --decode-p, S = --s, N in --decode-n, max_tokens --decode-tokens (32): TPOT
  1b. exact: the main rows at N in --exact-n with checkpoint_exact switched on (checkpoints on
     only; set against the main row's off run; the cost of bf16 results that do not depend on the
     checkpoint is this row's requests/s against the main row's on run)
  1c. auto:  the main rows at N in --auto-n without the marker, automatic checkpoints on (set
     against the main row's off run, in which automatic checkpoints are off)
  2b. decode_async: the decode rows at N in --async-n with asynchronous scheduling (checkpoints
     on; TPOT set against the decode row's synchronous on run)
  3. seed:   P = --seed-p (624), S drawn uniformly from --seed-s (350-650, seeded), N in --seed-n
  3b. long:  P in --long-p (32768, 131072), S = --s, N in --long-n (1, 4, 16), max_tokens 1, by N (both P
     at each N), after rows 1-3 (a short deadline leaves those their numbers) and before --profile,
     the stall, eager and peer rows
  3c. long_decode: P in --long-decode-p (32768), S = --s, N in --long-decode-n (1, 16), max_tokens
     --decode-tokens: TPOT at long context (issue 30's long-context rows; `--long-p ""` and
     `--long-decode-p ""` turn them off). The long rows get no warm-up of their own: the rows above
     compiled every kernel they use (prefill steps of the same token buckets, the attention tiles
     autotuned per step size, not per context length, decode batches up to the largest N); run
     alone, the warm-up takes theirs. A pair whose prompt plus max_tokens exceeds the engine's
     max_model_len (or its KV pool) is skipped with that reason, in any row group. Under the JSON's
     `long`: every planned long pair with its on/off requests/s, ratio, TTFT and TPOT, or why it
     did not run
  4. eager:  P = --eager-p, S = --s, N in --eager-n, max_tokens 1 and --decode-tokens, executed as
     an `enforce_eager=True` engine would (no CUDA graphs), on the same engine through a runtime
     switch: `set_enforce_eager(bool)` if the engine or its runner has one, else the runner's
     piecewise graph forward detached (`runner.piecewise = None`: the model's plain forward, the
     path such an engine takes). Without either, a second engine, built only with --eager-rows
     (the first is freed: 70 GB of weights again); skipped with a note when EngineConfig has no
     `enforce_eager` field
  5. peer:   Hugging Face transformers on the same weights (e2e_gpu_peer.py), P in --peer-p (624, 4096,
     32768) in that order, N in --peer-n, capped by --peer-budget (the 32k rows come last and are the
     first it cuts: give the peer more than the 60 s default to reach them; a CUDA out-of-memory error
     at a P is recorded as its rows' error, e2e_gpu_peer.py says when one can occur); the table sets
     each against forkpoint's main or long row of the same P and N
  6. stall:  with --stall-p (none by default), after the rows and --profile: one prompt of each length beside
     --stall-streams (32) decoding streams per prefill budget of a step that decodes in --stall-budgets
     (none,2048,512): the streams' largest step over their decode step and the prompt's time to first
     token (bench/long_prompt_stall.py; issue 30's "a long prompt must not stall running decodes")

Per run: requests/s (N / wall time from the first add_request to the last output), TTFT p50/p99 of
all requests and of the consumers (requests 2..N), prompt tokens computed (metrics delta), computed
tokens/s, MFU = 2 * active params per token * tokens computed / wall / 989e12 (dense bf16 peak;
the matmul weights a token passes through, without embedding and lm_head), TPOT p50 for
max_tokens > 1 ((finish - first token) / (max_tokens - 1) per request), and per pair the on/off
ratio of requests/s against the ideal (N*P + sum S) / (P + sum S) = N(P+S)/(P+NS) for equal S.
Each step's prompt tokens, running sequences, wall time and host time in `runner.execute` are kept.

Time: --deadline is a hard limit (seconds from process start; an alarm stops whatever runs, and the
results so far are written); forkpoint rows end by --time-budget (default: deadline - peer budget
- 5 s), the peer gets --peer-budget after them. A pair's time is predicted from the steps timed so
far (prefill step = a + b * tokens, decode step = c + d * sequences, least squares; priors from the
last eager H200 run: 85 ms + 23.5 us/token, decode 96 ms at 16 sequences) times 1.2; each prompt token
also pays b * `attention_share` per earlier token it attends to (attention FLOPs over the token's matmul
FLOPs, from the config: at 131k tokens attention outweighs the matmuls, which a fit of short rows
cannot see; e2e_gpu_plan.Predictor).

Usage (on the GPU machine; fla-core on the path; bench/run_gpu_e2e.sh is the one-call wrapper):
    python bench/e2e_gpu.py --out bench/results --deadline 400 --profile   # e2e_gpu_h200.{json,png}
    python bench/e2e_gpu.py --smoke                  # tiny model, every row kind (long: P 256, 512), < 60 s
    python bench/e2e_gpu.py --long-p "" --long-decode-p "" --peer-p 624,4096 ...    # without the long rows
    python bench/e2e_gpu.py --shape nemotron3-nano --name e2e_gpu_h200_nemotron3_nano --peer-layers 7 ...
    python bench/e2e_gpu.py --smoke --shape qwen3-next-80b-a3b-fp8   # tiny FP8 Qwen3-Next, CPU or GPU
    python bench/e2e_gpu.py --p 624 --n 1 --exact-n "" --auto-n "" --async-n "" --decode-n 32 --seed-n "" \
        --eager-n "" --long-p "" --long-decode-p "" --no-peer --stall-p 32768,131072 \
        --name e2e_gpu_h200_stall                                                      # the stall rows alone
    python bench/e2e_gpu.py --n "" --decode-n "" --seed-n "" --eager-n "" --peer-p 32768 --peer-n 1,4 \
        --name e2e_gpu_h200_long --deadline 540 --peer-budget 120          # the long rows and the 32k peer alone
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()  # before the heavy imports: --deadline counts from here

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from e2e_gpu_peer import build_peer, run_peer, vocab_limit  # noqa: E402
from e2e_gpu_plan import Alarm, OutOfTime, Predictor, RowSpec, plan_rows  # noqa: E402
from e2e_gpu_report import plot, step_fit, table  # noqa: E402
from e2e_gpu_shapes import (  # noqa: E402
    nemotron3_nano_config,
    nemotron3_nano_tiny_config,
    nemotron_param_counts,
    qwen3_next_80b_config,
    qwen3_next_tiny_config,
    qwen_tiny_sizes,
    save_word_tokenizer,
    with_fp8,
)
from host_info import code_version  # noqa: E402
from host_timeline import Timers, busy_fraction, decode_host_timeline, instrumented  # noqa: E402
from long_prompt_stall import print_row, stall_row  # noqa: E402
from trace_gaps import idle_report  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402
from forkpoint.config import SCAN_CHUNK_TOKENS, EngineConfig  # noqa: E402
from forkpoint.inputs.default_model import ensure_default_model  # noqa: E402

PEAK_BF16 = 989e12        # H100/H200 SXM dense bf16, datasheet
MEASURED_BF16 = 790e12    # 8192^3 bf16 matmul measured on this workplace's H200s (KINDS.md)
ANCHOR_FLOOR_TOKENS_S = 130e3  # ANCHORS.md: ~6 GFLOP per token at ~790 TFLOP/s
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
FINALIZE_S = 5.0          # saving, the table and the plot after the last row


# ---------------------------------------------------------------- model directory

def full_config() -> dict:
    """Qwen3.5-35B-A3B text model shapes."""
    layers = 40
    return {
        "architectures": ["Qwen3_5MoeForCausalLM"],
        "model_type": "qwen3_5_moe_text",
        "vocab_size": 248320,
        "hidden_size": 2048,
        "num_hidden_layers": layers,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)],
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "attention_bias": False,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "max_position_embeddings": 262144,
        "eos_token_id": 248046,
    }


def tiny_config() -> dict:
    """Same family and vocabulary, tiny sizes (smoke test and CPU dry run)."""
    return {**full_config(), **qwen_tiny_sizes()}


SHAPES = ("qwen3.5-35b-a3b", "nemotron3-nano", "qwen3.5-35b-a3b-fp8", "qwen3-next-80b-a3b-fp8")
FP8_SHAPES = ("qwen3.5-35b-a3b-fp8", "qwen3-next-80b-a3b-fp8")
TINY_FP8_BLOCK = (64, 64)  # the tiny configs' widths (64, 128, 256) are whole 64 x 64 blocks


def model_config(args, tiny: bool) -> dict:
    """config.json of the --shape, full or tiny (FP8 shapes: with the releases' quantization_config)."""
    if args.shape == "nemotron3-nano":
        return nemotron3_nano_tiny_config() if tiny else nemotron3_nano_config()
    block = TINY_FP8_BLOCK if tiny else (128, 128)
    if args.shape == "qwen3-next-80b-a3b-fp8":
        return with_fp8(qwen3_next_tiny_config() if tiny else qwen3_next_80b_config(), block)
    cfg = tiny_config() if tiny else full_config()
    return with_fp8(cfg, block) if args.shape == "qwen3.5-35b-a3b-fp8" else cfg


def model_label(args) -> str:
    if args.shape == "nemotron3-nano":
        return "tiny Nemotron-H" if args.tiny else "NVIDIA-Nemotron-3-Nano-30B-A3B shapes (random bf16 weights)"
    if args.shape == "qwen3-next-80b-a3b-fp8":
        return ("tiny Qwen3-Next, FP8 64 x 64 blocks" if args.tiny
                else "Qwen3-Next-80B-A3B shapes (random block-wise FP8 weights, 128 x 128)")
    if args.shape == "qwen3.5-35b-a3b-fp8":
        return ("tiny Qwen3.5-MoE, FP8 64 x 64 blocks" if args.tiny
                else "Qwen3.5-35B-A3B shapes (random block-wise FP8 weights, 128 x 128)")
    return "tiny Qwen3.5-MoE" if args.tiny else "Qwen3.5-35B-A3B shapes (random bf16 weights)"


def count_params(cfg: dict) -> dict:
    return nemotron_param_counts(cfg) if cfg["model_type"] == "nemotron_h" else param_counts(cfg)


def make_model_dir(cfg: dict, directory: Path) -> Path:
    """config.json plus the Qwen3.5 tokenizer files of the embedded default model (no weights); for
    Nemotron and Qwen3-Next shapes a word-level tokenizer of its vocabulary size (e2e_gpu_shapes.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if cfg["model_type"] in ("nemotron_h", "qwen3_next"):
        save_word_tokenizer(directory, cfg["vocab_size"])
        return directory
    source = ensure_default_model()
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, directory / name)
    return directory


def param_counts(cfg: dict) -> dict:
    """Parameters from the config. per_token: matmul weights one prompt token passes through
    (mixers, router, top-k routed experts, shared expert), without embedding and lm_head."""
    hidden, vocab = cfg["hidden_size"], cfg["vocab_size"]
    key_dim = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    value_dim = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim
    gdn = hidden * conv_dim + hidden * value_dim + 2 * hidden * cfg["linear_num_value_heads"] + value_dim * hidden
    heads, kv_heads, head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = hidden * heads * head_dim * 2 + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    experts, top_k = cfg["num_experts"], cfg["num_experts_per_tok"]
    expert = 3 * hidden * cfg["moe_intermediate_size"]
    shared = 3 * hidden * cfg["shared_expert_intermediate_size"] + hidden
    moe_active = hidden * experts + top_k * expert + shared
    moe_total = hidden * experts + experts * expert + shared
    mixers = sum(gdn if t == "linear_attention" else attn for t in cfg["layer_types"])
    layers = len(cfg["layer_types"])
    return {
        "per_token": mixers + layers * moe_active,
        "lm_head": hidden * vocab,
        "embedding": hidden * vocab,
        "total_matmul": mixers + layers * moe_total + 2 * hidden * vocab,
    }


def attention_share(cfg: dict) -> float:
    """Attention FLOPs a prompt token spends per earlier token (q.k and the weighted sum of v: 4 * heads
    * head_dim per full-attention layer; GDN and Mamba2 layers read no context), over the matmul FLOPs
    of the token (2 * `count_params(cfg)["per_token"]`): the time predictor's long-prompt term."""
    if cfg["model_type"] == "nemotron_h":
        attention_layers = cfg["hybrid_override_pattern"].count("*")
    else:
        attention_layers = cfg["layer_types"].count("full_attention")
    per_context = 4 * cfg["num_attention_heads"] * cfg["head_dim"] * attention_layers
    return per_context / (2 * count_params(cfg)["per_token"])


# ---------------------------------------------------------------- forkpoint runs

class EnqueueTimer:
    """Shadows `runner.execute` with an instance attribute: host seconds to build a step's metadata
    and enqueue its forward and sampling (the runner samples since issue 25: earlier runs did not count
    the sampler's enqueue here; nothing in it waits for the GPU, `PendingStep.result()` does)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.execute = runner.execute
        self.last: float | None = None

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.execute(*args, **kwargs)
        self.last = time.perf_counter() - start
        return out

    def install(self) -> None:
        self.runner.execute = self

    def remove(self) -> None:
        self.runner.__dict__.pop("execute", None)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def unwrap_model(model) -> torch.nn.Module:
    """The language model (the module owning `lm_head`) under a torch.compile or CUDA-graph
    wrapper, if any: its state_dict names the checkpoint's weights, which the peer needs."""
    found = model
    for _ in range(4):
        if isinstance(getattr(found, "lm_head", None), torch.nn.Module):
            return found
        found = next((getattr(found, name) for name in ("_orig_mod", "model", "module")
                      if getattr(found, name, None) is not None), None)
        if found is None:
            break
    return model


def eager_field() -> bool:
    return "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)}


def eager_switch(engine):
    """A runtime switch to eager execution, or None. `set_enforce_eager(bool)` if the engine or its
    runner offers one; else the runner's piecewise CUDA-graph forward is detached while eager
    (`runner.piecewise = None` is the path an `enforce_eager=True` engine takes: the model's plain
    forward on every step), which spares building a second 70 GB engine."""
    for owner in (engine, engine.runner):
        switch = getattr(owner, "set_enforce_eager", None)
        if callable(switch):
            return switch
    runner = engine.runner
    if "piecewise" not in vars(runner):
        return None
    graphs, decode_graphs = runner.piecewise, getattr(runner, "decode_graphs", None)

    def detach(eager: bool) -> None:
        runner.piecewise = None if eager else graphs
        if decode_graphs is not None:
            runner.decode_graphs = None if eager else decode_graphs

    return detach


class RowModes:
    """Runtime switches for the exact, auto and async rows, on one engine (a second 70 GB engine
    does not fit). Only the scheduler reads `checkpoint_exact` (where a checkpoint keeps its state,
    where prefill chunks end) and owns the automatic-checkpoint planner, and the engine reads its
    `async_scheduling` at every step, so switching them there is what an engine built with those
    settings would do. The other rows run with automatic checkpoints off (their off runs must
    compute every prompt whole) and synchronous scheduling."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.config = self.scheduler.config
        self.planner = self.scheduler.auto

    def set(self, spec: RowSpec) -> None:
        self.engine.async_scheduling = spec.engine == "async_scheduling"
        exact = spec.engine == "checkpoint_exact"
        if self.scheduler.config.checkpoint_exact != exact:
            self.scheduler.config = dataclasses.replace(self.config, checkpoint_exact=exact)
        self.scheduler.auto = self.planner if spec.engine == "auto_checkpoints" else None


def build_engine(args, model_dir: Path, enforce_eager: bool) -> LLM:
    kwargs = dict(load_format="dummy", dtype=args.dtype, device=args.device,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                  checkpoint_pool_size=args.checkpoint_pool_size, checkpoint_host_bytes=args.checkpoint_host_bytes)
    if args.tiny:
        kwargs.update(num_kv_blocks=4096)
    if enforce_eager:
        kwargs["enforce_eager"] = True
    if args.startup_compile_workers != "0":
        kwargs["startup_compile_workers"] = None if args.startup_compile_workers == "auto" else int(
            args.startup_compile_workers)
    return LLM(str(model_dir), **kwargs)


def engine_info(llm: LLM, init_s: float) -> dict:
    engine = llm.engine
    info = {
        "init_s": init_s, "params_in_model": sum(t.numel() for t in unwrap_model(engine.runner.model).parameters()),
        "kv_blocks": engine.block_pool.num_blocks, "block_size": engine.block_pool.block_size,
        "state_slots": engine.state_pool.requests.count, "checkpoint_slots": engine.state_pool.checkpoints.count,
        "max_num_batched_tokens": engine.config.max_num_batched_tokens, "max_num_seqs": engine.config.max_num_seqs,
        "enforce_eager": getattr(engine.config, "enforce_eager", None), "enforce_eager_field": eager_field(),
        "runtime_eager_switch": eager_switch(engine) is not None,
        "cuda_graph_sizes": getattr(getattr(engine.runner, "piecewise", None), "sizes", None),
        "decode_graph_sizes": getattr(getattr(engine.runner, "decode_graphs", None), "sizes", None),
        "start_up_warmup": dataclasses.asdict(engine.runner.warmup) if getattr(engine.runner, "warmup", None) else None,
    }
    model = unwrap_model(engine.runner.model)
    info["weights_gb"] = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()]) / 1e9
    info["fp8_weights_gb"] = sum(t.numel() for t in model.parameters() if t.dtype == torch.float8_e4m3fn) / 1e9
    startup = getattr(engine, "startup", None)
    if startup is not None:
        info["start_up_phases_s"] = {name: round(seconds, 2) for name, seconds in startup.phases}
    memory = getattr(engine, "memory", None)
    if memory is not None:
        info["memory_plan"] = memory.summary()
    if engine.device.type == "cuda":
        info["gpu_mem_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
        info["gpu_mem_peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        free, total = torch.cuda.mem_get_info(engine.device)
        info["gpu_mem_used_gb"] = (total - free) / 1e9  # the CUDA context and caching allocator included
    return info


class Bench:
    """One engine under test: runs on/off pairs, predicts their cost and records them in `results`."""

    def __init__(self, llm: LLM, label: str, args, results: dict, save) -> None:
        self.llm, self.engine, self.label, self.args = llm, llm.engine, label, args
        self.results, self.save = results, save
        self.per_token = results["params"]["per_token"]
        self.rng = np.random.default_rng(args.seed + (0 if label == "default" else 7))
        self.predictor = Predictor(args.max_num_batched_tokens, attention_share(results["config"]))
        self.timer = EnqueueTimer(self.engine.runner)
        self.timer.install()
        self.modes = RowModes(self.engine)

    def run(self, spec: RowSpec, on: bool, tag: str, record: bool = True) -> dict:
        engine, n = self.engine, spec.n
        self.modes.set(spec)
        anchor = self.rng.integers(0, self.args.vocab_limit, spec.p).tolist()
        marker = [self.llm.checkpoint_token_id] if on and spec.engine != "auto_checkpoints" else []
        prompts = [anchor + marker + self.rng.integers(0, self.args.vocab_limit, s).tolist()
                   for s in spec.suffix_lengths]
        params = SamplingParams(temperature=0.0, max_tokens=spec.max_tokens, ignore_eos=True)
        before = engine.metrics()
        sync(engine.device)
        start = time.perf_counter()
        requests, finish = [], {}
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params, stream=False)
            requests.append(engine.sequences(f"{tag}-{i}")[0])
        steps, computed, running = [], before["prompt_tokens_computed"], 0
        while engine.has_unfinished_requests():
            self.timer.last = None
            step_start = time.perf_counter()
            outputs = engine.step()
            now, mono = time.perf_counter(), time.monotonic()
            for output in outputs:
                if output.finished:
                    finish[output.request_id] = mono
            metrics = engine.metrics()
            steps.append({"prompt_tokens": metrics["prompt_tokens_computed"] - computed, "running": running,
                          "s": now - step_start, "enqueue_s": self.timer.last})
            computed, running = metrics["prompt_tokens_computed"], metrics["num_running"]
        sync(engine.device)
        wall = time.perf_counter() - start
        after = engine.metrics()
        ttft = [r.first_token_time - r.arrival_time for r in requests]
        tpot = ([(finish[f"{tag}-{i}"] - r.first_token_time) / (spec.max_tokens - 1) for i, r in enumerate(requests)]
                if spec.max_tokens > 1 else [])
        tokens = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
        row = {
            **spec.describe(), "checkpoints": "on" if on else "off", "suffix_tokens": sum(spec.suffix_lengths),
            "wall_s": wall, "requests_per_s": n / wall,
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "consumer_ttft_p50_ms": 1e3 * pct(ttft[1:], 50) if n > 1 else None,
            "consumer_ttft_p99_ms": 1e3 * pct(ttft[1:], 99) if n > 1 else None,
            "prompt_tokens_computed": tokens, "prompt_tokens_expected": spec.tokens(on),
            "prompt_tokens_total": spec.tokens(False),
            "checkpoint_hits": after["checkpoint_hits"] - before["checkpoint_hits"],
            "cached_tokens": [r.num_cached_tokens for r in requests][:4],
            "computed_tokens_per_s": tokens / wall, "prompt_tokens_per_s": spec.tokens(False) / wall,
            "mfu": 2 * self.per_token * tokens / wall / PEAK_BF16,
            "tpot_ms": 1e3 * pct(tpot, 50) if tpot else None, "tpot_p99_ms": 1e3 * pct(tpot, 99) if tpot else None,
            "steps": steps,
        }
        if record:
            self.predictor.observe(row)
        return row

    def default_run(self, spec: RowSpec, mode: str) -> int | None:
        """Index of the default engine's `mode` run (main or decode rows) of `spec`'s shape and N, if it ran."""
        key = (spec.base_group, spec.shape, spec.n, spec.max_tokens, "default", mode)
        found = [i for i, r in enumerate(self.results["runs"])
                 if (r["group"], r["shape"], r["N"], r["max_tokens"], r["engine"], r["checkpoints"]) == key]
        return found[-1] if found else None

    def pair(self, spec: RowSpec, predicted: float) -> None:
        indices = {}
        if spec.on_only:
            off = self.default_run(spec, "off")
            if off is None:
                skip(self.results, spec, f"the {spec.base_group} row's off run did not run")
                return
            indices["off"] = off
        for on in ((True,) if spec.on_only else (True, False)):
            mode = "on" if on else "off"
            row = self.run(spec, on, f"{spec.group}-{mode}-{spec.p}-{spec.n}-{spec.max_tokens}")
            indices[mode] = len(self.results["runs"])
            self.results["runs"].append(row)
            tpot = f"  TPOT {row['tpot_ms']:6.1f} ms" if row["tpot_ms"] is not None else ""
            warn = "" if row["prompt_tokens_computed"] == row["prompt_tokens_expected"] else "  UNEXPECTED"
            label = (spec.engine if spec.on_only else self.label)[:7]
            print(f"  {spec.shape:16s} N={spec.n:3d} mt={spec.max_tokens:2d} {label:7s} {mode:3s}: "
                  f"{row['requests_per_s']:8.2f} req/s  TTFT p50 {row['ttft_p50_ms']:7.0f} "
                  f"p99 {row['ttft_p99_ms']:7.0f} ms  computed {row['prompt_tokens_computed']:8d} "
                  f"(expected {row['prompt_tokens_expected']}){warn}  {row['computed_tokens_per_s']:8.0f} tok/s  "
                  f"MFU {100 * row['mfu']:4.1f}%  steps {len(row['steps'])}{tpot}", flush=True)
        on, off = (self.results["runs"][indices[m]] for m in ("on", "off"))
        speedup = on["requests_per_s"] / off["requests_per_s"]
        entry = {**spec.describe(), **indices, "speedup": speedup, "ideal": spec.ideal,
                 "fraction_of_ideal": speedup / spec.ideal, "predicted_s": predicted,
                 "measured_s": on["wall_s"] + (0.0 if spec.on_only else off["wall_s"])}
        default_on = self.default_run(spec, "on") if spec.on_only else None
        if default_on is not None:
            entry["vs_default_on"] = on["requests_per_s"] / self.results["runs"][default_on]["requests_per_s"]
        self.results["speedups"].append(entry)
        versus = f", {entry['vs_default_on']:.3f}x the default on run" if "vs_default_on" in entry else ""
        print(f"  -> on/off {speedup:.2f}x, ideal {spec.ideal:.2f}x ({100 * speedup / spec.ideal:.0f}%){versus}; "
              f"pair {entry['measured_s']:.1f} s (predicted {predicted:.1f} s)", flush=True)
        self.save()

    def prompt_misfit(self, spec: RowSpec) -> str | None:
        """Why `spec`'s longest prompt with its max_tokens cannot run on this engine (beyond
        max_model_len, or more KV blocks than the pool has), or None when it fits."""
        limits = self.engine.inputs.limits
        length = spec.p + max(spec.suffix_lengths) + spec.max_tokens
        if length > limits.max_model_len:
            return f"P + S + max_tokens = {length} tokens > max_model_len {limits.max_model_len}"
        blocks = -(-length // limits.block_size)
        if blocks > limits.max_kv_blocks:
            return f"P + S + max_tokens = {length} tokens need {blocks} KV blocks, the pool has {limits.max_kv_blocks}"
        return None

    def run_rows(self, specs: Sequence[RowSpec], end: float) -> None:
        """Every pair in order, unless its prompt does not fit the engine or it is predicted to end
        after `end` (then recorded as skipped, with the reason)."""
        for spec in specs:
            misfit = self.prompt_misfit(spec)
            if misfit is not None:
                skip(self.results, spec, misfit)
                continue
            left = end - time.perf_counter()
            predicted = self.predictor.pair_seconds(spec)
            if predicted > left:
                skip(self.results, spec, f"predicted {predicted:.0f} s, {max(left, 0):.0f} s left")
                continue
            self.pair(spec, predicted)

    def warm_up(self, specs: Sequence[RowSpec]) -> float:
        """Untimed: every shape on and off (N <= 4, max_tokens 2; shapes whose prompt does not fit
        the engine are left to `run_rows` to skip), then decode batches halving from the largest N
        to 1, so the kernels outside the CUDA graphs (captured at engine build) compile and autotune
        here rather than inside a timed row."""
        t0 = time.perf_counter()
        by_shape: dict[tuple[str, str], RowSpec] = {}
        for spec in specs:
            key = (spec.shape, spec.engine)
            if key not in by_shape or spec.n > by_shape[key].n:
                by_shape[key] = spec
        for spec in by_shape.values():
            warm = dataclasses.replace(spec, suffix_lengths=spec.suffix_lengths[:4], max_tokens=2)
            if self.prompt_misfit(warm) is not None:
                continue
            for on in ((True,) if spec.on_only else (True, False)):
                self.run(warm, on, f"warm-{self.label}-{spec.shape}-{spec.engine}-{on}", record=False)
        self.modes.set(specs[0])
        largest = max(spec.n for spec in specs)
        counts, remaining = [], largest
        while remaining > 1:
            counts.append(remaining // 2)
            remaining -= remaining // 2
        counts.append(remaining)
        params = [SamplingParams(temperature=0.0, max_tokens=2 + i, ignore_eos=True) for i in range(len(counts))]
        prompts = [{"prompt_token_ids": self.rng.integers(0, self.args.vocab_limit, 16).tolist()}
                   for _ in range(largest)]
        self.llm.generate(prompts, [p for p, c in zip(params, counts) for _ in range(c)], use_tqdm=False)
        sync(self.engine.device)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.timer.remove()


def full_steps(results: dict, tokens: int) -> dict:
    """Computed tokens/s of the default engine's steps of exactly `tokens` prompt tokens (full
    steps), plain (checkpoints off) and with checkpoints: median, min, max and count."""
    out = {}
    for mode in ("off", "on"):
        rates = [tokens / step["s"] for r in results["runs"] if r["engine"] == "default" and r["checkpoints"] == mode
                 for step in r["steps"] if step["prompt_tokens"] == tokens and step["s"] > 0]
        if rates:
            out[mode] = {"tokens_per_s_median": float(np.median(rates)), "min": float(np.min(rates)),
                         "max": float(np.max(rates)), "steps": len(rates)}
    return out


def slow_steps(results: dict, engine: str = "default", worst: int = 5) -> dict | None:
    """Every timed prefill step of `engine`'s max_tokens-1 runs against the least-squares fit
    a + b * tokens of those same steps: the largest measured / fitted ratios (a step that compiled
    or autotuned mid-run stands out here) and how many steps exceed twice their fitted time."""
    fit = step_fit(results, engine)
    if fit is None:
        return None
    a, b = fit["fixed_ms_per_step"] / 1e3, fit["us_per_token"] / 1e6
    steps = [(s["s"] / (a + b * s["prompt_tokens"]), s["prompt_tokens"], s["s"], r["shape"], r["N"], r["checkpoints"])
             for r in results["runs"] if r["max_tokens"] == 1 and r["engine"] == engine
             for s in r["steps"] if s["prompt_tokens"] > 0 and a + b * s["prompt_tokens"] > 0]
    steps.sort(reverse=True)
    return {"num_steps": len(steps), "over_2x": sum(1 for s in steps if s[0] > 2.0),
            "worst": [{"ratio": round(ratio, 2), "tokens": tokens, "ms": round(1e3 * sec, 1), "shape": shape, "N": n,
                       "ckpt": ckpt} for ratio, tokens, sec, shape, n, ckpt in steps[:worst]]}


LONG_GROUPS = ("long", "long_decode")


def long_summary(results: dict) -> list[dict]:
    """The long rows under their own key: every planned long pair in plan order, with its on/off
    requests/s, ratio and ideal, TTFT p50 and TPOT p50 per mode when it ran, else why it did not
    (its `skipped` reason, or the run's stop before it)."""
    key = ("group", "shape", "N", "max_tokens", "engine")
    pairs = {tuple(sp[k] for k in key): sp for sp in results["speedups"]}
    reasons = {tuple(sk.get(k) for k in key): sk["reason"] for sk in results["skipped"]}
    summary = []
    for planned in (p for p in results["plan"] if p["group"] in LONG_GROUPS):
        ident = tuple(planned[k] for k in key)
        entry = {k: planned[k] for k in ("group", "P", "S", "N", "max_tokens")}
        if ident in pairs:
            sp = pairs[ident]
            on, off = results["runs"][sp["on"]], results["runs"][sp["off"]]
            entry.update(speedup=sp["speedup"], ideal=sp["ideal"])
            for mode, run in (("on", on), ("off", off)):
                entry.update({f"{mode}_requests_per_s": run["requests_per_s"],
                              f"{mode}_ttft_p50_ms": run["ttft_p50_ms"], f"{mode}_tpot_ms": run["tpot_ms"]})
        else:
            entry["skipped"] = reasons.get(ident, "not reached: the run stopped before it")
        summary.append(entry)
    return summary


def skip(results: dict, spec: RowSpec, reason: str) -> None:
    print(f"skip {spec.group} {spec.shape} N={spec.n} max_tokens={spec.max_tokens} {spec.engine}: {reason}", flush=True)
    results["skipped"].append({**spec.describe(), "reason": reason})


def probes(llm: LLM, rng: np.random.Generator, results: dict, limit: int) -> None:
    """Top-20 logprobs of one prompt (the peer's parity probe), and the same prompt read through a
    200-token checkpoint: how far bf16 results move with the execution path alone."""
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)
    probe_ids = rng.integers(0, limit, 256).tolist()
    reference = llm.generate([{"prompt_token_ids": probe_ids}], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    results["parity_probe"] = {"token_ids": probe_ids, "logprobs": reference}
    marker = llm.checkpoint_token_id
    pair = llm.generate([{"prompt_token_ids": probe_ids[:200] + [marker] + rng.integers(0, limit, 56).tolist()},
                         {"prompt_token_ids": probe_ids[:200] + [marker] + probe_ids[200:]}], params, use_tqdm=False)
    consumer = pair[1].outputs[0].logprobs[0]
    results["path_dependence"] = {
        "consumer_cached_tokens": pair[1].num_cached_tokens,
        "checkpoint_vs_plain_max_logprob_diff_top20": max(abs(consumer[t] - v) for t, v in reference.items()
                                                          if t in consumer),
        "same_argmax": max(consumer, key=consumer.get) == max(reference, key=reference.get),
    }
    print(f"path dependence: {results['path_dependence']}", flush=True)


# ---------------------------------------------------------------- profile

KERNEL_GROUPS = (
    ("fp8_activation_quant", ("_quantize_kernel",)),  # kernels/fp8: per-token-group activation scales
    ("moe_grouped_gemm", ("Group", "grouped", "_expert_gemm")),
    ("gdn_fla", ("chunk_", "solve_tril", "l2norm", "recompute_w_u", "fused_recurrent", "kkt", "cumsum")),
    ("attention", ("_paged_attn", "_paged_decode_split", "_combine_splits")),
    ("gdn_recurrent", ("_inplace_step_kernel", "_recurrent")),  # the delta-rule decode step (not conv1d's)
    ("conv1d", ("_varlen_kernel", "_step_kernel", "_step_inplace_kernel")),
    ("dense_gemm", ("gemm", "Gemm", "cutlass", "nvjet", "xmma", "sm90", "_linear_kernel")),
    ("copy_index", ("index", "copy", "Copy", "gather", "scatter", "cat", "sort", "Sort")),
)


def kernel_group(name: str) -> str:
    for group, needles in KERNEL_GROUPS:
        if any(n in name for n in needles):
            return group
    return "elementwise_other"


def kernel_report(prof, wall_s: float, enqueue_s: float) -> dict:
    """One profiled step: wall and enqueue ms, kernel ms by group and in all, launches, the fraction of
    the step's window in which a kernel ran, the top kernels, and every kernel (name, launches, ms)."""
    kernels = [e for e in prof.key_averages() if getattr(e, "self_device_time_total", 0) > 0
               and "cuda" in str(getattr(e, "device_type", "")).lower()]
    groups: dict[str, float] = {}
    for e in kernels:
        groups[kernel_group(e.key)] = groups.get(kernel_group(e.key), 0.0) + e.self_device_time_total / 1e3
    ranked = sorted(kernels, key=lambda e: -e.self_device_time_total)
    return {
        "wall_ms": 1e3 * wall_s, "enqueue_ms": 1e3 * enqueue_s,
        "gpu_kernel_ms": sum(groups.values()), "kernel_launches": sum(e.count for e in kernels),
        "gpu_busy_fraction": round(busy_fraction(prof, 1e6 * wall_s), 4),
        "by_group_ms": groups, "top": [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3))
                                       for e in ranked[:12]],
        "kernels": [(e.key[:160], e.count, round(e.self_device_time_total / 1e3, 4)) for e in ranked],
    }


def print_kernel_report(name: str, report: dict) -> None:
    groups = sorted(report["by_group_ms"].items(), key=lambda kv: -kv[1])
    print(f"profile {name}: wall {report['wall_ms']:.1f} ms, enqueue {report['enqueue_ms']:.1f} ms, kernels "
          f"{report['gpu_kernel_ms']:.1f} ms in {report['kernel_launches']} launches (GPU busy "
          f"{100 * report['gpu_busy_fraction']:.0f}%), { {k: round(v, 1) for k, v in groups} }", flush=True)


def profile_one_step(bench: Bench, name: str) -> dict:
    """One `engine.step()` of `bench`'s engine under torch.profiler, from an idle device: its
    `kernel_report`, printed as `name`."""
    from torch.profiler import ProfilerActivity, profile

    engine = bench.engine
    sync(engine.device)
    activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        start = time.perf_counter()
        engine.step()
        wall = time.perf_counter() - start
        sync(engine.device)
    report = kernel_report(prof, wall, bench.timer.last or 0.0)
    print_kernel_report(name, report)
    return report


def trace_one_step(bench: Bench, path: Path) -> dict:
    """One `engine.step()` under torch.profiler with CPU and CUDA activity and Python stacks (slower host
    code than unprofiled: read shares, not times), its Chrome trace written gzipped to `path`: the
    device's idle gaps and the frames the host ran in them (bench/trace_gaps.py)."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    engine = bench.engine
    sync(engine.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        engine.step()
        sync(engine.device)
    plain = path.with_suffix("")
    prof.export_chrome_trace(str(plain))
    with open(plain, "rb") as f:
        trace = json.load(f)
    with open(plain, "rb") as f, gzip.open(path, "wb") as out:
        out.write(f.read())
    plain.unlink()
    report = idle_report(trace, min_gap_us=5.0)
    print(f"idle of the traced step: {json.dumps(report)[:3000]}", flush=True)
    return report


def profile_mixed_step(bench: Bench, args, decodes: int = 31, context: int = 3800, new_tokens: int = 272,
                       repeats: int = 5) -> dict:
    """A reused chat turn's step (issue 26): `new_tokens` prompt tokens after a `context`-token checkpoint,
    beside `decodes` decoding streams. A producer computes the context and its checkpoint first; each of
    `repeats` consumers then arrives alone beside the streams: the first `repeats - 2` steps are timed
    (`mixed_*_wall_ms`; host time by part per step, `mixed_*_host_parts_ms`: parts nest, `execute` holds
    `forward`, which holds the piecewise parts), the next is profiled, the last traced with Python stacks
    (`trace_one_step`: where the GPU idled, `mixed_*_idle`); then a decode-only step of the same streams is
    profiled, and five more timed by part. The consumer runs beside the streams only if `decodes` + 1 fits
    max_num_seqs (else it waits for a stream to finish its 512 tokens): the caller bounds `decodes`."""
    engine, rng, marker = bench.engine, bench.rng, bench.llm.checkpoint_token_id
    context_ids = rng.integers(0, args.vocab_limit, context).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)

    def finish(request_id: str, prompt: list[int], sampling: SamplingParams = params) -> None:
        engine.add_request(request_id, {"prompt_token_ids": prompt}, sampling, stream=False)
        while engine.sequences(request_id):
            engine.step()

    finish("mixed-producer", context_ids + [marker] + rng.integers(0, args.vocab_limit, 8).tolist())
    streams = [f"mixed-stream-{i}" for i in range(decodes)]
    long_params = SamplingParams(temperature=0.0, max_tokens=512, ignore_eos=True)
    for request_id in streams:
        engine.add_request(request_id, {"prompt_token_ids": rng.integers(0, args.vocab_limit, 64).tolist()},
                           long_params, stream=False)
    for _ in range(3):
        engine.step()
    name = f"mixed_{new_tokens}_after_{context}_beside_{decodes}_decodes"
    report: dict = {}
    walls, prefilled = [], []
    timers = Timers()
    for k in range(repeats):
        consumer = f"mixed-consumer-{k}"
        engine.add_request(consumer, {"prompt_token_ids": context_ids + [marker]
                                      + rng.integers(0, args.vocab_limit, new_tokens).tolist()}, params, stream=False)
        computed = engine.metrics()["prompt_tokens_computed"]
        sync(engine.device)
        if k < repeats - 2:
            with instrumented(engine, timers, pieces=True):
                start = time.perf_counter()
                engine.step()
                sync(engine.device)
            walls.append(1e3 * (time.perf_counter() - start))
        elif k == repeats - 2:
            report[name] = profile_one_step(bench, name)
        else:
            report[f"{name}_idle"] = trace_one_step(bench, Path(args.out) / f"{args.name}_{name}.trace.json.gz")
        prefilled.append(engine.metrics()["prompt_tokens_computed"] - computed)
        while engine.sequences(consumer):
            engine.step()
    report[f"{name}_wall_ms"] = walls
    report[f"{name}_host_parts_ms"] = {part: round(1e3 * seconds / len(walls), 3) for part, seconds in
                                       sorted(timers.seconds.items(), key=lambda kv: -kv[1])}
    report[f"{name}_host_part_calls"] = {part: calls // len(walls) for part, calls in timers.calls.items()}
    report[f"{name}_prompt_tokens_computed"] = prefilled
    report[f"decode_{decodes}_beside"] = profile_one_step(bench, f"decode_{decodes}_beside")
    decode_timers, decode_walls = Timers(), []
    for _ in range(5):
        with instrumented(engine, decode_timers):
            start = time.perf_counter()
            engine.step()
            sync(engine.device)
        decode_walls.append(1e3 * (time.perf_counter() - start))
    report[f"decode_{decodes}_beside_wall_ms"] = [round(w, 2) for w in decode_walls]
    report[f"decode_{decodes}_beside_host_parts_ms"] = {
        part: round(1e3 * seconds / len(decode_walls), 3)
        for part, seconds in sorted(decode_timers.seconds.items(), key=lambda kv: -kv[1])}
    print(f"decode steps beside (unprofiled) ms: {report[f'decode_{decodes}_beside_wall_ms']}; host ms per step by "
          f"part: {report[f'decode_{decodes}_beside_host_parts_ms']}", flush=True)
    print(f"mixed step walls (unprofiled) ms: {[round(w, 1) for w in walls]}; prompt tokens computed: {prefilled}; "
          f"host ms per step by part: {report[f'{name}_host_parts_ms']}", flush=True)
    for request_id in streams:
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return report


def profile_steps(bench: Bench, args, end: float) -> dict:
    """Kernel time by kind for single steps (torch.profiler): a full plain prefill step (two prompts
    of max_num_batched_tokens / 2), one P+S prompt plain and through a checkpoint (two phases), and
    decode steps of 16 and of the largest decode N sequences. Cases not started by `end` are left out."""
    engine, rng, marker = bench.engine, bench.rng, bench.llm.checkpoint_token_id
    half, p = args.max_num_batched_tokens // 2, min(args.p)
    cases = {
        f"prefill_{2 * half}_plain": ([rng.integers(0, args.vocab_limit, half).tolist() for _ in range(2)], 1, 0),
        f"prefill_{p + args.s}_plain": ([rng.integers(0, args.vocab_limit, p + args.s).tolist()], 1, 0),
        f"prefill_{p + args.s}_checkpoint": ([rng.integers(0, args.vocab_limit, p).tolist() + [marker]
                                              + rng.integers(0, args.vocab_limit, args.s).tolist()], 1, 0),
    }
    decode_graphs = getattr(engine.runner, "decode_graphs", None)
    for n in sorted({1, min(16, max(args.decode_n)), min(64, max(args.decode_n)), max(args.decode_n)}):
        cases[f"decode_{n}"] = ([rng.integers(0, args.vocab_limit, 64).tolist() for _ in range(n)], 3, -1)
        if decode_graphs is not None and n in (1, min(16, max(args.decode_n)), max(args.decode_n)):
            # the same step without the whole-step decode graph (piecewise graphs + eager cores): before/after
            cases[f"decode_{n}_piecewise"] = ([rng.integers(0, args.vocab_limit, 64).tolist() for _ in range(n)], 3, -1)
    report = {}
    engine.async_scheduling = False  # one forward per profiled step (the async rows may have left it on)
    for name, (prompts, max_tokens, profiled_step) in cases.items():
        if time.perf_counter() > end:
            report.setdefault("left_out", []).append(name)
            continue
        engine.runner.decode_graphs = None if name.endswith("_piecewise") else decode_graphs
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        ids = [f"prof-{name}-{i}" for i in range(len(prompts))]
        for request_id, prompt in zip(ids, prompts):
            engine.add_request(request_id, {"prompt_token_ids": prompt}, params, stream=False)
        while engine.has_unfinished_requests():
            decoding = all(engine.sequences(i)[0].num_computed_tokens >= len(prompts[0])
                           for i in ids if engine.sequences(i))
            if (profiled_step == 0 and name not in report) or (profiled_step < 0 and decoding and name not in report):
                report[name] = profile_one_step(bench, name)
            else:
                engine.step()
    engine.runner.decode_graphs = decode_graphs
    if time.perf_counter() > end:
        report.setdefault("left_out", []).append("mixed")
    else:
        report.update(profile_mixed_step(bench, args, decodes=min(31, args.max_num_seqs - 1)))
    for n in sorted({1, min(64, max(args.decode_n))}):
        if time.perf_counter() > end:
            report.setdefault("left_out", []).append(f"host_decode_{n}")
            continue
        timeline = decode_host_timeline(engine, [rng.integers(0, args.vocab_limit, 64).tolist() for _ in range(n)])
        report[f"host_decode_{n}"] = timeline
        print(f"profile host_decode_{n}: {timeline}", flush=True)
    return report


# ---------------------------------------------------------------- tiny parity and smoke test

def tiny_parity(args) -> dict:
    """forkpoint vs transformers on a 4-layer model with the same kernels and dtype: top-20
    logprobs of one 256-token prompt (implementation parity, apart from bf16 rounding)."""
    cfg = model_config(args, tiny=True)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(cfg, Path(tmp) / "tiny")
        llm = LLM(str(model_dir), load_format="dummy", dtype=args.dtype, device=args.device, num_kv_blocks=64,
                  num_state_slots=4, max_num_seqs=4)
        ids = np.random.default_rng(args.seed + 2).integers(0, args.vocab_limit, 256).tolist()
        ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20),
                            use_tqdm=False)[0].outputs[0].logprobs[0]
        model = unwrap_model(llm.engine.runner.model)
        del llm
        peer, _ = build_peer(cfg, model, torch.device(args.device))
        with torch.inference_mode():
            logits = peer(input_ids=torch.tensor([ids], device=args.device), use_cache=False,
                          logits_to_keep=1).logits[0, -1].float()
        theirs = torch.log_softmax(logits, -1)
        result = {"max_logprob_diff_top20": max(abs(float(theirs[t]) - v) for t, v in ours.items()),
                  "same_argmax": int(logits.argmax()) == max(ours, key=ours.get)}
    print(f"tiny parity (4 layers, {args.dtype}): {result}", flush=True)
    return result


SMOKE_ARGS = dict(tiny=True, p=[72, 16], s=8, n=[1, 3], exact_n=[3], auto_n=[3], async_n=[3], decode_p=[16],
                  decode_n=[3], long_p=[256, 512], long_n=[1, 3], long_decode_p=[512], long_decode_n=[3],
                  decode_tokens=3, seed_p=16,
                  seed_s=(4, 12), seed_n=[3], eager_p=16, eager_n=[3], eager_rows=True, peer_p=[16], peer_n=[1, 3],
                  peer_batch=2, profile=True, tiny_parity=True, profile_reserve=2.0, max_num_batched_tokens=96,
                  max_num_seqs=8, deadline=58.0, time_budget=48.0, peer_budget=5.0, name="e2e_gpu_smoke")


def check_smoke(results: dict) -> None:
    """The token counts add up in every run, every planned pair either ran or was skipped with a
    reason, and max_tokens > 1 rows have a TPOT. Row kinds the time limits left out (a loaded
    machine) are named, not failed: the budget logic is doing its job there."""
    assert not results.get("error"), results.get("error")
    bad = [(r["shape"], r["N"], r["checkpoints"]) for r in results["runs"]
           if r["prompt_tokens_computed"] != r["prompt_tokens_expected"]]
    assert not bad, f"prompt tokens computed differ from expected: {bad}"
    assert all(r["tpot_ms"] is not None for r in results["runs"] if r["max_tokens"] > 1)
    key = ("group", "shape", "N", "max_tokens", "engine")
    done = {tuple(r[k] for k in key) for r in results["runs"]}
    skipped = {tuple(s[k] for k in key) for s in results["skipped"] if s.get("reason")}
    missing = [p for p in results["plan"] if tuple(p[k] for k in key) not in done | skipped]
    assert not missing, f"planned pairs neither run nor skipped: {missing}"
    groups = {"main", "exact", "auto", "decode", "decode_async", "seed", "long", "long_decode", "eager"}
    uncovered = sorted(groups - {r["group"] for r in results["runs"]})
    if not results.get("peer", {}).get("runs"):
        uncovered.append("peer")
    print(f"smoke: benchmark OK{'; not run (see skipped): ' + ', '.join(uncovered) if uncovered else ''}",
          flush=True)


# ---------------------------------------------------------------- main

def machine_info(device: torch.device) -> dict:
    info = {"python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    try:
        import transformers
        import triton

        info.update(transformers=transformers.__version__, triton=triton.__version__)
    except ImportError:
        pass
    try:
        import fla

        info["fla"] = getattr(fla, "__version__", "?")
    except ImportError:
        info["fla"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_gb=props.total_memory / 1e9, sms=props.multi_processor_count)
    return info


def free_engine(bench: Bench) -> None:
    """Drop an engine with its pools and weights (nothing else may hold them)."""
    bench.close()
    bench.llm = bench.engine = None
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_eager_rows(args, bench: Bench, specs: Sequence[RowSpec], model_dir: Path, end: float, results: dict,
                   save) -> Bench:
    """The eager comparison: a runtime switch, else (with --eager-rows) a second engine. Returns the
    engine in use afterwards (the peer takes its weights)."""
    switch = eager_switch(bench.engine)
    if switch is not None:
        switch(True)
        bench.close()
        eager = Bench(bench.llm, "enforce_eager", args, results, save)
        results["eager_switch"] = "runtime"
        try:
            if end - time.perf_counter() > eager.predictor.pair_seconds(min(specs, key=lambda s: s.tokens(False))):
                results["eager_warmup_s"] = eager.warm_up(specs)
            eager.run_rows(specs, end)
        finally:
            switch(False)
        return eager
    if not eager_field():
        for spec in specs:
            skip(results, spec, "EngineConfig has no enforce_eager field (no CUDA graphs to compare with)")
        return bench
    build_s = results["engine"]["init_s"] + 20.0
    cheapest = Predictor(args.max_num_batched_tokens, attention_share(results["config"])).pair_seconds(
        min(specs, key=lambda s: s.tokens(False)))
    left = end - time.perf_counter()
    if not args.eager_rows or build_s + cheapest > left:
        reason = ("no runtime switch; --eager-rows builds a second engine" if not args.eager_rows else
                  f"a second engine ({build_s:.0f} s) + the cheapest pair ({cheapest:.0f} s) > {left:.0f} s left")
        for spec in specs:
            skip(results, spec, reason)
        return bench
    free_engine(bench)
    t0 = time.perf_counter()
    llm = build_engine(args, model_dir, enforce_eager=True)
    sync(llm.engine.device)
    results["eager_engine"] = engine_info(llm, time.perf_counter() - t0)
    results["eager_switch"] = "second engine"
    eager = Bench(llm, "enforce_eager", args, results, save)
    results["eager_warmup_s"] = eager.warm_up(specs)
    print(f"eager engine: {results['eager_engine']}", flush=True)
    eager.run_rows(specs, end)
    return eager


def run_benchmark(args) -> dict:
    device = torch.device(args.device)
    cfg = model_config(args, args.tiny)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = count_params(cfg)
    deadline = PROCESS_START + args.deadline if args.deadline else None
    time_budget = args.time_budget or (args.deadline - args.peer_budget - FINALIZE_S if args.deadline else 240.0)
    rows_end = PROCESS_START + time_budget
    plan = plan_rows(args)
    results = {
        "model": model_label(args), "shape": args.shape,
        "config": cfg, "params": counts, "machine": machine_info(device), "code": code_version(),
        "command": " ".join(sys.argv), "S": args.s, "runs": [], "speedups": [], "skipped": [],
        "quantization": cfg.get("quantization_config"), "peer_note": args.peer_note,
        "budget": {"deadline_s": args.deadline, "time_budget_s": time_budget, "peer_budget_s": args.peer_budget},
        "plan": [spec.describe() for spec in plan.in_run_order()],
        "flops_per_token": 2 * counts["per_token"], "peak_flops": PEAK_BF16,
        "compute_floor_tokens_s": {"anchors_6gflop_790tflops": ANCHOR_FLOOR_TOKENS_S,
                                   "per_token_params_790tflops": MEASURED_BF16 / (2 * counts["per_token"]),
                                   "per_token_params_989tflops": PEAK_BF16 / (2 * counts["per_token"])},
    }

    def save() -> None:
        (out / f"{args.name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    def elapsed() -> float:
        return time.perf_counter() - PROCESS_START

    print(f"params: {counts}; budget: {results['budget']}; {len(plan.rows)} pairs planned + {len(plan.long)} long "
          f"+ {len(plan.eager)} eager", flush=True)
    alarm = Alarm()
    bench = None
    try:
        alarm.arm(deadline, "hard deadline")
        if args.tiny_parity:
            results["tiny_parity"] = tiny_parity(args)
            gc.collect()
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_model_dir(cfg, Path(tmp) / "model")
            t0 = time.perf_counter()
            llm = build_engine(args, model_dir, enforce_eager=False)
            sync(llm.engine.device)
            results["engine"] = engine_info(llm, time.perf_counter() - t0)
            print(f"engine ready at {elapsed():.0f} s: {results['engine']}", flush=True)
            bench = Bench(llm, "default", args, results, save)
            del llm
            results["warmup_s"] = bench.warm_up(plan.rows or plan.long)  # long rows alone: warm up on theirs
            print(f"warm-up {results['warmup_s']:.1f} s (at {elapsed():.0f} s)", flush=True)
            probes(bench.llm, bench.rng, results, args.vocab_limit)
            rows_before_profile = rows_end - (args.profile_reserve if args.profile else 0.0)
            bench.run_rows(plan.rows, rows_before_profile)
            bench.run_rows(plan.long, rows_before_profile)
            results["predictor"] = bench.predictor.coefficients()
            if args.profile:
                try:
                    results["profile"] = profile_steps(bench, args, rows_end)
                except Exception:  # evidence only: never lose the rows for it
                    results["profile_error"] = traceback.format_exc()[-2000:]
                save()
            if args.stall_p:
                results["stall"] = []
                for prompt_tokens in args.stall_p:
                    for budget in args.stall_budgets:
                        if time.perf_counter() > rows_end:
                            results["skipped"].append({"group": "stall", "P": prompt_tokens, "budget": budget,
                                                       "reason": "no time left"})
                            continue
                        results["stall"].append(stall_row(bench.engine, prompt_tokens, args.stall_streams, budget,
                                                          bench.rng, args.vocab_limit))
                        print_row(results["stall"][-1])
                        save()
            if args.tiny:
                bench.engine.check_integrity()
            if plan.eager:
                bench = run_eager_rows(args, bench, plan.eager, model_dir, rows_end, results, save)
        results["step_fit"] = [fit for fit in (step_fit(results, e) for e in ("default", "enforce_eager")) if fit]
        results["full_steps"] = full_steps(results, args.max_num_batched_tokens)
        results["slow_steps"] = slow_steps(results)
        results["tpot"] = {f"N={r['N']} {r['checkpoints']}": r["tpot_ms"] for r in results["runs"]
                           if r["group"] == "decode" and r["engine"] == "default"}
        print(f"full steps: {results['full_steps']}; TPOT p50 ms: {results['tpot']}; "
              f"slowest steps against the fit: {results['slow_steps']}", flush=True)
        print(f"step fit: {results['step_fit']}; forkpoint done at {elapsed():.0f} s", flush=True)
        save()
        if not args.no_peer:
            model = unwrap_model(bench.engine.runner.model)
            free_engine(bench)  # the pools go; the weights stay (held by `model`) for the peer
            bench = None
            peer_end = time.perf_counter() + args.peer_budget
            if deadline is not None:
                peer_end = min(peer_end, deadline - FINALIZE_S)
            reason = "peer budget"
            try:
                alarm.arm(peer_end, "peer budget")
                run_peer(args, cfg, model, results, save)
                alarm.arm(deadline, "hard deadline")
            except OutOfTime as stop:
                if str(stop) != "peer budget":
                    raise
                print(f"peer stopped by its budget at {elapsed():.0f} s", flush=True)
            except Exception as err:  # report, keep forkpoint's results
                reason = f"peer failed: {err!r}"[:200]
                results["peer_error"] = traceback.format_exc()[-3000:]
                print(reason, flush=True)
            alarm.arm(deadline, "hard deadline")
            done = {(r["P"], r["N"]) for r in results.get("peer", {}).get("runs", [])}
            results["skipped"] += [{"group": "peer", "shape": f"P={p} S={args.s}", "N": n, "max_tokens": 1,
                                    "engine": "transformers", "reason": reason}
                                   for p in args.peer_p for n in args.peer_n if (p, n) not in done]
    except OutOfTime as stop:
        results["error"] = f"stopped by the {stop} at {elapsed():.0f} s"
        print(results["error"], flush=True)
    except Exception:
        results["error"] = traceback.format_exc()[-3000:]
        print(results["error"], flush=True)
    finally:
        alarm.disarm()
        results["long"] = long_summary(results)
        results["total_s"] = elapsed()
        if device.type == "cuda":
            results["gpu_mem_peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
        save()
        if results["speedups"]:
            plot(results, out / f"{args.name}.png")
        print(table(results))
        print(f"wrote {out / (args.name + '.json')} in {results['total_s']:.0f} s")
    return results


def fp8_restrictions(args) -> None:
    """FP8 shapes run without the peer and the tiny parity check: transformers would need forkpoint's
    FP8 tensors (e4m3 weights and their `weight_scale_inv`) in its own FP8 integration. Sets
    `args.peer_note` (None for the bf16 shapes) and turns both off."""
    args.peer_note = None
    if args.shape in FP8_SHAPES:
        args.peer_note = "FP8 shapes have no peer: transformers does not run forkpoint's block-wise FP8 tensors"
        args.no_peer, args.tiny_parity = True, False


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def parse_budgets(text: str) -> list[int | None]:
    return [None if part == "none" else int(part) for part in text.split(",") if part]


def parse_range(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split("-"))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"suffix range {text!r}: expected LO-HI with 0 < LO <= HI")
    return lo, hi


def build_parser() -> argparse.ArgumentParser:
    """The command line (module docstring); `main` adds what it derives from the engine's config."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="auto", help="auto: cuda when available, else cpu")
    parser.add_argument("--dtype", default="auto", help="auto: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--shape", choices=SHAPES, default=SHAPES[0],
                        help="model shapes: Qwen3.5-35B-A3B (default) or NVIDIA-Nemotron-3-Nano-30B-A3B")
    parser.add_argument("--tiny", action="store_true", help="tiny model (dry run)")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny engine checks, then every row kind with a tiny model and tiny N (< 60 s)")
    parser.add_argument("--p", type=parse_ints, default=[4096, 624], help="anchors of the main rows")
    parser.add_argument("--s", type=int, default=256, help="suffix length of the main, decode and eager rows")
    parser.add_argument("--n", type=parse_ints, default=[1, 4, 16, 64, 256])
    parser.add_argument("--exact-n", type=parse_ints, default=[16, 64, 256],
                        help="main rows repeated with checkpoint_exact at these N (empty: none)")
    parser.add_argument("--auto-n", type=parse_ints, default=[16, 256],
                        help="main rows repeated without the marker, automatic checkpoints on, at these N")
    parser.add_argument("--async-n", type=parse_ints, default=[1, 16, 64, 256],
                        help="decode rows repeated with asynchronous scheduling at these N (empty: none)")
    parser.add_argument("--decode-p", type=parse_ints, default=[624])
    parser.add_argument("--decode-n", type=parse_ints, default=[1, 16, 64, 256], help="TPOT at these batch sizes")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--seed-p", type=int, default=624, help="the seed's shape: anchor")
    parser.add_argument("--seed-s", type=parse_range, default=(350, 650), help="the seed's suffix lengths, LO-HI")
    parser.add_argument("--seed-n", type=parse_ints, default=[1, 4, 16, 64, 256])
    parser.add_argument("--eager-p", type=int, default=624)
    parser.add_argument("--eager-n", type=parse_ints, default=[4, 16], help="empty: no eager comparison")
    parser.add_argument("--eager-rows", action="store_true",
                        help="without a runtime switch, build a second engine with enforce_eager=True for them")
    parser.add_argument("--long-p", type=parse_ints, default=[32768, 131072],
                        help="anchors of the long rows, after the others (empty: none)")
    parser.add_argument("--long-n", type=parse_ints, default=[1, 4, 16], help="N of the long rows")
    parser.add_argument("--long-decode-p", type=parse_ints, default=[32768],
                        help="anchors of the TPOT rows at long context, after the long rows (empty: none)")
    parser.add_argument("--long-decode-n", type=parse_ints, default=[1, 16], help="N of the long TPOT rows")
    parser.add_argument("--peer-p", type=parse_ints, default=[624, 4096, 32768],
                        help="the peer's anchors, in this order (its budget cuts the last first)")
    parser.add_argument("--peer-n", type=parse_ints, default=[1, 4, 16])
    parser.add_argument("--peer-batch", type=int, default=4)
    parser.add_argument("--peer-layers", type=int, default=8,
                        help="time the peer's first K layers and scale its wall by layers / K (0: all)")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--tiny-parity", action="store_true", help="forkpoint vs transformers on a 4-layer model first")
    parser.add_argument("--profile", action="store_true", help="kernel time by kind for a few single steps")
    parser.add_argument("--profile-reserve", type=float, default=15.0, help="seconds the rows leave for --profile")
    parser.add_argument("--stall-p", type=parse_ints, default=[],
                        help="after the rows (and --profile): one prompt of each length beside --stall-streams "
                             "decoding streams, the streams' largest step over their decode step "
                             "(bench/long_prompt_stall.py), per --stall-budgets")
    parser.add_argument("--stall-budgets", type=parse_budgets, default=[None, 2048, 512],
                        help="prefill tokens a step that decodes may take in the --stall-p rows; 'none': no cap")
    parser.add_argument("--stall-streams", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--checkpoint-pool-size", type=int, default=None,
                        help="checkpoint state rows (default: the engine's, a share of the memory budget; 64 gives "
                             "the engine of the runs before session 9 for like-for-like rows)")
    parser.add_argument("--checkpoint-host-bytes", type=int, default=None,
                        help="host tier bytes (default: the engine's, sized from the machine on CUDA; 0: off, as "
                             "before session 9)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--deadline", type=float, default=0.0,
                        help="hard limit, seconds from process start (0: none); results are written when it hits")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="forkpoint rows end this many seconds from start (default: deadline - peer budget - 5)")
    parser.add_argument("--peer-budget", type=float, default=60.0, help="seconds for the peer after the forkpoint rows")
    parser.add_argument("--out", default=None, help="result folder (default bench/results; --smoke: a temporary one)")
    parser.add_argument("--name", default="e2e_gpu_h200")
    parser.add_argument("--startup-compile-workers", default="0",
                        help="EngineConfig.startup_compile_workers: a count, 'auto' (None: the engine picks, as "
                             "`forkpoint serve`) or 0 (default: none, the engine compiles alone)")
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.startup_compile_workers != "auto" and not args.startup_compile_workers.isdigit():
        parser.error(f"--startup-compile-workers {args.startup_compile_workers!r}: expected a count >= 0 or 'auto'")
    logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)9.0f ms %(levelname)s %(name)s: %(message)s")
    logging.getLogger("forkpoint").setLevel(logging.INFO)  # the start-up phases as they end, in the log
    args.scan_chunk = SCAN_CHUNK_TOKENS
    args.vocab_limit = vocab_limit(model_config(args, tiny=False))
    args.auto_min_tokens = EngineConfig.auto_checkpoint_min_tokens
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.dtype == "auto":
        args.dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    if args.smoke:
        if args.device == "cpu":
            torch.set_num_threads(1)  # tiny matrices: one thread is as fast, and robust to a shared machine
        vars(args).update({k: v for k, v in SMOKE_ARGS.items() if not (k == "deadline" and args.deadline)})
        fp8_restrictions(args)
        with tempfile.TemporaryDirectory() as tmp:
            args.out = args.out or tmp
            check_smoke(run_benchmark(args))
        return
    fp8_restrictions(args)
    args.out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    run_benchmark(args)


if __name__ == "__main__":
    main()
