"""End-to-end 1-to-N scoring on one GPU at Qwen3.5-35B-A3B shapes, seeded random bf16 weights.

Workload (DESIGN.md section 2): an anchor of P random token ids, the checkpoint marker, then N
suffixes of S random ids each, max_tokens 1 (scoring), greedy. Every run draws a fresh anchor, so
nothing is cached from an earlier run.

- checkpoints ON: prompts `anchor + marker + suffix`; the first request produces the checkpoint,
  the others consume it (in the same step when the token budget allows, else from the ready one).
- checkpoints OFF: the same prompts without the marker, on the same engine. Without a marker no
  checkpoint is registered and the fresh anchor matches none from before, so every request
  computes its whole prompt (checked: prompt_tokens_computed grows by N * (P + S)). One engine
  serves both (the 35B model is 70 GB in bf16: two do not fit beside their caches).

Per run: requests/s (N / wall time from the first add_request to the last output), TTFT p50/p99
(Request.first_token_time - arrival, recorded by the engine after the step's sampling sync),
prompt tokens computed (metrics delta), MFU = 2 * active params per token * tokens computed /
wall / 989e12 (dense bf16 peak; active params per token from the config: the matmul weights a
token passes through, without embedding and lm_head, which runs on sampled rows only), and the
on/off speedup against the ideal N(P+S)/(P+NS). Each step's tokens, wall time and host time to
enqueue the forward are kept, so fixed per-step cost (launch overhead) and per-token cost can be fitted.

Peer: Hugging Face transformers' Qwen3_5MoeForCausalLM built on the meta device from the same
config and given forkpoint's weight tensors (`load_state_dict(assign=True)`: no second copy),
timed on the same requests: batched forwards of sequences of P + S tokens (`--peer-batch` at a
time, logits of the last position only).

Usage (on the GPU machine; fla-core on the path):
    python bench/e2e_gpu.py --out bench/results          # full run, writes e2e_gpu_h200.{json,png}
    python bench/e2e_gpu.py --smoke                       # tiny model through LLM on CUDA
    python bench/e2e_gpu.py --tiny --device cpu --dtype float32 --p 64 --n 1,4 --s 16  # dry run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from forkpoint import LLM, SamplingParams  # noqa: E402
from forkpoint.inputs.default_model import ensure_default_model  # noqa: E402

VOCAB_LIMIT = 248000      # random ids below the special tokens of the Qwen3.5 vocabulary
PEAK_BF16 = 989e12        # H100/H200 SXM dense bf16, datasheet
MEASURED_BF16 = 790e12    # 8192^3 bf16 matmul measured on this workplace's H200s (KINDS.md)
ANCHOR_FLOOR_TOKENS_S = 130e3  # ANCHORS.md: ~6 GFLOP per token at ~790 TFLOP/s
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


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
    cfg = full_config()
    cfg.update(hidden_size=128, num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
               num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=2,
               linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64, num_experts=8,
               num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
               max_position_embeddings=32768)
    return cfg


def make_model_dir(cfg: dict, directory: Path) -> Path:
    """config.json plus the Qwen3.5 tokenizer files of the embedded default model (no weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
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


# ---------------------------------------------------------------- forkpoint runs

class EnqueueTimer:
    """Wraps the runner's model: host seconds to enqueue the forward (no sync inside the forward)."""

    def __init__(self, model) -> None:
        self.model = model
        self.last = 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.last = time.perf_counter() - start
        return out


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if values else float("nan")


def run_workload(llm: LLM, rng: np.random.Generator, p: int, s: int, n: int, max_tokens: int, on: bool,
                 tag: str, per_token_params: int) -> dict:
    engine = llm.engine
    anchor = rng.integers(0, VOCAB_LIMIT, p).tolist()
    marker = [llm.checkpoint_token_id] if on else []
    prompts = [anchor + marker + rng.integers(0, VOCAB_LIMIT, s).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    timer = engine.runner.model if isinstance(engine.runner.model, EnqueueTimer) else None
    before = engine.metrics()
    sync(engine.device)
    start = time.perf_counter()
    requests, finish = [], {}
    for i, prompt in enumerate(prompts):
        request_id = f"{tag}-{i}"
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
        requests.append(engine._groups[request_id].sequences[0])
    steps = []
    computed = before["prompt_tokens_computed"]
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            if output.finished:
                finish[output.request_id] = now - start
        new_computed = engine.metrics()["prompt_tokens_computed"]
        steps.append({"prompt_tokens": new_computed - computed, "s": now - step_start,
                      "enqueue_s": timer.last if timer else None})
        computed = new_computed
    sync(engine.device)
    wall = time.perf_counter() - start
    after = engine.metrics()
    ttft = [r.first_token_time - r.arrival_time for r in requests]
    tokens_computed = after["prompt_tokens_computed"] - before["prompt_tokens_computed"]
    expected = p + n * s if on else n * (p + s)
    decode = [finish[f"{tag}-{i}"] - ttft[i] for i in range(n)] if max_tokens > 1 else []
    return {
        "checkpoints": "on" if on else "off", "P": p, "S": s, "N": n, "max_tokens": max_tokens,
        "wall_s": wall, "requests_per_s": n / wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
        "consumer_ttft_p50_ms": 1e3 * pct(ttft[1:], 50) if n > 1 else None,
        "consumer_ttft_p99_ms": 1e3 * pct(ttft[1:], 99) if n > 1 else None,
        "prompt_tokens_computed": tokens_computed, "prompt_tokens_expected": expected,
        "prompt_tokens_total": n * (p + s),
        "checkpoint_hits": after["checkpoint_hits"] - before["checkpoint_hits"],
        "cached_tokens": [r.num_cached_tokens for r in requests][:4],
        "computed_tokens_per_s": tokens_computed / wall,
        "prompt_tokens_per_s": n * (p + s) / wall,
        "mfu": 2 * per_token_params * tokens_computed / wall / PEAK_BF16,
        "tpot_ms": 1e3 * pct([d / (max_tokens - 1) for d in decode], 50) if decode else None,
        "steps": steps,
    }


def run_forkpoint(args, cfg: dict, model_dir: Path, results: dict, save) -> tuple[torch.nn.Module, LLM]:
    counts = param_counts(cfg)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), load_format="dummy", dtype=args.dtype, device=args.device,
              max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs)
    engine = llm.engine
    sync(engine.device)
    results["engine"] = {
        "init_s": time.perf_counter() - t0,
        "params_in_model": sum(t.numel() for t in engine.runner.model.parameters()),
        "kv_blocks": engine.block_pool.num_blocks, "block_size": engine.block_pool.block_size,
        "state_slots": engine.state_pool.requests.count, "checkpoint_slots": engine.state_pool.checkpoints.count,
        "max_num_batched_tokens": args.max_num_batched_tokens, "max_num_seqs": args.max_num_seqs,
    }
    if engine.device.type == "cuda":
        results["engine"]["gpu_mem_allocated_gb"] = torch.cuda.memory_allocated() / 1e9
    print(f"engine ready in {results['engine']['init_s']:.1f} s: {results['engine']}", flush=True)

    # warm-up: compile/autotune every kernel shape outside the timed runs
    t0 = time.perf_counter()
    for p in args.p:
        for on in (True, False):
            run_workload(llm, rng, p, args.s, 4, 2, on, f"warm-{p}-{on}", counts["per_token"])
    sync(engine.device)
    results["warmup_s"] = time.perf_counter() - t0
    print(f"warm-up {results['warmup_s']:.1f} s", flush=True)
    model = engine.runner.model
    engine.runner.model = EnqueueTimer(model)

    # parity probe for the peer: top-20 logprobs of one prompt
    probe_ids = rng.integers(0, VOCAB_LIMIT, 256).tolist()
    probe = llm.generate([{"prompt_token_ids": probe_ids}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20),
                         use_tqdm=False)[0]
    results["parity_probe"] = {"token_ids": probe_ids, "logprobs": probe.outputs[0].logprobs[0]}
    # the same prompt as a checkpoint consumer (prefix 200 from a producer in the same step): how far
    # bf16 results move with the execution path alone, to read the peer's parity number against
    marker = llm.checkpoint_token_id
    pair = llm.generate([{"prompt_token_ids": probe_ids[:200] + [marker] + rng.integers(0, VOCAB_LIMIT, 56).tolist()},
                         {"prompt_token_ids": probe_ids[:200] + [marker] + probe_ids[200:]}],
                        SamplingParams(temperature=0.0, max_tokens=1, logprobs=20), use_tqdm=False)
    consumer = pair[1].outputs[0].logprobs[0]
    reference = results["parity_probe"]["logprobs"]
    results["path_dependence"] = {
        "consumer_cached_tokens": pair[1].num_cached_tokens,
        "checkpoint_vs_plain_max_logprob_diff_top20": max(abs(consumer[t] - v) for t, v in reference.items()
                                                          if t in consumer),
        "same_argmax": max(consumer, key=consumer.get) == max(reference, key=reference.get),
    }
    print(f"path dependence at full size: {results['path_dependence']}", flush=True)

    rows = [(p, n, 1) for p in args.p for n in args.n] + [(args.decode_p, args.decode_n, args.decode_tokens)]
    if args.extra_n:
        rows += [(p, n, 1) for p in args.p for n in args.extra_n]
    rate = None  # best computed tokens/s so far, to predict a row's time
    for p, n, max_tokens in rows:
        elapsed = time.perf_counter() - args.start
        predicted = (p + n * args.s + n * (p + args.s)) / rate if rate else 0.0
        if elapsed + predicted > args.time_budget:
            print(f"skip P={p} N={n} max_tokens={max_tokens}: {elapsed:.0f} s elapsed, {predicted:.0f} s predicted",
                  flush=True)
            results["skipped"].append({"P": p, "N": n, "max_tokens": max_tokens})
            continue
        pair = {}
        for on in (True, False):
            row = run_workload(llm, rng, p, args.s, n, max_tokens, on, f"{'on' if on else 'off'}-{p}-{n}-{max_tokens}",
                               counts["per_token"])
            pair[row["checkpoints"]] = row
            rate = max(rate or 0.0, row["computed_tokens_per_s"])
            results["runs"].append(row)
            print(f"  P={p:5d} N={n:3d} mt={max_tokens:2d} {row['checkpoints']:3s}: {row['requests_per_s']:8.2f} req/s  "
                  f"TTFT p50 {row['ttft_p50_ms']:8.1f} ms p99 {row['ttft_p99_ms']:8.1f} ms  computed "
                  f"{row['prompt_tokens_computed']:7d} (expected {row['prompt_tokens_expected']})  "
                  f"{row['computed_tokens_per_s']:9.0f} tok/s  MFU {100 * row['mfu']:.1f}%  steps {len(row['steps'])}",
                  flush=True)
        ideal = n * (p + args.s) / (p + n * args.s)
        speedup = pair["on"]["requests_per_s"] / pair["off"]["requests_per_s"]
        results["speedups"].append({"P": p, "N": n, "max_tokens": max_tokens, "speedup": speedup, "ideal": ideal,
                                    "fraction_of_ideal": speedup / ideal})
        print(f"  -> on/off speedup {speedup:.2f}x, ideal {ideal:.2f}x ({100 * speedup / ideal:.0f}% of ideal)",
              flush=True)
        save()
    if args.profile:
        try:
            results["profile"] = profile_steps(llm, rng, args)
        except Exception:  # evidence only: never lose the rows for it
            results["profile_error"] = traceback.format_exc()[-2000:]
        save()
    engine.runner.model = model
    return model, llm


KERNEL_GROUPS = (
    ("moe_grouped_gemm", ("Group", "grouped")),
    ("gdn_fla", ("chunk_", "solve_tril", "l2norm", "recompute_w_u", "fused_recurrent", "kkt", "cumsum")),
    ("attention", ("_paged_attn",)),
    ("conv1d", ("_varlen_kernel", "_step_kernel")),
    ("dense_gemm", ("gemm", "Gemm", "cutlass", "nvjet", "xmma", "sm90")),
    ("copy_index", ("index", "copy", "Copy", "gather", "scatter", "cat", "sort", "Sort")),
)


def kernel_group(name: str) -> str:
    for group, needles in KERNEL_GROUPS:
        if any(n in name for n in needles):
            return group
    return "elementwise_other"


def profile_steps(llm: LLM, rng: np.random.Generator, args) -> dict:
    """GPU kernel time by kind for single steps: an 8192-token plain prefill step (P=4096 + S, two
    requests), an 880-token plain step, the same 880 tokens through a checkpoint (two phases), and a
    decode step of 16 sequences. torch.profiler (CUDA activity only)."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    timer = engine.runner.model
    marker = llm.checkpoint_token_id
    cases = {
        "prefill_8192_plain": ([rng.integers(0, VOCAB_LIMIT, 4096 + args.s).tolist() for _ in range(2)], 1, 0),
        "prefill_880_plain": ([rng.integers(0, VOCAB_LIMIT, 880).tolist()], 1, 0),
        "prefill_880_checkpoint": ([rng.integers(0, VOCAB_LIMIT, 624).tolist() + [marker]
                                    + rng.integers(0, VOCAB_LIMIT, 256).tolist()], 1, 0),
        "decode_16": ([rng.integers(0, VOCAB_LIMIT, 64).tolist() for _ in range(16)], 3, 1),
    }
    report = {}
    for name, (prompts, max_tokens, profiled_step) in cases.items():
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            engine.add_request(f"prof-{name}-{i}", {"prompt_token_ids": prompt}, params)
        step = 0
        while engine.has_unfinished_requests():
            if step == profiled_step:
                sync(engine.device)
                activity = ProfilerActivity.CUDA if engine.device.type == "cuda" else ProfilerActivity.CPU
                with profile(activities=[activity]) as prof:
                    start = time.perf_counter()
                    engine.step()
                    wall = time.perf_counter() - start
                    sync(engine.device)
                kernels = [e for e in prof.key_averages() if "cuda" in str(getattr(e, "device_type", "")).lower()
                           and getattr(e, "self_device_time_total", 0) > 0]
                groups: dict[str, float] = {}
                for e in kernels:
                    groups[kernel_group(e.key)] = groups.get(kernel_group(e.key), 0.0) + e.self_device_time_total / 1e3
                top = sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]
                report[name] = {
                    "wall_ms": 1e3 * wall, "enqueue_ms": 1e3 * timer.last, "gpu_kernel_ms": sum(groups.values()),
                    "kernel_launches": sum(e.count for e in kernels), "by_group_ms": groups,
                    "top": [(e.key[:90], e.count, round(e.self_device_time_total / 1e3, 3)) for e in top],
                }
                print(f"profile {name}: wall {1e3 * wall:.1f} ms, enqueue {1e3 * timer.last:.1f} ms, kernels "
                      f"{report[name]['gpu_kernel_ms']:.1f} ms in {report[name]['kernel_launches']} launches, "
                      f"{ {k: round(v, 1) for k, v in sorted(groups.items(), key=lambda kv: -kv[1])} }", flush=True)
            else:
                engine.step()
            step += 1
    return report


# ---------------------------------------------------------------- transformers peer

def build_peer(cfg: dict, model: torch.nn.Module, device: torch.device):
    """transformers' model on the meta device, given forkpoint's parameter tensors (no copy)."""
    import transformers

    hf_cfg = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    config = transformers.Qwen3_5MoeTextConfig(**hf_cfg)
    with torch.device("meta"):
        peer = transformers.Qwen3_5MoeForCausalLM(config)
    ours = model.state_dict()
    theirs = set(peer.state_dict())
    info = {"missing_in_forkpoint": sorted(theirs - set(ours))[:8],
            "unknown_to_transformers": sorted(set(ours) - theirs)[:8]}
    shapes = [n for n, t in peer.state_dict().items() if n in ours and tuple(t.shape) != tuple(ours[n].shape)]
    info["shape_mismatches"] = shapes[:8]
    peer.load_state_dict({k: v for k, v in ours.items() if k in theirs}, strict=False, assign=True)
    rotary = peer.model.rotary_emb
    try:
        peer.model.rotary_emb = type(rotary)(config=config, device=device)
    except TypeError:
        peer.model.rotary_emb = type(rotary)(config).to(device)
    leftover = [n for n, t in list(peer.named_parameters()) + list(peer.named_buffers()) if t.is_meta]
    info["meta_leftovers"] = leftover[:8]
    if leftover or shapes:
        raise RuntimeError(f"peer weights do not line up with forkpoint's: {info}")
    info["attn_implementation"] = getattr(peer.config, "_attn_implementation", None)
    info["experts_implementation"] = getattr(peer.config, "_experts_implementation", None)
    info["transformers"] = transformers.__version__
    return peer.eval(), info


def gdn_kernels_of_peer(peer, device: torch.device, ids: torch.Tensor) -> dict:
    """Which GDN functions transformers resolved, and the GPU kernels one short forward launches."""
    module = sys.modules[type(peer.model.layers[0].linear_attn).__module__]
    found = {}
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule", "causal_conv1d_fn",
                 "is_fast_path_available"):
        obj = getattr(peer.model.layers[0].linear_attn, name, None) or getattr(module, name, None)
        if obj is not None:
            inner = getattr(obj, "__wrapped__", obj)
            found[name] = f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', repr(obj))}"
            closure = [c.cell_contents for c in (getattr(obj, "__closure__", None) or ())
                       if callable(getattr(c, "cell_contents", None))]
            mods = sorted({getattr(c, "__module__", "") or "" for c in closure} | {getattr(inner, "__module__", "")})
            found[name + "_modules"] = mods
    found["fla_imported"] = "fla.ops.gated_delta_rule" in sys.modules
    if device.type == "cuda":
        try:
            from torch.profiler import ProfilerActivity, profile

            with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
                peer(input_ids=ids, use_cache=False, logits_to_keep=1)
                torch.cuda.synchronize(device)
            names = sorted({e.key for e in prof.key_averages()})
            fla_like = [n for n in names if any(s in n for s in ("gated_delta", "chunk_", "solve_tril", "l2norm"))]
            found["gdn_like_kernels"] = fla_like[:12]
            found["num_kernels"] = len(names)
        except Exception as err:  # the profiler is optional evidence
            found["profiler_error"] = repr(err)
    return found


def run_peer(args, cfg: dict, model, results: dict, save) -> None:
    device = torch.device(args.device)
    peer, info = build_peer(cfg, model, device)
    rng = np.random.default_rng(args.seed + 1)
    results["peer"] = {"info": info, "runs": []}
    # parity with forkpoint on the probe prompt (top-20 logprobs)
    probe = results["parity_probe"]
    with torch.inference_mode():
        logits = peer(input_ids=torch.tensor([probe["token_ids"]], device=device), use_cache=False,
                      logits_to_keep=1).logits[0, -1].float()
    logprobs = torch.log_softmax(logits, -1)
    diffs = [abs(float(logprobs[int(t)]) - v) for t, v in probe["logprobs"].items()]
    info["parity_max_logprob_diff_top20"] = max(diffs)
    info["parity_same_argmax"] = int(logits.argmax()) == max(probe["logprobs"], key=probe["logprobs"].get)
    info["kernels"] = gdn_kernels_of_peer(peer, device, torch.tensor([probe["token_ids"]], device=device))
    print(f"peer: {info}", flush=True)
    save()

    def forward(batch: torch.Tensor) -> None:
        with torch.inference_mode():
            peer(input_ids=batch, use_cache=False, logits_to_keep=1)

    for p in args.p:
        length = p + args.s
        if time.perf_counter() - args.start > args.time_budget + args.peer_budget:
            results["skipped"] += [{"peer": True, "P": p, "N": n} for n in args.peer_n]
            continue
        for batch_size in sorted({min(n, args.peer_batch) for n in args.peer_n}):  # warm-up: every shape timed
            forward(torch.tensor(rng.integers(0, VOCAB_LIMIT, (batch_size, length)), device=device))
        for n in args.peer_n:
            if time.perf_counter() - args.start > args.time_budget + args.peer_budget:
                results["skipped"].append({"peer": True, "P": p, "N": n})
                continue
            anchor = rng.integers(0, VOCAB_LIMIT, p)
            seqs = np.stack([np.concatenate([anchor, rng.integers(0, VOCAB_LIMIT, args.s)]) for _ in range(n)])
            batch_size = args.peer_batch
            sync(device)
            start = time.perf_counter()
            try:
                for lo in range(0, n, batch_size):
                    forward(torch.tensor(seqs[lo: lo + batch_size], device=device))
                sync(device)
            except torch.cuda.OutOfMemoryError as err:
                results["peer"]["runs"].append({"P": p, "N": n, "error": f"OOM at batch {batch_size}: {err}"[:300]})
                torch.cuda.empty_cache()
                continue
            wall = time.perf_counter() - start
            row = {"P": p, "S": args.s, "N": n, "batch": batch_size, "wall_s": wall, "requests_per_s": n / wall,
                   "prompt_tokens_per_s": n * length / wall}
            results["peer"]["runs"].append(row)
            print(f"  peer P={p:5d} N={n:3d}: {row['requests_per_s']:8.2f} req/s  {row['prompt_tokens_per_s']:9.0f} tok/s",
                  flush=True)
            save()


def tiny_parity(args) -> dict:
    """forkpoint vs transformers on a 4-layer model with the same kernels and dtype: top-20
    logprobs of one 256-token prompt (implementation parity, apart from bf16 rounding)."""
    cfg = tiny_config()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(cfg, Path(tmp) / "tiny")
        llm = LLM(str(model_dir), load_format="dummy", dtype=args.dtype, device=args.device, num_kv_blocks=64,
                  num_state_slots=4, max_num_seqs=4)
        ids = np.random.default_rng(args.seed + 2).integers(0, VOCAB_LIMIT, 256).tolist()
        ours = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1, logprobs=20),
                            use_tqdm=False)[0].outputs[0].logprobs[0]
        model = llm.engine.runner.model
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


# ---------------------------------------------------------------- report

def table(results: dict) -> str:
    runs = {(r["P"], r["N"], r["max_tokens"], r["checkpoints"]): r for r in results["runs"]}
    peer = {(r["P"], r["N"]): r for r in results.get("peer", {}).get("runs", []) if "error" not in r}
    lines = ["| P | N | max_tokens | ckpt | req/s | TTFT p50 ms | TTFT p99 ms | consumer TTFT p50 / p99 ms | "
             "prompt tokens computed | computed tok/s | MFU | on/off | ideal | of ideal | transformers req/s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for sp in results["speedups"]:
        for mode in ("on", "off"):
            r = runs[(sp["P"], sp["N"], sp["max_tokens"], mode)]
            cons = (f"{r['consumer_ttft_p50_ms']:.0f} / {r['consumer_ttft_p99_ms']:.0f}"
                    if r["consumer_ttft_p50_ms"] is not None else "-")
            ratio = (f"{sp['speedup']:.2f}x | {sp['ideal']:.2f}x | {100 * sp['fraction_of_ideal']:.0f}%"
                     if mode == "on" else " | | ")
            hf = peer.get((sp["P"], sp["N"])) if mode == "off" and sp["max_tokens"] == 1 else None
            hf_cell = f"{hf['requests_per_s']:.2f}" if hf else ""
            lines.append(
                f"| {r['P']} | {r['N']} | {r['max_tokens']} | {mode} | {r['requests_per_s']:.2f} | "
                f"{r['ttft_p50_ms']:.0f} | {r['ttft_p99_ms']:.0f} | {cons} | {r['prompt_tokens_computed']} | "
                f"{r['computed_tokens_per_s']:.0f} | {100 * r['mfu']:.1f}% | {ratio} | {hf_cell} |")
    return "\n".join(lines)


def step_fit(results: dict) -> dict | None:
    """Least-squares step_s = a + b * prompt_tokens over prefill steps of the timed runs."""
    steps = [s for r in results["runs"] if r["max_tokens"] == 1 for s in r["steps"] if s["prompt_tokens"] > 0]
    if len(steps) < 3:
        return None
    x = np.array([s["prompt_tokens"] for s in steps], dtype=np.float64)
    y = np.array([s["s"] for s in steps], dtype=np.float64)
    b, a = np.polyfit(x, y, 1)
    enqueue = [s["enqueue_s"] / s["s"] for s in steps if s["enqueue_s"] is not None and s["s"] > 0]
    return {"fixed_ms_per_step": 1e3 * a, "us_per_token": 1e6 * b, "tokens_per_s_marginal": 1.0 / b if b > 0 else None,
            "num_steps": len(steps), "enqueue_fraction_median": pct(enqueue, 50) if enqueue else None,
            "max_step_tokens_per_s": float(np.max(x / y))}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    runs = [r for r in results["runs"] if r["max_tokens"] == 1]
    peer = [r for r in results.get("peer", {}).get("runs", []) if "error" not in r]
    for p, color in zip(sorted({r["P"] for r in runs}), ("tab:blue", "tab:orange", "tab:green")):
        for mode, style in (("on", "-o"), ("off", "--s")):
            rows = sorted((r for r in runs if r["P"] == p and r["checkpoints"] == mode), key=lambda r: r["N"])
            axes[0].plot([r["N"] for r in rows], [r["requests_per_s"] for r in rows], style, color=color,
                         label=f"forkpoint P={p} ckpt {mode}")
            axes[2].plot([r["N"] for r in rows], [r["ttft_p50_ms"] for r in rows], style, color=color,
                         label=f"P={p} ckpt {mode} (p50)")
        rows = sorted((r for r in peer if r["P"] == p), key=lambda r: r["N"])
        if rows:
            axes[0].plot([r["N"] for r in rows], [r["requests_per_s"] for r in rows], ":^", color=color,
                         label=f"transformers P={p}")
        sps = sorted((s for s in results["speedups"] if s["P"] == p and s["max_tokens"] == 1), key=lambda s: s["N"])
        axes[1].plot([s["N"] for s in sps], [s["speedup"] for s in sps], "-o", color=color, label=f"measured P={p}")
        axes[1].plot([s["N"] for s in sps], [s["ideal"] for s in sps], ":", color=color, label=f"ideal P={p}")
    for ax, title, ylabel in zip(axes, (f"requests/s (S={results['S']}, max_tokens=1)", "on/off speedup vs ideal N(P+S)/(P+NS)",
                                        "TTFT p50"), ("requests/s", "speedup", "ms")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (suffixes per anchor)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"forkpoint 1-to-N scoring, {results['model']}, {results['machine'].get('gpu', 'cpu')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ---------------------------------------------------------------- smoke test

def smoke(args) -> None:
    """Tiny model through LLM on the device: checkpoint counters add up; greedy tokens with and
    without checkpoints are printed side by side (bf16 may flip near ties, so not asserted)."""
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model_dir(tiny_config(), Path(tmp) / "tiny")
        kwargs = dict(load_format="dummy", dtype=args.dtype, device=args.device, num_kv_blocks=256, num_state_slots=8,
                      max_num_seqs=8)
        llm = LLM(str(model_dir), **kwargs)
        plain = LLM(str(model_dir), enable_checkpoints=False, **kwargs)
        rng = np.random.default_rng(0)
        anchor = rng.integers(0, VOCAB_LIMIT, 100).tolist()
        suffixes = [rng.integers(0, VOCAB_LIMIT, 20).tolist() for _ in range(4)]
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        on = llm.generate([{"prompt_token_ids": anchor + [llm.checkpoint_token_id] + s} for s in suffixes], params,
                          use_tqdm=False)
        off = plain.generate([{"prompt_token_ids": anchor + s} for s in suffixes], params, use_tqdm=False)
        metrics = llm.metrics()
        print("smoke: cached", [o.num_cached_tokens for o in on])
        print("smoke: tokens with checkpoints   ", [o.outputs[0].token_ids for o in on])
        print("smoke: tokens without checkpoints", [o.outputs[0].token_ids for o in off])
        print("smoke: metrics", {k: metrics[k] for k in ("prompt_tokens_total", "prompt_tokens_computed",
                                                          "checkpoint_hits", "checkpoints_created")})
        assert [o.num_cached_tokens for o in on] == [0, 100, 100, 100]
        assert metrics["prompt_tokens_computed"] == 100 + 4 * 20
        llm.engine.check_integrity()
        plain.engine.check_integrity()
        print("smoke: OK")


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


def parse_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="tiny model (dry run)")
    parser.add_argument("--smoke", action="store_true", help="tiny model smoke test only")
    parser.add_argument("--p", type=parse_ints, default=[624, 4096])
    parser.add_argument("--s", type=int, default=256)
    parser.add_argument("--n", type=parse_ints, default=[1, 4, 16, 64])
    parser.add_argument("--extra-n", type=parse_ints, default=[], help="extra N (e.g. 256), run if time allows")
    parser.add_argument("--decode-p", type=int, default=4096)
    parser.add_argument("--decode-n", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--peer-n", type=parse_ints, default=[1, 4, 16])
    parser.add_argument("--peer-batch", type=int, default=4)
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--profile", action="store_true", help="GPU kernel time by kind for a few single steps")
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-budget", type=float, default=240.0, help="seconds for forkpoint rows")
    parser.add_argument("--peer-budget", type=float, default=60.0, help="extra seconds for the peer")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="e2e_gpu_h200")
    args = parser.parse_args()
    args.start = time.perf_counter()
    if args.smoke:
        smoke(args)
        return
    if args.decode_p not in args.p:
        args.decode_p = max(args.p)

    device = torch.device(args.device)
    cfg = tiny_config() if args.tiny else full_config()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    counts = param_counts(cfg)
    results = {
        "model": "tiny Qwen3.5-MoE" if args.tiny else "Qwen3.5-35B-A3B shapes (random bf16 weights)",
        "config": cfg, "params": counts, "machine": machine_info(device),
        "command": " ".join(sys.argv), "S": args.s, "runs": [], "speedups": [], "skipped": [],
        "flops_per_token": 2 * counts["per_token"], "peak_flops": PEAK_BF16,
        "compute_floor_tokens_s": {"anchors_6gflop_790tflops": ANCHOR_FLOOR_TOKENS_S,
                                   "per_token_params_790tflops": MEASURED_BF16 / (2 * counts["per_token"]),
                                   "per_token_params_989tflops": PEAK_BF16 / (2 * counts["per_token"])},
    }

    def save() -> None:
        (out / f"{args.name}.json").write_text(json.dumps(results, indent=1, default=str) + "\n")

    print(f"params: {counts}", flush=True)
    try:
        if not args.tiny and not args.no_peer:
            results["tiny_parity"] = tiny_parity(args)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        with tempfile.TemporaryDirectory() as tmp:
            model_dir = make_model_dir(cfg, Path(tmp) / "model")
            model, llm = run_forkpoint(args, cfg, model_dir, results, save)
        results["step_fit"] = step_fit(results)
        print(f"step fit: {results['step_fit']}", flush=True)
        save()
        if not args.no_peer:
            del llm  # frees the KV and state pools; the weights stay (held by `model`) for the peer
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            try:
                run_peer(args, cfg, model, results, save)
            except Exception as err:  # report, keep forkpoint's results
                results["peer_error"] = traceback.format_exc()[-3000:]
                print(f"peer failed: {err!r}", flush=True)
    except Exception:
        results["error"] = traceback.format_exc()[-3000:]
        print(results["error"], flush=True)
    finally:
        results["total_s"] = time.perf_counter() - args.start
        save()
        if results["speedups"]:
            plot(results, out / f"{args.name}.png")
            print(table(results))
        for r in results.get("peer", {}).get("runs", []):
            print(f"transformers P={r['P']} N={r['N']}: {r.get('requests_per_s', float('nan')):.2f} req/s "
                  f"{r.get('prompt_tokens_per_s', float('nan')):.0f} tok/s {r.get('error', '')}")
        print(f"wrote {out / (args.name + '.json')} in {results['total_s']:.0f} s")

if __name__ == "__main__":
    main()
