"""Kernel benchmark: decode-sized dense projections, the Triton kernel (`kernels/dense/triton.py`) against cuBLAS.

y = x @ W^T, bf16, no bias, at Qwen3.5-35B-A3B decode shapes W [N, K]:

    12352 x 2048    GDN in_proj (q, k, v, z stacked)      2048 x 4096   GDN / attention out_proj
    1288 x 2048     router + shared gate + ... stacked    2048 x 512    shared expert down_proj
    9216 x 2048     attention q/gate + k + v              248320 x 2048 LM head

and M = 1 ... 64 rows (tokens of a decode step). For each (shape, M): cuBLAS (torch.mm into a
preallocated output, what F.linear runs), the shipped table (`triton.linear`, which falls back to
F.linear past its table) and, unless --no-sweep, every configuration of `SWEEP` through
`triton.linear_tile` (tl.dot tiles with BLOCK_M = 16 or the next power of two of M up to 64; the
broadcast path for M <= 4). Times are medians of CUDA-graph replays (triton.testing.do_bench_cudagraph:
launch costs excluded, as in the engine's captured decode steps), each call reading the next of
several weight copies totalling > 160 MB, so the weights come from HBM as in a forward, not from
the 50 MB L2. GB/s counts the weight bytes read once. Checks per (shape, M): the shipped result
against cuBLAS (relative RMS), and for each configuration whether row 0 equals, bit for bit, the
same configuration's row 0 at M = 1 (`row0_invariant`) and the shipped table's at M = 1
(`row0_as_shipped`): a table may mix only configurations that agree.

Usage:
    python bench/dense_kernel.py --out bench/results             # CUDA, about 40 s on an H200
    python bench/dense_kernel.py --no-sweep                      # the shipped table only
Writes <out>/dense_kernel_h200.json and .png and prints a table.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kernel_bench  # noqa: E402
from moe_kernel import timed  # noqa: E402
from plots import write_results  # noqa: E402

SHAPES = {"out_proj 2048x4096": (2048, 4096), "router+ 1288x2048": (1288, 2048), "shared_down 2048x512": (2048, 512),
          "gdn_in 12352x2048": (12352, 2048), "attn_qkv 9216x2048": (9216, 2048),
          "lm_head 248320x2048": (248320, 2048)}
ROWS = (1, 2, 4, 8, 16, 32, 64)
# (block_n, block_k, num_warps, num_stages, dot); block_m from M (dot: 16 and, past 16, the next
# power of two of M up to 64; broadcast: M's next power of two, M <= 4 only)
SWEEP = ((16, 128, 4, 4, True), (16, 256, 4, 3, True), (16, 256, 4, 4, True), (16, 512, 4, 3, True),
         (16, 512, 4, 5, True), (16, 1024, 4, 2, True), (32, 128, 4, 4, True), (32, 256, 4, 3, True),
         (64, 128, 4, 4, True), (64, 256, 8, 3, True), (128, 128, 8, 3, True), (32, 64, 4, 6, True),
         (2, 1024, 4, 1, False), (4, 512, 4, 1, False), (4, 1024, 4, 1, False), (4, 2048, 8, 1, False),
         (8, 512, 4, 1, False), (8, 512, 4, 3, False), (16, 512, 8, 1, False))
MIN_WEIGHT_BYTES = 160e6  # weight copies per shape: together more than 3x the H200's L2


def tiles_for_rows(m: int, tile_of) -> list:
    """The sweep's Tiles for a step of m rows."""
    tiles = []
    for bn, bk, warps, stages, dot in SWEEP:
        if dot:
            block_ms = sorted({16, min(64, max(16, 1 << (m - 1).bit_length()))})
        elif m <= 4:
            block_ms = [1 << (m - 1).bit_length()]
        else:
            block_ms = []
        tiles += [tile_of(m, bm, bn, bk, warps, stages, dot) for bm in block_ms]
    return tiles


def run_shape(name: str, n: int, k: int, args, gen) -> list[dict]:
    from forkpoint.kernels.dense import triton as tri

    copies = max(1, math.ceil(MIN_WEIGHT_BYTES / (n * k * 2)))
    weights = [(torch.randn(n, k, generator=gen, device="cuda") / math.sqrt(k)).bfloat16() for _ in range(copies)]
    x_all = torch.randn(max(args.rows), k, generator=gen, device="cuda").bfloat16()
    nbytes = n * k * 2
    first_rows: dict = {}  # Tile (as at M = 1) -> its row 0 at M = 1

    def rotating(fn):
        ws = itertools.cycle(weights)
        return lambda: fn(next(ws))

    def as_m1(tile):
        return tri.Tile(1, tile.block_m if tile.dot else 1, *[getattr(tile, f) for f in
                                                             ("block_n", "block_k", "num_warps", "num_stages", "dot")])

    def row0_at_m1(tile):
        key = as_m1(tile)
        if key not in first_rows:
            out = torch.empty(1, n, dtype=x_all.dtype, device="cuda")
            first_rows[key] = tri.linear_tile(x_all[:1], weights[0], None, out, key)[0].clone()
        return first_rows[key]

    shipped_m1 = tri.linear(x_all[:1], weights[0])[0].clone()
    rows = []
    for m in args.rows:
        x = x_all[:m]
        out = torch.empty(m, n, dtype=x.dtype, device="cuda")
        cublas = torch.mm(x, weights[0].t())
        shipped = tri.linear(x, weights[0])
        tile = tri.tile_for(m, n, k)
        row = {"shape": name, "N": n, "K": k, "M": m, "weight_copies": copies,
               "shipped_tile": None if tile is None else vars(tile),
               "shipped_vs_cublas_rel_rms": ((shipped.double() - cublas.double()).norm()
                                             / cublas.double().norm()).item(),
               "shipped_row0_invariant": bool(torch.equal(shipped[0], shipped_m1))}
        row["cublas_us"] = 1e3 * timed(rotating(lambda w: torch.mm(x, w.t(), out=out)), args.rep)
        row["shipped_us"] = 1e3 * timed(rotating(lambda w: tri.linear(x, w)), args.rep)
        if args.sweep:
            sweep = []
            for t in tiles_for_rows(m, lambda *a: tri.Tile(*a)):
                entry = {"tile": vars(t)}
                try:
                    y = tri.linear_tile(x, weights[0], None, out, t)[0].clone()
                    entry["us"] = 1e3 * timed(rotating(lambda w, t=t: tri.linear_tile(x, w, None, out, t)), args.rep)
                except Exception as err:  # noqa: BLE001 - a config the GPU cannot hold (shared memory) is reported
                    entry["error"] = f"{type(err).__name__}: {str(err)[:160]}"
                    sweep.append(entry)
                    continue
                entry["row0_invariant"] = bool(torch.equal(y, row0_at_m1(t)))
                entry["row0_as_shipped"] = bool(torch.equal(y, shipped_m1))
                sweep.append(entry)
            row["sweep"] = sweep
            best = min((e for e in sweep if "us" in e), key=lambda e: e["us"])
            row["best_us"], row["best_tile"] = best["us"], best["tile"]
            same = [e for e in sweep if "us" in e and e["row0_as_shipped"]]
            if same:
                best_same = min(same, key=lambda e: e["us"])
                row["best_as_shipped_us"], row["best_as_shipped_tile"] = best_same["us"], best_same["tile"]
        for key in [key for key in row if key.endswith("_us")]:
            row[key.replace("_us", "_gbs")] = nbytes / row[key] / 1e3
        rows.append(row)
        print_row(row, time.time() - args.start)
    return rows


def short(tile: dict | None) -> str:
    if tile is None:
        return "cuBLAS"
    return (f"{'dot' if tile['dot'] else 'bcast'} m{tile['block_m']} n{tile['block_n']} k{tile['block_k']} "
            f"w{tile['num_warps']} s{tile['num_stages']}")


def print_row(row: dict, elapsed: float) -> None:
    best = ""
    if "best_us" in row:
        best = f" | best {row['best_us']:6.1f} us {row['best_gbs']:5.0f} GB/s {short(row['best_tile'])}"
        if "best_as_shipped_us" in row:
            best += f" | best same bits {row['best_as_shipped_us']:6.1f} us {short(row['best_as_shipped_tile'])}"
    print(f"{elapsed:4.0f}s {row['shape']:21s} M={row['M']:2d} | "
          f"cuBLAS {row['cublas_us']:6.1f} us {row['cublas_gbs']:5.0f} GB/s | "
          f"shipped {row['shipped_us']:6.1f} us {row['shipped_gbs']:5.0f} GB/s ({short(row['shipped_tile'])}, "
          f"inv {row['shipped_row0_invariant']!s:5s}, vs cuBLAS {row['shipped_vs_cublas_rel_rms']:.1e}){best}",
          flush=True)


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["shape"] for r in res["rows"]))
    fig, axes = plt.subplots(2, math.ceil(len(names) / 2), figsize=(5 * math.ceil(len(names) / 2), 8), squeeze=False)
    for ax, name in zip(axes.flat, names):
        rows = [r for r in res["rows"] if r["shape"] == name]
        m = [r["M"] for r in rows]
        ax.plot(m, [r["cublas_gbs"] for r in rows], "o-", label="cuBLAS (F.linear)")
        ax.plot(m, [r["shipped_gbs"] for r in rows], "s-", label="shipped (triton.linear)")
        if all("best_gbs" in r for r in rows):
            ax.plot(m, [r["best_gbs"] for r in rows], "^--", label="best of sweep")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("rows M")
        ax.set_ylabel("GB/s of weight reads")
        ax.set_title(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"decode-sized dense projections, bf16, {res['device']}, commit {str(res.get('commit'))[:9]}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = kernel_bench.parser(__doc__, "dense_kernel_h200", rep=2)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    kernel_bench.add_sweep_options(ap, SHAPES, "only cuBLAS and the shipped table")
    args = ap.parse_args()
    res = kernel_bench.results_header(args, shapes=SHAPES, sweep=SWEEP)
    from forkpoint.kernels.dense import triton as tri

    res["table"] = [{"max_n": c.max_n, "max_k": c.max_k, "tiles": [vars(t) for t in c.tiles]} for c in tri.TABLE]
    gen = torch.Generator(device="cuda").manual_seed(args.seed)
    args.start = start = time.time()
    for name in args.shapes:
        res["rows"] += run_shape(name, *SHAPES[name], args, gen)
        torch.cuda.empty_cache()
    res["wall_s"] = time.time() - start
    print(f"wrote {write_results(res, args.out, args.name, plot)} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
