"""Kernel benchmark: batched two-phase grouped prefill of one GDN layer's recurrent core op.

The op timed is what a Gated DeltaNet layer runs between its projections: the short causal conv
(width 4, SiLU, over the packed q|k|v channels, with conv states) followed by the chunked gated delta
rule (fp32 recurrent state), through forkpoint's GPU kernels (`forkpoint.kernels.conv1d.triton`,
`forkpoint.kernels.gated_delta.fla`, i.e. fla-core). Projections, gates' own math, norms and the
MoE are left out on purpose so the comparison matches the table in ANCHORS.md. Inputs: x [T, D]
bf16 with D = 2*H*K + HV*V; g [T, HV] fp32 log-decay; beta [T, HV] bf16; conv weight [D, 4] bf16;
states: conv [N, D, 3] bf16, recurrent [N, HV, K, V] fp32. All random (never zeros).

Two parts:

(a) the seed's setup (vLLM RFC #55697's microbenchmark): 4 key / 8 value heads of 128, a producer of
    P=512 tokens and N in 1..16 consumers of S=64 tokens.
    sequential: producer prefix in one call, then one call per consumer suffix from the prefix state.
    two-phase:  phase 1 the prefix in one call (writes the checkpoint state); phase 2 gathers that
                state for all N consumers with index_select and runs every suffix in ONE packed call.
(b) Qwen3.5-35B-A3B layer sizes (16 key / 32 value heads of 128): P in {2048, 8192}, S in {128, 512},
    N in {1, 4, 16, 64, 256}.
    full:       N packed prompts of P+S tokens, one varlen call (what an engine without checkpoints does).
    two-phase:  as above. ideal = N(P+S) / (P+NS), the ratio of tokens computed.

Timing: triton.testing.do_bench median (it flushes L2 before every run), warmed up; input sets are
rotated when one set fits in twice the L2. "eager" times include the host's launch work, "graph"
times replay the same calls captured in one CUDA graph (the GPU's own time plus replay gaps).
Configs whose full recompute would exceed --mem-limit-gb are skipped. Also reported: the two-phase
path's error against the full recompute (consumer outputs and final states, relative RMS) and the
"two numbers" floor of METHOD.md (FLOPs over 790 TFLOP/s, minimal bytes over 4.3 TB/s).

Usage (on a CUDA machine with fla-core):
    python bench/gdn_two_phase_kernel.py --out bench/results
Writes <out>/gdn_two_phase_kernel.json and <out>/gdn_two_phase_kernel.png.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

PEAK_FLOPS = 790e12      # bf16 dense, measured on an H200 of this workplace (KINDS.md)
PEAK_BYTES = 4.3e12      # device-to-device copy, bytes read + written (KINDS.md)
CHUNK = 64
CONV_W = 4


# ---------------------------------------------------------------- cost model ("two numbers first")

def flops_per_token(hv: int, k: int, v: int, d: int) -> float:
    """Chunked gated delta rule (chunk C), per token and value head: KK^T, w = A(kβe^g), qK^T
    (3 x 2C K), u = A(vβ), attn @ v_new (2 x 2C V), w S, k^T v_new, q S (3 x 2 K V), the
    triangular solve (~2C^2/3); plus the depthwise conv (2 W D)."""
    c = CHUNK
    return hv * (6 * k * v + 6 * c * k + 4 * c * v + 2 * c * c / 3) + 2 * CONV_W * d


def bytes_per_token(hv: int, v: int, d: int) -> float:
    """Fewest bytes per token: read x (bf16), g (fp32), beta (bf16); write o (bf16)."""
    return 2 * d + 4 * hv + 2 * hv + 2 * hv * v


def floor_ms(tokens: int, state_moves: int, hv: int, k: int, v: int, d: int) -> dict:
    """state_moves: whole per-sequence states read or written (fp32 recurrent + bf16 conv)."""
    state_bytes = 4 * hv * k * v + 2 * d * (CONV_W - 1)
    flops = tokens * flops_per_token(hv, k, v, d)
    nbytes = tokens * bytes_per_token(hv, v, d) + state_moves * state_bytes
    t_flops, t_bytes = flops / PEAK_FLOPS * 1e3, nbytes / PEAK_BYTES * 1e3
    return {"gflop": flops / 1e9, "mbytes": nbytes / 1e6, "flop_ms": t_flops, "byte_ms": t_bytes,
            "floor_ms": max(t_flops, t_bytes)}


def est_peak_bytes(tokens: int, h: int, hv: int, k: int, v: int, d: int) -> float:
    """Rough device memory of one eager call: inputs, conv output, contiguous q/k/v, fla's
    intermediates (normalised q/k, w, u, A, v_new, o) and per-chunk states h (bf16)."""
    per_tok = 2 * d * 3 + 2 * 2 * h * k + 4 * hv * 2 + 2 * hv + 2 * hv * (k + v + v + v) + 4 * hv * CHUNK
    per_tok += 2 * hv * k * v / CHUNK
    return tokens * per_tok


# ---------------------------------------------------------------- the op

def offsets(lens):
    return [0, *itertools.accumulate(lens)]


class CoreOp:
    """conv1d + gated delta rule over a packed batch; shapes fixed per instance."""

    def __init__(self, h, hv, k, v, weight):
        from forkpoint.kernels.conv1d import triton as conv
        from forkpoint.kernels.gated_delta import fla as gdn

        self.conv, self.gdn = conv, gdn
        self.h, self.hv, self.k, self.v, self.weight = h, hv, k, v, weight

    def __call__(self, x, g, beta, conv_state, ssm_state, cu_dev, cu_host):
        y, conv_final = self.conv.causal_conv1d_varlen(x, self.weight, None, conv_state, cu_dev, cu_host)
        q, k, v = y.split([self.h * self.k, self.h * self.k, self.hv * self.v], dim=-1)
        o, ssm_final = self.gdn.chunk_gated_delta_rule(
            q.view(-1, self.h, self.k), k.view(-1, self.h, self.k), v.view(-1, self.hv, self.v),
            g, beta, ssm_state, cu_dev, cu_host)
        return o, conv_final, ssm_final


def make_inputs(gen, tokens, hv, d):
    x = torch.randn(tokens, d, generator=gen, device="cuda").bfloat16()
    g = F.logsigmoid(torch.randn(tokens, hv, generator=gen, device="cuda") + 3.0)
    beta = torch.rand(tokens, hv, generator=gen, device="cuda").bfloat16()
    return x, g, beta


def rel_rms(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------- timing

def time_eager(fns, args):
    from triton.testing import do_bench

    it = itertools.cycle(fns)
    return do_bench(lambda: next(it)(), warmup=args.warmup, rep=args.rep, return_mode="median")


def time_graph(fns, args):
    """Capture one call of each fn in a CUDA graph; median replay time per call."""
    import fla.utils as fla_utils
    from triton.testing import do_bench

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    # fla memoises small index tensors by argument identity (4 entries); a graph must not hold one
    # that a later call evicts, so compute them inside the graph.
    old = getattr(fla_utils, "FLA_DISABLE_TENSOR_CACHE", False)
    fla_utils.FLA_DISABLE_TENSOR_CACHE = True
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for f in fns:
                f()
    finally:
        fla_utils.FLA_DISABLE_TENSOR_CACHE = old
    graph.replay()
    torch.cuda.synchronize()
    t = do_bench(graph.replay, warmup=args.warmup, rep=args.rep, return_mode="median") / len(fns)
    del graph
    return t


def guarded(fn, *a):
    try:
        return fn(*a)
    except torch.cuda.OutOfMemoryError as e:
        print(f"    OOM: {str(e).splitlines()[0][:120]}", flush=True)
    except Exception as e:  # noqa: BLE001 - a failed variant is recorded, the run goes on
        print(f"    failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}", flush=True)
    finally:
        torch.cuda.empty_cache()
    return None


def n_sets(set_bytes, args):
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return 1 if set_bytes > 2 * l2 else min(args.max_sets, math.ceil(4 * l2 / set_bytes))


def make_sets(gen, args, p, s, n, hv, k, v, d):
    """Random input sets (prefix x/g/beta, the N suffixes' x/g/beta packed, initial conv and recurrent
    state), as many as `n_sets` gives for this size."""
    sets = []
    for _ in range(n_sets((p + n * s) * (2 * d + 6 * hv), args)):
        xp, gp, bp = make_inputs(gen, p, hv, d)
        xs, gs, bs = make_inputs(gen, n * s, hv, d)
        c0 = torch.randn(1, d, CONV_W - 1, generator=gen, device="cuda").bfloat16()
        s0 = 0.1 * torch.randn(1, hv, k, v, generator=gen, device="cuda")
        sets.append((xp, gp, bp, xs, gs, bs, c0, s0))
    return sets


def two_phase_fn(op, n, cu_p, cu_p_d, cu_s, cu_s_d):
    """The two-phase path over one input set: the prefix in one call, then its final states gathered
    for all N consumers and every suffix in one packed call."""
    zero_idx = torch.zeros(n, dtype=torch.long, device="cuda")

    def two_phase(st):
        xp, gp, bp, xs, gs, bs, c0, s0 = st
        _, c1, s1 = op(xp, gp, bp, c0, s0, cu_p_d, cu_p)
        return op(xs, gs, bs, c1.index_select(0, zero_idx), s1.index_select(0, zero_idx), cu_s_d, cu_s)

    return two_phase


def record_failure(rows, args, label, p, s, n, e):
    """One config failed: say so, keep the error in the results, and go on with the next."""
    print(f"  {label} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    rows.append({"P": p, "S": s, "N": n, "error": f"{type(e).__name__}: {str(e)[:300]}"})
    args.save()
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- part (a): the seed's setup

def part_seed(args, gen, rows):
    h, hv, k, v = 4, 8, 128, 128
    d = 2 * h * k + hv * v
    p, s = 512, 64
    weight = (0.5 * torch.randn(d, CONV_W, generator=gen, device="cuda")).bfloat16()
    op = CoreOp(h, hv, k, v, weight)
    for n in args.seed_n:
        if time.time() > args.deadline:
            print(f"  seed 1+{n}: skipped, --budget-s spent", flush=True)
            continue
        try:
            cu_p, cu_one, cu_s = [0, p], [0, s], offsets([s] * n)
            cu_p_d, cu_one_d, cu_s_d = (torch.tensor(c, device="cuda") for c in (cu_p, cu_one, cu_s))
            two_phase = two_phase_fn(op, n, cu_p, cu_p_d, cu_s, cu_s_d)
            sets = make_sets(gen, args, p, s, n, hv, k, v, d)

            def sequential(st):
                xp, gp, bp, xs, gs, bs, c0, s0 = st
                _, c1, s1 = op(xp, gp, bp, c0, s0, cu_p_d, cu_p)
                outs = [op(xs[i * s:(i + 1) * s], gs[i * s:(i + 1) * s], bs[i * s:(i + 1) * s], c1, s1,
                           cu_one_d, cu_one)
                        for i in range(n)]
                return outs

            # the two paths compute the same thing: compare the consumers' final states
            seq_states = torch.cat([o[2] for o in sequential(sets[0])])
            err = rel_rms(two_phase(sets[0])[2], seq_states)
            seq_fns = [lambda st=st: sequential(st) for st in sets]
            two_fns = [lambda st=st: two_phase(st) for st in sets]
            row = {"P": p, "S": s, "N": n, "input_sets": len(sets), "state_rel_err_vs_sequential": err,
                   "sequential_ms": guarded(time_eager, seq_fns, args),
                   "two_phase_ms": guarded(time_eager, two_fns, args)}
            if args.graphs:
                row["sequential_graph_ms"] = guarded(time_graph, seq_fns, args)
                row["two_phase_graph_ms"] = guarded(time_graph, two_fns, args)
            row["speedup"] = _ratio(row["sequential_ms"], row["two_phase_ms"])
            row["speedup_graph"] = _ratio(row.get("sequential_graph_ms"), row.get("two_phase_graph_ms"))
            row["floor_two_phase"] = floor_ms(p + n * s, 1 + 2 * n, hv, k, v, d)
            rows.append(row)
            args.save()
            print(f"  seed 1+{n}: seq {_f(row['sequential_ms'])} ms, two-phase {_f(row['two_phase_ms'])} ms, "
                  f"x{_f(row['speedup'], 2)}; graph seq {_f(row.get('sequential_graph_ms'))} two "
                  f"{_f(row.get('two_phase_graph_ms'))}; err {err:.1e}", flush=True)
            del sets, seq_fns, two_fns
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - one failed config must not lose the others
            record_failure(rows, args, f"seed 1+{n}", p, s, n, e)
    return rows


# ---------------------------------------------------------------- part (b): Qwen3.5-35B-A3B sizes

def part_qwen(args, gen, rows):
    h, hv, k, v = 16, 32, 128, 128
    d = 2 * h * k + hv * v
    weight = (0.5 * torch.randn(d, CONV_W, generator=gen, device="cuda")).bfloat16()
    op = CoreOp(h, hv, k, v, weight)
    # N outermost: when --budget-s runs out, the largest batches are the ones left out
    for n, p, s in itertools.product(args.qwen_n, args.qwen_p, args.qwen_s):
        if time.time() > args.deadline:
            print(f"  P={p} S={s} N={n}: skipped, --budget-s spent", flush=True)
            continue
        try:
            row = {"P": p, "S": s, "N": n, "ideal": n * (p + s) / (p + n * s),
                   "floor_full": floor_ms(n * (p + s), 2 * n, hv, k, v, d),
                   "floor_two_phase": floor_ms(p + n * s, 1 + 2 * n, hv, k, v, d)}
            t_full = n * (p + s)
            cu_p, cu_s, cu_f = [0, p], offsets([s] * n), offsets([p + s] * n)
            cu_p_d, cu_s_d, cu_f_d = (torch.tensor(c, device="cuda") for c in (cu_p, cu_s, cu_f))
            two_phase = two_phase_fn(op, n, cu_p, cu_p_d, cu_s, cu_s_d)
            sets = make_sets(gen, args, p, s, n, hv, k, v, d)
            two_fns = [lambda st=st: two_phase(st) for st in sets]
            row["input_sets"] = len(sets)
            row["two_phase_ms"] = guarded(time_eager, two_fns, args)
            if args.graphs:
                row["two_phase_graph_ms"] = guarded(time_graph, two_fns, args)

            est = est_peak_bytes(t_full, h, hv, k, v, d) + 2 * t_full * (2 * d + 6 * hv)
            row["full_est_gb"] = est / 1e9
            if est > args.mem_limit_gb * 1e9:
                row["full_skipped"] = f"needs ~{est / 1e9:.0f} GB > --mem-limit-gb {args.mem_limit_gb}"
                print(f"  P={p} S={s} N={n}: full recompute skipped ({row['full_skipped']})", flush=True)
            else:
                def build_full():
                    # prompt i = prefix + suffix i, so the full recompute computes the same function
                    xp, gp, bp, xs, gs, bs, c0, s0 = sets[0]
                    idx = torch.cat([torch.cat([torch.arange(p), p + i * s + torch.arange(s)])
                                     for i in range(n)]).cuda()
                    full = tuple(torch.cat([a, b]).index_select(0, idx) for a, b in ((xp, xs), (gp, gs), (bp, bs)))
                    return full + (c0.expand(n, -1, -1).contiguous(), s0.expand(n, -1, -1, -1).contiguous())

                full_in = guarded(build_full)
                if full_in is not None:
                    full_fns = [lambda: op(*full_in, cu_f_d, cu_f)]
                    ref = guarded(full_fns[0])
                    if ref is not None:
                        o2, _, st2 = two_phase(sets[0])
                        keep = torch.cat([cu_f[i] + p + torch.arange(s) for i in range(n)]).cuda()
                        row["o_rel_err_vs_full"] = rel_rms(o2, ref[0].index_select(0, keep))
                        row["state_rel_err_vs_full"] = rel_rms(st2, ref[2])
                        del ref, o2, st2
                        row["full_ms"] = guarded(time_eager, full_fns, args)
                        if args.graphs and est < args.graph_mem_limit_gb * 1e9:
                            row["full_graph_ms"] = guarded(time_graph, full_fns, args)
                    del full_fns
                del full_in
            row["speedup"] = _ratio(row.get("full_ms"), row.get("two_phase_ms"))
            row["speedup_graph"] = _ratio(row.get("full_graph_ms"), row.get("two_phase_graph_ms"))
            rows.append(row)
            args.save()
            print(f"  P={p} S={s} N={n}: full {_f(row.get('full_ms'))} ms, two-phase {_f(row['two_phase_ms'])} ms, "
                  f"x{_f(row['speedup'], 2)} (ideal {row['ideal']:.1f}); graph full {_f(row.get('full_graph_ms'))} "
                  f"two {_f(row.get('two_phase_graph_ms'))}; floor two {row['floor_two_phase']['floor_ms']:.3f} ms; "
                  f"err {_f(row.get('state_rel_err_vs_full'), 1, 'e')}", flush=True)
            del sets, two_fns
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001 - one failed config must not lose the others
            record_failure(rows, args, f"P={p} S={s} N={n}", p, s, n, e)
    return rows


# ---------------------------------------------------------------- reporting

def _ratio(a, b):
    return a / b if a is not None and b is not None else None


def _f(x, nd=3, kind="f"):
    return "-" if x is None else f"{x:.{nd}{kind}}"


def print_tables(res):
    print("\n(a) seed setup, 4 key / 8 value heads of 128, producer 512 + N consumers of 64 tokens "
          f"({res['device']})")
    print("| requests | sequential (ms) | two-phase (ms) | speedup | seq. graph (ms) | two-phase graph (ms) "
          "| speedup graph | floor (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in [r for r in res["seed"] if "error" not in r]:
        print(f"| 1+{r['N']} | {_f(r['sequential_ms'])} | {_f(r['two_phase_ms'])} | {_f(r['speedup'], 2)}x "
              f"| {_f(r.get('sequential_graph_ms'))} | {_f(r.get('two_phase_graph_ms'))} "
              f"| {_f(r.get('speedup_graph'), 2)}x | {r['floor_two_phase']['floor_ms']:.3f} |")
    print(f"\n(b) Qwen3.5-35B-A3B GDN layer, 16 key / 32 value heads of 128 ({res['device']})")
    print("| P | S | N | full (ms) | two-phase (ms) | speedup | ideal | full graph (ms) | two-phase graph (ms) "
          "| speedup graph | floor two-phase (ms) | state err |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted([r for r in res["qwen"] if "error" not in r], key=lambda r: (r["P"], r["S"], r["N"])):
        print(f"| {r['P']} | {r['S']} | {r['N']} | {_f(r.get('full_ms'))} | {_f(r['two_phase_ms'])} "
              f"| {_f(r['speedup'], 2)}x | {r['ideal']:.1f} | {_f(r.get('full_graph_ms'))} "
              f"| {_f(r.get('two_phase_graph_ms'))} | {_f(r['speedup_graph'], 2)}x "
              f"| {r['floor_two_phase']['floor_ms']:.3f} | {_f(r.get('state_rel_err_vs_full'), 1, 'e')} |")


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    seed = [r for r in res["seed"] if "error" not in r]
    ns = [r["N"] for r in seed]
    for key, label, style in (("sequential_ms", "sequential, eager", "o-"), ("two_phase_ms", "two-phase, eager", "s-"),
                              ("sequential_graph_ms", "sequential, CUDA graph", "o--"),
                              ("two_phase_graph_ms", "two-phase, CUDA graph", "s--")):
        pts = [(n, r.get(key)) for n, r in zip(ns, seed) if r.get(key) is not None]
        if pts:
            ax1.plot(*zip(*pts), style, label=label)
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("consumers N (64 tokens each, producer 512)")
    ax1.set_ylabel("ms (median)")
    ax1.set_title("(a) seed setup: 4/8 heads of 128")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)

    for (p, s), color in zip(itertools.product(res["args"]["qwen_p"], res["args"]["qwen_s"]),
                             ("C0", "C1", "C2", "C3", "C4", "C5")):
        rows = sorted((r for r in res["qwen"] if r["P"] == p and r["S"] == s and "error" not in r),
                      key=lambda r: r["N"])
        pts = [(r["N"], r["speedup"]) for r in rows if r["speedup"] is not None]
        if pts:
            ax2.plot(*zip(*pts), "o-", color=color, label=f"P={p} S={s} eager")
        pts = [(r["N"], r["speedup_graph"]) for r in rows if r["speedup_graph"] is not None]
        if pts:
            ax2.plot(*zip(*pts), "x--", color=color, label=f"P={p} S={s} graph")
        ax2.plot([r["N"] for r in rows], [r["ideal"] for r in rows], ":", color=color, alpha=0.6)
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("consumers N")
    ax2.set_ylabel("full recompute / two-phase (dotted: ideal N(P+S)/(P+NS))")
    ax2.set_title("(b) Qwen3.5-35B-A3B GDN layer: 16/32 heads of 128")
    ax2.grid(True, which="both", alpha=0.3)
    ax2.legend(fontsize=7, ncol=2)
    fig.suptitle(f"GDN core op (conv1d + gated delta rule), bf16, fp32 state, {res['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="bench/results", help="folder for the JSON and PNG")
    ap.add_argument("--name", default="gdn_two_phase_kernel", help="file stem for the JSON and PNG")
    ap.add_argument("--seed-n", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--qwen-p", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--qwen-s", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--qwen-n", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--parts", nargs="+", default=["seed", "qwen"], choices=["seed", "qwen"])
    ap.add_argument("--warmup", type=float, default=25, help="do_bench warm-up, ms")
    ap.add_argument("--rep", type=float, default=100, help="do_bench repetition time, ms")
    ap.add_argument("--max-sets", type=int, default=8, help="most input sets rotated for small configs")
    ap.add_argument("--mem-limit-gb", type=float, default=100.0, help="skip full recomputes estimated above this")
    ap.add_argument("--graph-mem-limit-gb", type=float, default=40.0, help="capture graphs only below this")
    ap.add_argument("--no-graphs", dest="graphs", action="store_false", help="skip the CUDA-graph timings")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the configs left after this many seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA device")

    import triton

    try:
        from importlib.metadata import version
        fla_version = version("fla-core")
    except Exception:  # noqa: BLE001
        fla_version = "unknown"
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
           "fla_core": fla_version, "args": dict(vars(args)), "peak_flops": PEAK_FLOPS, "peak_bytes": PEAK_BYTES,
           "command": " ".join(sys.argv), "seed": [], "qwen": []}
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"{args.name}.json")
    t0 = time.time()
    args.deadline = t0 + args.budget_s if args.budget_s else float("inf")

    def save():
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)

    args.save = save
    for part in args.parts:
        print(f"part {part}", flush=True)
        (part_seed if part == "seed" else part_qwen)(args, gen, res[part])
    res["wall_s"] = time.time() - t0
    with open(json_path, "w") as f:
        json.dump(res, f, indent=1)
    try:
        plot(res, os.path.join(args.out, f"{args.name}.png"))
    except Exception as e:  # noqa: BLE001 - the numbers matter more than the picture
        print(f"plot failed: {e}")
    print_tables(res)
    print(f"\nwrote {json_path} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
