"""Kernel benchmark: the routed experts of one MoE layer, Triton tiles against torch's grouped GEMM.

Two expert shapes, bf16, random weights and random softmax routing (every token's top-k of a
random logit row, so the experts a step hits are those of a real router with random weights):

    qwen35b   Qwen3.5-35B-A3B: 256 experts, hidden 2048, expert size 512, top-8, SwiGLU
    nemotron  Nemotron-3-Nano-30B-A3B: 128 experts, hidden 2688, expert size 1856, top-6, relu^2

For each step size T (tokens) and both shapes:
  grouped   `grouped._grouped_mm_outputs` through torch._grouped_mm (the gather, two CUTLASS
            grouped GEMMs with their set-up kernels, the activation): the path of every step before
  tiled     `tiled.expert_mlp` with the shipped table (`tiled.TILES`), its last entry extended
            past its range (where the shipped `fused_moe` takes the grouped GEMMs: `shipped_path`)
  sweep     each GEMM of the tiled path alone over a grid of tile configurations, the fastest kept
and the whole `fused_moe` / `fused_moe_relu2` (route sort, experts, combine) on each path. Times
are medians of CUDA-graph replays (`triton.testing.do_bench_cudagraph`: launch costs excluded, as
in the engine's captured decode steps); GB/s counts the weights of the experts the step hits,
read once. `rows_invariant`: token 0's output rows computed in a step of
1 token and in this step are equal bit for bit (per path).

Usage:
    python bench/moe_kernel.py --out bench/results            # CUDA, a few minutes on an H200
    python bench/moe_kernel.py --tokens 1 64 512 --no-sweep
Writes <out>/moe_kernel_h200.json and .png and prints a table.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kernel_bench  # noqa: E402
from plots import write_results  # noqa: E402

SHAPES = {
    "qwen35b": dict(experts=256, hidden=2048, inter=512, top_k=8, gated=True),
    "nemotron": dict(experts=128, hidden=2688, inter=1856, top_k=6, gated=False),
}
TOKENS = (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096)
# (block_m, block_n, block_k, num_warps, num_stages) tried for each GEMM of the tiled path
SWEEP = ((16, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 32, 256, 4, 3), (16, 64, 256, 4, 3), (16, 128, 128, 4, 3),
         (16, 64, 64, 4, 6), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4), (64, 64, 64, 4, 4), (64, 128, 64, 4, 3),
         (64, 128, 64, 8, 3), (128, 128, 64, 8, 3), (64, 256, 64, 8, 3), (128, 64, 64, 4, 4))


def make_layer(shape: dict, gen: torch.Generator):
    e, hd, i = shape["experts"], shape["hidden"], shape["inter"]
    w1 = (torch.randn(e, (2 if shape["gated"] else 1) * i, hd, generator=gen, device="cuda") / math.sqrt(hd))
    w2 = torch.randn(e, hd, i, generator=gen, device="cuda") / math.sqrt(i)
    return w1.bfloat16(), w2.bfloat16()


def make_step(shape: dict, tokens: int, gen: torch.Generator):
    x = torch.randn(tokens, shape["hidden"], generator=gen, device="cuda").bfloat16()
    logits = torch.randn(tokens, shape["experts"], generator=gen, device="cuda")
    weights, ids = torch.softmax(logits, -1).topk(shape["top_k"])
    return x, weights, ids


def timed(fn, rep: int) -> float:
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def hit_bytes(shape: dict, ids: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> int:
    hit = torch.unique(ids).numel()
    per_expert = (w1[0].numel() + w2[0].numel()) * w1.element_size()
    return hit * per_expert


def sweep_gemm(fn_for_config, rep: int) -> tuple[list, float]:
    """[(config, ms or error)] and the fastest ms, over SWEEP."""
    from forkpoint.kernels.moe import tiled

    results, best = [], math.inf
    for cfg in SWEEP:
        config = tiled.TileConfig(*cfg)
        try:
            ms = timed(fn_for_config(config), rep)
        except Exception as err:  # noqa: BLE001 - a config the GPU cannot hold (shared memory) is skipped
            results.append((cfg, f"{type(err).__name__}: {str(err)[:120]}"))
            continue
        results.append((cfg, ms))
        best = min(best, ms)
    return results, best


def run_shape(name: str, shape: dict, args, gen) -> list[dict]:
    from forkpoint.kernels.moe import grouped, tiled

    w1, w2 = make_layer(shape, gen)
    gated = shape["gated"]
    moe = grouped.fused_moe if gated else grouped.fused_moe_relu2
    x1, _, ids1 = make_step(shape, 1, gen)
    rows = []
    for t in args.tokens:
        x, weights, ids = make_step(shape, t, gen)
        x[:1], ids[:1] = x1, ids1  # token 0 as in the 1-token step, for the invariance check
        routes = grouped._sorted_routes(ids, shape["experts"])
        one = grouped._sorted_routes(ids1, shape["experts"])
        row = {"shape": name, "tokens": t, "routes": t * shape["top_k"], "experts_hit": torch.unique(ids).numel()}
        nbytes = hit_bytes(shape, ids, w1, w2)
        row["hit_weight_mb"] = nbytes / 1e6
        # the tiles timed past the table's range too (its last entry extended), to show where they lose
        extended = tiled.TILES[:-1] + (tiled.TILES[-1]._replace(max_routes_per_expert=math.inf),)
        paths = {
            "grouped": lambda xx, r: grouped._grouped_mm_outputs(xx, w1, w2, r, gated=gated),
            "tiled": lambda xx, r: tiled.expert_mlp(xx, w1, w2, r.tokens, r.rows, gated=gated, table=extended),
        }
        saved, results = tiled.TILES, {}
        try:
            for path, outputs in paths.items():
                ms = timed(lambda f=outputs, xx=x, r=routes: f(xx, r), args.rep)
                row[f"{path}_ms"] = ms
                row[f"{path}_gbs"] = nbytes / ms / 1e6
                full, alone = outputs(x, routes), outputs(x1, one)
                row[f"{path}_rows_invariant"] = bool(torch.equal(full[routes.pos[: shape["top_k"]]], alone[one.pos]))
                results[path] = full
                tiled.TILES = extended if path == "tiled" else ()
                row[f"{path}_moe_ms"] = timed(lambda xx=x, ww=weights, ii=ids: moe(xx, w1, w2, ww, ii), args.rep)
        finally:
            tiled.TILES = saved
        diff = (results["tiled"].float() - results["grouped"].float()).abs().max().item()
        row["tiled_equals_grouped"], row["tiled_vs_grouped_max_abs"] = diff == 0.0, diff
        row["shipped_path"] = "tiled" if tiled.covers(row["routes"], shape["experts"], tiled.TILES) else "grouped"
        row["tiles"] = list(tiled.tiles_for(row["routes"], shape["experts"], extended))
        if args.sweep:
            first_act = tiled.SWIGLU if gated else tiled.RELU2
            a = tiled.expert_gemm(x, w1, routes.rows, routes.tokens.shape[0], tiled.TILES[0].first, act=first_act,
                                  rows_of=routes.tokens)
            first, row["first_best_ms"] = sweep_gemm(
                lambda c: lambda: tiled.expert_gemm(x, w1, routes.rows, routes.tokens.shape[0], c, act=first_act,
                                                    rows_of=routes.tokens), args.rep)
            second, row["second_best_ms"] = sweep_gemm(
                lambda c: lambda: tiled.expert_gemm(a, w2, routes.rows, routes.tokens.shape[0], c, act=tiled.NONE),
                args.rep)
            row["first_sweep"], row["second_sweep"] = first, second
            row["first_best"] = min((r for r in first if isinstance(r[1], float)), key=lambda r: r[1])[0]
            row["second_best"] = min((r for r in second if isinstance(r[1], float)), key=lambda r: r[1])[0]
            row["sweep_best_gbs"] = nbytes / (row["first_best_ms"] + row["second_best_ms"]) / 1e6
        rows.append(row)
        print_row(row)
    return rows


def print_row(row: dict) -> None:
    best = (f" | sweep best {row['first_best_ms'] * 1e3:7.1f} + {row['second_best_ms'] * 1e3:6.1f} us "
            f"{tuple(row['first_best'])} {tuple(row['second_best'])}") if "first_best_ms" in row else ""
    paths = " | ".join(f"{p} {row[p + '_ms'] * 1e3:7.1f} us ({row[p + '_gbs']:5.0f} GB/s, "
                       f"inv {row[p + '_rows_invariant']!s:5s})" for p in ("grouped", "tiled"))
    print(f"{row['shape']:9s} T={row['tokens']:5d} hit {row['experts_hit']:3d} | {paths} | same bits "
          f"{row['tiled_equals_grouped']!s:5s} | moe "
          f"{row['grouped_moe_ms'] * 1e3:7.1f} -> {row['tiled_moe_ms'] * 1e3:7.1f} us{best}", flush=True)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(SHAPES), figsize=(6 * len(SHAPES), 4.2))
    for ax, name in zip(axes, SHAPES):
        rows = [r for r in res["rows"] if r["shape"] == name]
        t = [r["tokens"] for r in rows]
        ax.plot(t, [r["grouped_gbs"] for r in rows], "o-", label="grouped GEMM (torch._grouped_mm)")
        ax.plot(t, [r["tiled_gbs"] for r in rows], "s-", label="Triton tiles (shipped table, last entry extended)")
        ax.plot(t, [r[r["shipped_path"] + "_gbs"] for r in rows], "k:", lw=2, label="shipped (fused_moe's choice)")
        if all("sweep_best_gbs" in r for r in rows):
            ax.plot(t, [r["sweep_best_gbs"] for r in rows], "^--", label="Triton tiles (best of sweep)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens in the step")
        ax.set_ylabel("GB/s of the hit experts' weights")
        ax.set_title(f"{name}: routed experts, one layer")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{res['device']}, commit {str(res.get('commit'))[:9]}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = kernel_bench.parser(__doc__, "moe_kernel_h200", rep=30)
    ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    kernel_bench.add_sweep_options(ap, SHAPES, "only the shipped table")
    args = ap.parse_args()
    res = kernel_bench.results_header(args, shapes=SHAPES, sweep=SWEEP)
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"{args.name}.json")
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    start = time.time()
    for name in args.shapes:
        res["rows"] += run_shape(name, SHAPES[name], args, gen)
        with open(json_path, "w") as f:
            json.dump(res, f, indent=1)
        torch.cuda.empty_cache()
    res["wall_s"] = time.time() - start
    print(f"wrote {write_results(res, args.out, args.name, plot)} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
