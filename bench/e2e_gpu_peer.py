"""The peer of `e2e_gpu.py`: Hugging Face transformers on the same device and the same weights.

`Qwen3_5MoeForCausalLM` (or `NemotronHForCausalLM` for --shape nemotron3-nano: its pure-torch
Mamba2 path, mamba-ssm not installed) is built on the meta device from the benchmark's config and
given forkpoint's parameter tensors (`load_state_dict(assign=True)`: no second copy of the 70 GB;
forkpoint keeps transformers' in-memory names, Nemotron's stacked experts included). It is
timed on the same 1-to-N requests: N sequences of P + S tokens in forwards of `--peer-batch`
sequences, `use_cache=False`, logits of the last position only (scoring); with `--peer-layers K` only the
first K of the L layers run and the wall is scaled by L / K (Qwen: per-layer cost is uniform,
ANCHORS.md; Nemotron-3-Nano's blocks differ, so its prefix of K = 7, "MEMEM*E", has about the
whole model's mix: 3/3/1 Mamba2/MoE/attention against 23/23/6 of 52; the kinds of the timed and
the whole stack are recorded; the parity probe runs before the cut, on all layers). Used by `e2e_gpu.py`
(run as a script, so this folder is on `sys.path`).

Bounds: time by the caller's alarm (`--peer-budget`), the same for every P: the rows run P by P in
`--peer-p` order, so the longest P (32768 by default) comes last and is the first the budget cuts.
Memory: a forward holds `--peer-batch` whole sequences of P + S tokens (at 32768 + 256 and batch 4,
132k tokens per forward, 7.6x the 4096 rows'), and transformers' attention keeps no cache between
them; SDPA's fused kernels need memory linear in the length, but a path that materialises the
[batch, heads, T, T] scores (the math fallback, or eager attention: 140 GB in bf16 at 32k and batch 4)
exhausts the GPU. A CUDA out-of-memory error in a P's warm-up or in a row is recorded as that P's
rows' `error` (the rows after it still run), never raised.
"""

from __future__ import annotations

import sys
import time

import numpy as np
import torch

VOCAB_LIMIT = 248000  # random ids below the special tokens of the Qwen3.5 vocabulary


def vocab_limit(cfg: dict) -> int:
    """Random prompt ids are drawn below this: the Qwen3.5 limit, or the model's vocabulary less a margin."""
    return min(VOCAB_LIMIT, int(cfg["vocab_size"]) - 72)


def _peer_classes(cfg: dict):
    import transformers

    if cfg["model_type"] == "nemotron_h":
        return transformers.NemotronHConfig, transformers.NemotronHForCausalLM
    return transformers.Qwen3_5MoeTextConfig, transformers.Qwen3_5MoeForCausalLM


def _block_kinds(config) -> list[str]:
    return list(getattr(config, "layers_block_type", None) or getattr(config, "layer_types", None) or [])


def build_peer(cfg: dict, model: torch.nn.Module, device: torch.device):
    """transformers' model on the meta device, given forkpoint's parameter tensors (no copy).
    Raises RuntimeError when a weight is missing or its shape differs."""
    import transformers

    hf_cfg = {k: v for k, v in cfg.items() if k not in ("model_type", "architectures")}
    config_class, model_class = _peer_classes(cfg)
    config = config_class(**hf_cfg)
    with torch.device("meta"):
        peer = model_class(config)
    ours = model.state_dict()
    theirs = set(peer.state_dict())
    info = {"missing_in_forkpoint": sorted(theirs - set(ours))[:8],
            "unknown_to_transformers": sorted(set(ours) - theirs)[:8]}
    shapes = [n for n, t in peer.state_dict().items() if n in ours and tuple(t.shape) != tuple(ours[n].shape)]
    info["shape_mismatches"] = shapes[:8]
    peer.load_state_dict({k: v for k, v in ours.items() if k in theirs}, strict=False, assign=True)
    rotary = getattr(peer.model, "rotary_emb", None)  # Nemotron-H has none
    if rotary is not None:
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
    if not hasattr(peer.model.layers[0], "linear_attn"):  # Nemotron-H: the torch path (mamba-ssm absent)
        return {"mamba_ssm_imported": "mamba_ssm" in sys.modules}
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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_peer(args, cfg: dict, model: torch.nn.Module, results: dict, save) -> None:
    """Peer rows into `results["peer"]`, P in `args.peer_p`, N in `args.peer_n`, S = `args.s`.

    The caller bounds the wall time (an alarm raises out of this function when the peer's budget
    ends): every finished row is saved as it comes, so a stop loses only the row in flight. Each
    P is warmed up untimed first (fla autotunes per shape: 10-60 s on a fresh machine)."""
    device = torch.device(args.device)
    peer, info = build_peer(cfg, model, device)
    rng = np.random.default_rng(args.seed + 1)
    results["peer"] = {"info": info, "runs": [], "batch": args.peer_batch}
    probe = results.get("parity_probe")
    if probe is not None:  # top-20 logprobs of forkpoint's probe prompt
        with torch.inference_mode():
            logits = peer(input_ids=torch.tensor([probe["token_ids"]], device=device), use_cache=False,
                          logits_to_keep=1).logits[0, -1].float()
        logprobs = torch.log_softmax(logits, -1)
        info["parity_max_logprob_diff_top20"] = max(abs(float(logprobs[int(t)]) - v)
                                                    for t, v in probe["logprobs"].items())
        info["parity_same_argmax"] = int(logits.argmax()) == max(probe["logprobs"], key=probe["logprobs"].get)
        info["kernels"] = gdn_kernels_of_peer(peer, device, torch.tensor([probe["token_ids"]], device=device))
    layers = len(peer.model.layers)
    kept = args.peer_layers if 0 < args.peer_layers < layers else layers
    scale = layers / kept
    kinds = _block_kinds(peer.config)
    if kept < layers:  # Qwen: uniform per-layer cost; Nemotron: a prefix with the whole mix (docstring)
        peer.model.layers = peer.model.layers[:kept]
        peer.config.num_hidden_layers = kept
        for field in ("layer_types", "layers_block_type"):  # Nemotron-H: hybrid_override_pattern follows
            if getattr(peer.config, field, None) is not None:
                setattr(peer.config, field, list(getattr(peer.config, field))[:kept])
    info.update(layers_timed=kept, layers_total=layers, wall_scale=scale,
                kinds_timed={k: kinds[:kept].count(k) for k in sorted(set(kinds))},
                kinds_total={k: kinds.count(k) for k in sorted(set(kinds))})
    results["peer"]["scaled"] = {"layers_timed": kept, "layers_total": layers, "wall_scale": scale}
    print(f"peer: {info}", flush=True)
    save()

    def forward(batch: torch.Tensor) -> None:
        with torch.inference_mode():
            peer(input_ids=batch, use_cache=False, logits_to_keep=1)

    for p in args.peer_p:
        try:
            results["peer"].setdefault("warmup_s", {})[str(p)] = _warm_up(forward, rng, args, p, device)
        except torch.cuda.OutOfMemoryError as err:
            results["peer"]["runs"] += [_out_of_memory(p, n, args.peer_batch, "warm-up", err) for n in args.peer_n]
            save()
            continue
        for n in args.peer_n:
            try:
                measured = _timed_forwards(forward, rng, args, p, n, device)
            except torch.cuda.OutOfMemoryError as err:
                results["peer"]["runs"].append(_out_of_memory(p, n, args.peer_batch, "row", err))
                save()
                continue
            wall = measured * scale  # the whole model's estimated wall (the parity probe ran all layers)
            length = p + args.s
            row = {"P": p, "S": args.s, "N": n, "batch": args.peer_batch, "wall_s": wall, "measured_wall_s": measured,
                   "layers_timed": kept, "requests_per_s": n / wall, "prompt_tokens_per_s": n * length / wall}
            results["peer"]["runs"].append(row)
            print(f"  peer P={p:5d} N={n:3d}: {row['requests_per_s']:8.2f} req/s  "
                  f"{row['prompt_tokens_per_s']:9.0f} tok/s", flush=True)
            save()


def _warm_up(forward, rng: np.random.Generator, args, p: int, device: torch.device) -> float:
    """Untimed forwards of every batch shape the rows at anchor `p` will run; their seconds."""
    t0 = time.perf_counter()
    for batch_size in sorted({min(n, args.peer_batch) for n in args.peer_n}):
        forward(torch.tensor(rng.integers(0, args.vocab_limit, (batch_size, p + args.s)), device=device))
    _sync(device)
    return time.perf_counter() - t0


def _timed_forwards(forward, rng: np.random.Generator, args, p: int, n: int, device: torch.device) -> float:
    """Seconds to score N sequences (one anchor of `p` ids, N suffixes of S) in forwards of `args.peer_batch`."""
    anchor = rng.integers(0, args.vocab_limit, p)
    seqs = np.stack([np.concatenate([anchor, rng.integers(0, args.vocab_limit, args.s)]) for _ in range(n)])
    _sync(device)
    start = time.perf_counter()
    for lo in range(0, n, args.peer_batch):
        forward(torch.tensor(seqs[lo: lo + args.peer_batch], device=device))
    _sync(device)
    return time.perf_counter() - start


def _out_of_memory(p: int, n: int, batch: int, phase: str, err: BaseException) -> dict:
    """The `error` entry of the row (P, N) after a CUDA out-of-memory error in `phase`; frees the cache."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"  peer P={p:5d} N={n:3d}: out of memory in the {phase} at batch {batch}", flush=True)
    return {"P": p, "N": n, "error": f"OOM in the {phase} at batch {batch}: {err}"[:300]}
