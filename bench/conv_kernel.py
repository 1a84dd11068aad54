"""Kernel benchmark: the packed varlen causal conv1d (`kernels/conv1d/triton.py`) over its tile sizes.

One GDN layer's conv of a prefill step at Qwen3.5-35B-A3B shapes: D = 8,192 channels written as
the q / k / v groups (2,048 / 2,048 / 4,096: `split`), W = 4 taps, x a column view of the stacked
projection output (row stride 12,352), bf16, SiLU; steps of 2 x 4,096 tokens (a full plain step)
and 32 x 256 (consumers). And Nemotron-3-Nano's Mamba2 conv (D = 6,144, x a view of a 10,304-wide
in_proj output, no split). For each tile (tokens x channels per program, warps): the median time
(triton.testing.do_bench, L2 flushed), GB/s of the fewest bytes (x read once, y written once, the
states), and whether y and the final states are bit-identical to the shipped tile's (every tile
sums the taps in the same order). The reference check: the shipped tile against
`reference.causal_conv1d_varlen` in fp32 (relative RMS).

Usage:
    python bench/conv_kernel.py --out bench/results     # CUDA, about a minute on an H200
Writes <out>/conv_kernel_h200.json and .png and prints a table.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import kernel_bench  # noqa: E402
from plots import write_results  # noqa: E402

TILES = ((64, 128, 4), (32, 128, 4), (16, 128, 4), (64, 64, 4), (32, 64, 2), (64, 256, 8), (32, 256, 4),
         (128, 64, 4), (16, 256, 4), (32, 128, 2))
CASES = (
    dict(name="35B GDN 2x4096", lens=[4096] * 2, split=(2048, 2048, 4096), row=12352),
    dict(name="35B GDN 32x256", lens=[256] * 32, split=(2048, 2048, 4096), row=12352),
    dict(name="Nemotron 2x4096", lens=[4096] * 2, split=None, d=6144, row=10304),
)


def make_case(case: dict, gen: torch.Generator):
    d = sum(case["split"]) if case["split"] else case["d"]
    t = sum(case["lens"])
    base = torch.randn(t, case["row"], generator=gen, device="cuda").bfloat16()
    x = base[:, :d]
    weight = (torch.randn(d, 4, generator=gen, device="cuda") / 2).bfloat16()
    state = torch.randn(len(case["lens"]), d, 3, generator=gen, device="cuda").bfloat16()
    cu = [0]
    for n in case["lens"]:
        cu.append(cu[-1] + n)
    return x, weight, state, torch.tensor(cu, device="cuda"), cu


def run_case(case: dict, args, gen) -> list[dict]:
    import triton.testing

    from forkpoint.kernels.conv1d import reference
    from forkpoint.kernels.conv1d import triton as tri

    x, weight, state, cu_dev, cu = make_case(case, gen)
    d = x.shape[1]
    nbytes = 2 * x.numel() * x.element_size() + 2 * state.numel() * state.element_size()

    def call(tile):
        return tri._varlen(x, weight, None, state, cu_dev, cu, "silu", case["split"], tri.VarlenTile(*tile))

    shipped = call(tuple(tri.VARLEN_TILE))
    y_ref, s_ref = reference.causal_conv1d_varlen(x.float().cpu(), weight.float().cpu(), None, state.float().cpu(),
                                                  cu_dev.cpu(), cu, activation="silu")
    y_ship = torch.cat([p.reshape(p.shape[0], -1) for p in shipped[0]], 1) if case["split"] else shipped[0]
    err = ((y_ship.double().cpu() - y_ref.double()).norm() / y_ref.double().norm()).item()
    rows = []
    for tile in TILES:
        row = {"case": case["name"], "tile": list(tile), "shipped": list(tile) == list(tri.VARLEN_TILE),
               "ref_rel_rms": err, "D": d, "T": x.shape[0]}
        try:
            out = call(tile)
            ms = triton.testing.do_bench(lambda t=tile: call(t), warmup=args.warmup, rep=args.rep,
                                         return_mode="median")
        except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            rows.append(row)
            print(f"{case['name']:18s} {tile}: {row['error']}", flush=True)
            continue
        same = all(torch.equal(a, b) for a, b in zip(out[0], shipped[0])) and torch.equal(out[1], shipped[1])
        row.update(ms=ms, gbs=nbytes / ms / 1e6, same_bits_as_shipped=same)
        rows.append(row)
        print(f"{case['name']:18s} tile {tile}: {ms * 1e3:7.1f} us {row['gbs']:6.0f} GB/s same bits {same} "
              f"(shipped {tuple(tri.VARLEN_TILE)} vs reference {err:.2e})", flush=True)
    return rows


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    names = [c["name"] for c in CASES]
    width = 0.8 / len(TILES)
    for i, tile in enumerate(TILES):
        vals = [next((r.get("gbs", 0) for r in res["rows"] if r["case"] == n and r["tile"] == list(tile)), 0)
                for n in names]
        ax.bar([j + i * width for j in range(len(names))], vals, width, label=str(tile))
    ax.set_xticks([j + 0.4 for j in range(len(names))], names)
    ax.set_ylabel("GB/s (x read + y written once)")
    ax.set_title(f"varlen causal conv1d tiles (tokens, channels, warps), {res['device']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = kernel_bench.parser(__doc__, "conv_kernel_h200", rep=40)
    ap.add_argument("--warmup", type=float, default=10)
    args = ap.parse_args()
    res = kernel_bench.results_header(args, tiles=TILES)
    gen = torch.Generator(device="cuda").manual_seed(0)
    start = time.time()
    for case in CASES:
        res["rows"] += run_case(case, args, gen)
    res["wall_s"] = time.time() - start
    path = write_results(res, args.out, args.name, plot)
    print(f"wrote {path} ({res['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
