"""Kernel benchmark: paged attention (`forkpoint.kernels.attention.triton`) at Qwen3.5-35B-A3B shapes.

One attention layer's core op: 16 query heads, 2 kv heads (GQA group 8), head dim 256, KV blocks of
16 tokens, bf16, random data (never zeros), shuffled physical blocks. Seven steps:

(a) consumers: 32 segments of 256 queries, each over a 4,096-token cached prefix (the producer's
    blocks, shared by all 32 block tables) plus its own 256 tokens: kv length 4,352.
(b) prefill: 2 causal segments of 4,352 tokens.
(c) decode: 256 sequences, one query each, 4,352-token contexts (own blocks).
(d) decode: 16 sequences, the same.
(e, f, g) decode: 1 sequence over 880 and 4,352 tokens, 64 over 880 (the TPOT rows of bench/e2e_gpu.py).

With --long (issue 30: long prompts), three more: (h) one causal 32,768-token prefill; (i, j) the last
8,192-token chunk of a 32,768- and of a 131,072-token prompt (chunked prefill: 8,192 queries over the whole
context). The reference is not run there (its float32 scores would not fit): the error column is against
the first SDPA backend that runs, and every SDPA backend (flash, cuDNN, memory-efficient; GQA or K/V
repeated) is timed on its own, so the table says which of them a long-context path should call; rows over a
cached prefix also time the two cuDNN calls such a chunk could be split into (`split_cudnn`: the prefix with no
mask, the own span causal, both with GQA; their log-sum-exp merge not included).

For each: the kernel's median time (triton.testing.do_bench, L2 flushed before each run), TFLOP/s
(causal FLOPs counted exactly: 4 * Dh * HQ per visible (query, key) pair), GB/s of the fewest bytes
(K/V of every segment read once, q read and o written once), the tile the autotuner chose, the same
kernel forced to the tile it had before autotuning (BLOCK_M=64, BLOCK_N=32, 8 warps, 2 stages; for
decode steps: the decode tile without the key split, one program per segment and kv head), and the
error against `reference.paged_attention` (relative RMS). Peer: torch's SDPA on dense contiguous
copies, causal (b), bottom-right causal over prefix + own keys (a; a rough reference: it reads the
prefix once per segment from a dense copy), GQA through `enable_gqa` where torch has it.

Usage:
    python bench/attention_kernel.py --out bench/results      # CUDA, < 90 s on an H200
    python bench/attention_kernel.py --long --name attention_long --out bench/results   # + (h)-(j), every backend
    python bench/attention_kernel.py --smoke --out /tmp/attn   # CPU: reference path, tiny shapes
Writes <out>/attention_kernel.json and <out>/attention_kernel.png and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import host_info  # noqa: E402  (bench/ is on sys.path when run as a script)

from forkpoint.kernels.attention import reference  # noqa: E402

HQ, HKV, DH, BLOCK = 16, 2, 256, 16
LEGACY = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 2}   # the prefill tile before autotune


def shapes(smoke: bool, long: bool) -> list[dict]:
    """Each step: q_lens, seq_lens and the shared prefix length (0: every segment owns its blocks);
    `reference`: False where the float32 reference would not fit (the long rows)."""
    if smoke:
        tail = [dict(name="(h) long prefill 1x96", q_lens=[96], seq_lens=[96], shared=0, reference=False),
                dict(name="(i) last chunk 24 of 96", q_lens=[24], seq_lens=[96], shared=0, reference=False)]
        return (tail if long else []) + [
                dict(name="(a) consumers 4x8 over 32+8", q_lens=[8] * 4, seq_lens=[40] * 4, shared=32),
                dict(name="(b) prefill 2x40", q_lens=[40] * 2, seq_lens=[40] * 2, shared=0),
                dict(name="(c) decode 8x40", q_lens=[1] * 8, seq_lens=[40] * 8, shared=0),
                dict(name="(d) decode 2x40", q_lens=[1] * 2, seq_lens=[40] * 2, shared=0)]
    return [dict(name="(a) consumers 32x256 over 4096+256", q_lens=[256] * 32, seq_lens=[4352] * 32, shared=4096),
            dict(name="(b) prefill 2x4352", q_lens=[4352] * 2, seq_lens=[4352] * 2, shared=0),
            dict(name="(c) decode 256x4352", q_lens=[1] * 256, seq_lens=[4352] * 256, shared=0),
            dict(name="(d) decode 16x4352", q_lens=[1] * 16, seq_lens=[4352] * 16, shared=0),
            dict(name="(e) decode 1x880", q_lens=[1], seq_lens=[880], shared=0),
            dict(name="(f) decode 1x4352", q_lens=[1], seq_lens=[4352], shared=0),
            dict(name="(g) decode 64x880", q_lens=[1] * 64, seq_lens=[880] * 64, shared=0)] + ([
        dict(name="(h) prefill 1x32768", q_lens=[32768], seq_lens=[32768], shared=0, reference=False),
        dict(name="(i) last chunk 8192 of 32768", q_lens=[8192], seq_lens=[32768], shared=0, reference=False),
        dict(name="(j) last chunk 8192 of 131072", q_lens=[8192], seq_lens=[131072], shared=0, reference=False),
    ] if long else [])


def offsets(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def make_step(gen, dev, q_lens, seq_lens, shared, dtype=torch.bfloat16):
    """Random q, paged K/V caches and block tables over shuffled physical blocks. The first
    `shared` positions (a multiple of BLOCK) of every segment map to the same blocks."""
    nblk = [-(-s // BLOCK) for s in seq_lens]
    n_shared = shared // BLOCK
    total = n_shared + sum(b - n_shared for b in nblk)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(1)).tolist()
    prefix = [perm.pop() for _ in range(n_shared)]
    tables = [prefix + [perm.pop() for _ in range(b - n_shared)] for b in nblk]
    width = max(nblk)
    bt = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32, device=dev)
    kc = torch.randn(total, BLOCK, HKV, DH, generator=gen, device=dev).to(dtype)
    vc = torch.randn(total, BLOCK, HKV, DH, generator=gen, device=dev).to(dtype)
    q = torch.randn(sum(q_lens), HQ, DH, generator=gen, device=dev).to(dtype)
    cu = offsets(q_lens)
    return dict(q=q, kc=kc, vc=vc, bt=bt, cu=cu, cu_d=torch.tensor(cu, device=dev, dtype=torch.int32),
                sl=list(seq_lens), sl_d=torch.tensor(seq_lens, device=dev, dtype=torch.int32))


def causal_pairs(q_lens, seq_lens) -> int:
    """Visible (query, key) pairs: query i of a segment with context c sees c + i + 1 keys."""
    return sum(q * (s - q) + q * (q + 1) // 2 for q, s in zip(q_lens, seq_lens))


def min_bytes(step) -> int:
    """K/V of every segment read once (shared prefix blocks once), q read and o written."""
    blocks = torch.unique(torch.cat([step["bt"][i, :-(-s // BLOCK)] for i, s in enumerate(step["sl"])])).numel()
    return 2 * blocks * BLOCK * HKV * DH * step["kc"].element_size() + 2 * step["q"].numel() * step["q"].element_size()


def rel_rms(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def ref_call(st):
    return reference.paged_attention(st["q"], st["kc"], st["vc"], st["bt"], st["cu_d"], st["cu"], st["sl_d"], st["sl"],
                                     scale=DH ** -0.5)


# ---------------------------------------------------------------- the peer: SDPA on dense copies

def dense_kv(st):
    """[N, HKV, L, Dh] contiguous copies of every segment's keys and values (equal lengths)."""
    n, length = len(st["sl"]), st["sl"][0]
    slots = (st["bt"][:, :, None].long() * BLOCK + torch.arange(BLOCK, device=st["bt"].device)).flatten(1)[:, :length]
    k = st["kc"].view(-1, HKV, DH)[slots].permute(0, 2, 1, 3).contiguous()
    v = st["vc"].view(-1, HKV, DH)[slots].permute(0, 2, 1, 3).contiguous()
    return k.view(n, HKV, length, DH), v.view(n, HKV, length, DH)


def sdpa_variants(q, k, v, q_len, kv_len):
    """(label, fn) in order of preference; the first that runs is the peer (with --long every one is timed)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    scale = DH ** -0.5
    g = HQ // HKV
    out = []
    if q_len == kv_len:
        def flash():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        out.append(("flash, is_causal, enable_gqa", flash))
        for backend, name in ((SDPBackend.CUDNN_ATTENTION, "cudnn"), (SDPBackend.EFFICIENT_ATTENTION, "efficient")):
            def alone(backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            out.append((f"{name}, is_causal, enable_gqa", alone))
    else:
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(q_len, kv_len)
        rep = {}

        def lower_right(backends, gqa):
            def fn():
                if gqa:
                    kk, vv, extra = k, v, {"enable_gqa": True}
                else:
                    if not rep:
                        rep["k"], rep["v"] = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
                    kk, vv, extra = rep["k"], rep["v"], {}
                with sdpa_kernel(backends):
                    return F.scaled_dot_product_attention(q, kk, vv, attn_mask=bias, scale=scale, **extra)
            return fn

        every = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
        out += [("flash, causal_lower_right, enable_gqa", lower_right([SDPBackend.FLASH_ATTENTION], True)),
                ("flash, causal_lower_right, kv repeated", lower_right([SDPBackend.FLASH_ATTENTION], False)),
                ("cudnn, causal_lower_right, kv repeated", lower_right([SDPBackend.CUDNN_ATTENTION], False)),
                ("efficient, causal_lower_right, kv repeated", lower_right([SDPBackend.EFFICIENT_ATTENTION], False)),
                ("fused backends, causal_lower_right, enable_gqa", lower_right(every, True)),
                ("fused backends, causal_lower_right, kv repeated", lower_right(every, False))]
    mask = torch.arange(kv_len, device=q.device) <= torch.arange(kv_len - q_len, kv_len, device=q.device)[:, None]
    out.append(("default backend, bool mask, enable_gqa",
                lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)))
    return out


def split_cudnn(q, k, v, q_len, kv_len):
    """Timing only: the two cuDNN calls a chunk that continues a cached prefix could be computed with, its
    queries over the prefix with no mask and over their own span causal (where cuDNN takes GQA and is fastest);
    their merge by log-sum-exp, one elementwise pass over the output, is not included."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    prefix = kv_len - q_len
    k_pre, v_pre = k[:, :, :prefix].contiguous(), v[:, :, :prefix].contiguous()
    k_own, v_own = k[:, :, prefix:].contiguous(), v[:, :, prefix:].contiguous()

    def fn():
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            over_prefix = F.scaled_dot_product_attention(q, k_pre, v_pre, scale=DH ** -0.5, enable_gqa=True)
            own = F.scaled_dot_product_attention(q, k_own, v_own, is_causal=True, scale=DH ** -0.5, enable_gqa=True)
        return over_prefix, own
    return fn


def peer(st, timer, every: bool):
    """SDPA over dense copies: (label, ms, o packed like the kernel's) of the first variant that runs, or
    (errors, None, None); with `every`, also {label: ms or the error} of every variant (the bool-mask
    fallback is left out there: it materialises the scores)."""
    n, q_len, kv_len = len(st["sl"]), st["cu"][1], st["sl"][0]
    q = st["q"].view(n, q_len, HQ, DH).transpose(1, 2)
    k, v = dense_kv(st)
    errors, first, timed = [], None, {}
    variants = sdpa_variants(q, k, v, q_len, kv_len)
    for label, fn in (variants[:-1] if every else variants):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")   # a backend that does not apply says why, then raises
                o = fn()
            ms = timer(fn)
        except Exception as e:  # noqa: BLE001 - try the next variant
            error = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
            errors.append(f"{label}: {error}")
            timed[label] = error
            continue
        timed[label] = ms
        if first is None:
            first = (label, ms, o.transpose(1, 2).reshape(-1, HQ, DH))
        if not every:
            break
    if every and q_len < kv_len:
        label = "cudnn split: prefix no mask + own span causal, enable_gqa (two calls, merge not timed)"
        try:
            timed[label] = timer(split_cudnn(q, k, v, q_len, kv_len))
        except Exception as e:  # noqa: BLE001 - cuDNN may not take these shapes
            timed[label] = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
    return (first or ("; ".join(errors), None, None)), timed


# ---------------------------------------------------------------- timing

def cuda_timer(args):
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=args.warmup, rep=args.rep, return_mode="median")


def cpu_timer(fn, reps=3):
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def run_step(spec, args, gen, dev):
    st = make_step(gen, dev, spec["q_lens"], spec["seq_lens"], spec["shared"])
    flops = 4 * DH * HQ * causal_pairs(spec["q_lens"], spec["seq_lens"])
    row = {"name": spec["name"], "segments": len(spec["q_lens"]), "q_tokens": sum(spec["q_lens"]),
           "kv_len": spec["seq_lens"][0], "shared_prefix": spec["shared"], "gflop": flops / 1e9,
           "min_mbytes": min_bytes(st) / 1e6}
    o_ref = ref_call(st) if spec.get("reference", True) else None
    is_prefill = spec["q_lens"][0] > 1
    if args.smoke:
        row["reference_ms"] = cpu_timer(lambda: ref_call(st)) if o_ref is not None else None
        timer = cpu_timer
    else:
        import triton

        from forkpoint.kernels.attention import triton as tri

        timer = cuda_timer(args)

        def kernel():
            return tri.paged_attention(st["q"], st["kc"], st["vc"], st["bt"], st["cu_d"], st["cu"], st["sl_d"],
                                       st["sl"], scale=DH ** -0.5)

        t0 = time.time()
        o = kernel()
        torch.cuda.synchronize()
        row["first_call_s"] = time.time() - t0     # includes the autotuning of a new key
        row["rel_rms_vs_reference"] = rel_rms(o, o_ref) if o_ref is not None else None
        row["nan"] = bool(torch.isnan(o).any())
        cfg = tri._paged_attn_prefill.best_config if is_prefill else tri.decode_config(HQ // HKV, DH)
        row["config"] = {**cfg.kwargs, "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
        row["autotuned"] = is_prefill
        if not is_prefill:
            row["config"]["decode_splits"] = tri.DECODE_SPLITS
        row["ms"] = timer(kernel)
        # before: the prefill tile before autotuning; for decode, one program per (segment, kv head)
        # walking its whole context (the forced decode tile, no split)
        legacy = (triton.Config({k: LEGACY[k] for k in ("BLOCK_M", "BLOCK_N")}, num_warps=LEGACY["num_warps"],
                                num_stages=LEGACY["num_stages"]) if is_prefill else tri.decode_config(HQ // HKV, DH))

        def kernel_legacy():
            return tri.paged_attention_with_config(st["q"], st["kc"], st["vc"], st["bt"], st["cu_d"], st["cu"],
                                                   st["sl_d"], st["sl"], scale=DH ** -0.5, config=legacy)

        try:
            o_legacy = kernel_legacy()
            row["legacy_rel_rms"] = rel_rms(o_legacy, o_ref) if o_ref is not None else None
            del o_legacy
            row["legacy_ms"] = timer(kernel_legacy)
        except Exception as e:  # noqa: BLE001 - the comparison is optional
            row["legacy_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        for key in ("ms", "legacy_ms"):
            if row.get(key):
                row[key.replace("ms", "tflops")] = flops / row[key] / 1e9
                row[key.replace("ms", "gbps")] = row["min_mbytes"] / row[key]
    if is_prefill:
        (label, ms, o_peer), timed = peer(st, timer, every=args.long)
        row["sdpa"] = label
        if args.long:
            row["sdpa_backends"] = {k: ({"ms": v, "tflops": flops / v / 1e9} if isinstance(v, float) else {"error": v})
                                    for k, v in timed.items()}
        if ms is not None:
            row["sdpa_ms"], row["sdpa_tflops"] = ms, flops / ms / 1e9
            if o_ref is not None:
                row["sdpa_rel_rms_vs_reference"] = rel_rms(o_peer, o_ref)
            elif not args.smoke:
                row["rel_rms_vs_sdpa"] = rel_rms(o, o_peer)   # the long rows: the kernel against the peer
    del st
    if not args.smoke:
        torch.cuda.empty_cache()
    return row


# ---------------------------------------------------------------- reporting

def _f(x, nd=3):
    return "-" if x is None else f"{x:.{nd}f}"


def print_table(res):
    print(f"\npaged attention, HQ={HQ} HKV={HKV} Dh={DH} block {BLOCK}, bf16 ({res['device']})")
    if res["smoke"]:
        print("| step | q tokens | kv len | GFLOP | reference (ms) | SDPA (ms) | SDPA rel RMS vs reference |")
        print("|---|---|---|---|---|---|---|")
        for r in res["rows"]:
            print(f"| {r['name']} | {r['q_tokens']} | {r['kv_len']} | {r['gflop']:.3f} | {_f(r['reference_ms'])} "
                  f"| {_f(r.get('sdpa_ms'))} | {_f(r.get('sdpa_rel_rms_vs_reference'), 6)} |")
        return
    print("| step | ms | TFLOP/s | GB/s | before (ms): old tile, decode unsplit | speedup | SDPA (ms) | SDPA TFLOP/s "
          "| rel RMS | tile BLOCK_MxBLOCK_N |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in res["rows"]:
        if "error" in r:
            print(f"| {r['name']} | failed: {r['error'][:80]} |")
            continue
        sp = r["legacy_ms"] / r["ms"] if r.get("legacy_ms") else None
        c = r["config"]
        tile = f"{c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}"
        tile += "" if r["autotuned"] else f" (fixed, {c['decode_splits']} splits)"
        print(f"| {r['name']} | {_f(r['ms'])} | {_f(r['tflops'], 1)} | {_f(r['gbps'], 0)} | {_f(r.get('legacy_ms'))} "
              f"| {_f(sp, 2)} | {_f(r.get('sdpa_ms'))} | {_f(r.get('sdpa_tflops'), 1)} "
              f"| {_err(r)} | {tile} |")
    for r in res["rows"]:
        if "sdpa" in r:
            print(f"  SDPA for {r['name']}: {r['sdpa']}")
        for label, t in r.get("sdpa_backends", {}).items():
            timing = (f"{t['ms']:.3f} ms, {t['tflops']:.1f} TFLOP/s" if "ms" in t else t["error"][:100])
            print(f"    {label}: {timing}")


def _err(row) -> str:
    """The kernel's error: against the reference, or (long rows) against SDPA, marked so."""
    if row.get("rel_rms_vs_reference") is not None:
        return f"{row['rel_rms_vs_reference']:.1e}"
    return f"{row['rel_rms_vs_sdpa']:.1e} (vs SDPA)" if row.get("rel_rms_vs_sdpa") is not None else "-"


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if "error" not in r]
    series = ([("reference_ms", "reference (CPU)"), ("sdpa_ms", "torch SDPA (dense)")] if res["smoke"] else
              [("ms", "forkpoint Triton (autotuned)"), ("legacy_ms", "before: old tile 64x32 w8 s2 / decode unsplit"),
               ("sdpa_ms", "torch SDPA (dense copies)")])
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / len(series)
    for i, (key, label) in enumerate(series):
        xs = [j + i * width for j, r in enumerate(rows) if r.get(key)]
        ys = [r[key] for r in rows if r.get(key)]
        ax.bar(xs, ys, width, label=label)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(rows))])
    ax.set_xticklabels([r["name"] for r in rows], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms (median)")
    ax.set_title(f"paged attention, HQ={HQ} HKV={HKV} Dh={DH} block {BLOCK} bf16, {res['device']}")
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results", help="folder for the JSON and PNG")
    ap.add_argument("--name", default="attention_kernel", help="file stem for the JSON and PNG")
    ap.add_argument("--smoke", action="store_true", help="CPU, reference path only, tiny shapes")
    ap.add_argument("--long", action="store_true",
                    help="add the long-context rows (h)-(j) and time every SDPA backend on the prefill rows")
    ap.add_argument("--warmup", type=float, default=10, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=float, default=50, help="do_bench repetition time, ms")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("needs a CUDA device (or --smoke for the CPU reference path)")
    dev = "cpu" if args.smoke else "cuda"
    res = {"device": "cpu" if args.smoke else torch.cuda.get_device_name(0), "torch": torch.__version__,
           "smoke": args.smoke, "shape": {"HQ": HQ, "HKV": HKV, "Dh": DH, "block_size": BLOCK, "dtype": "bf16"},
           "args": dict(vars(args)), "command": " ".join(sys.argv), **host_info.code_version(), "rows": []}
    if not args.smoke:
        import triton

        from forkpoint.kernels.attention import triton as tri

        res["triton"] = triton.__version__
        res["legacy_tile"] = LEGACY
        torch.backends.cuda.matmul.allow_tf32 = False
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"{args.name}.json")
    gen = torch.Generator(device=dev).manual_seed(args.seed)
    t0 = time.time()
    for spec in shapes(args.smoke, args.long):
        try:
            row = run_step(spec, args, gen, dev)
        except Exception as e:  # noqa: BLE001 - one failed step must not lose the others
            row = {"name": spec["name"], "error": f"{type(e).__name__}: {str(e)[:300]}"}
            if not args.smoke:
                torch.cuda.empty_cache()
        res["rows"].append(row)
        print(f"  {spec['name']}: " + ", ".join(f"{k}={_f(v) if isinstance(v, float) else v}" for k, v in row.items()
                                                if k != "name"), flush=True)
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
    if not args.smoke:
        res["autotune_cache"] = {str(k): v for k, v in tri.prefill_tuned_configs().items()}
    res["wall_s"] = time.time() - t0
    with open(json_path, "w") as f:
        json.dump(res, f, indent=1)
    try:
        plot(res, os.path.join(args.out, f"{args.name}.png"))
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        print(f"plot failed: {e}")
    print_table(res)
    print(f"\nwrote {json_path} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
