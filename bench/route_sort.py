"""The MoE routes' sort by expert, three ways, at the route counts of decode, mixed and prefill steps.

`forkpoint.kernels.moe.grouped._sorted_routes` groups a step's T * k routes by expert. Each way is
timed at R = T * k routes (k = 8, E = 256: Qwen3.5-35B-A3B's router) with its thresholds forced:
`one_program` (`_route_sort_kernel`: one program, a bitonic sort; R <= 4096), `rank`
(`_route_rank_kernel`: one program per expert) and `torch` (torch.sort + searchsorted + scatter).
Per way and R: the median over --repeats of the GPU time of one CUDA graph replaying --calls calls
(as the MoE runs inside the runner's graphs), divided by --calls. The thresholds MAX_ONE_PROGRAM_ROUTES
and MAX_RANK_ROUTES come from this table.

Usage (on the GPU machine):
    python bench/route_sort.py                       # bench/results/route_sort_h200.{json,png}
    python bench/route_sort.py --tokens 1 64 303 2048 --out /tmp/x
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint.kernels.moe import grouped  # noqa: E402

WAYS = {"one_program": (4096, 1 << 30), "rank": (0, 1 << 30), "torch": (0, 0)}  # (MAX_ONE_PROGRAM, MAX_RANK)
ONE_PROGRAM_LIMIT = 4096


def time_way(way: str, ids: torch.Tensor, experts: int, calls: int, repeats: int) -> float:
    """Microseconds per `_sorted_routes` call of `way` on `ids` (its thresholds set, then restored)."""
    saved = grouped.MAX_ONE_PROGRAM_ROUTES, grouped.MAX_RANK_ROUTES
    grouped.MAX_ONE_PROGRAM_ROUTES, grouped.MAX_RANK_ROUTES = WAYS[way]
    try:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):  # compile and warm, off the capture
                grouped._sorted_routes(ids, experts)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # replayed: the kernels' time, not the host's launches
            for _ in range(calls):
                grouped._sorted_routes(ids, experts)
        samples = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            samples.append(1e3 * start.elapsed_time(end) / calls)
        return statistics.median(samples)
    finally:
        grouped.MAX_ONE_PROGRAM_ROUTES, grouped.MAX_RANK_ROUTES = saved


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for way in WAYS:
        points = [(r["routes"], r[way]) for r in result["rows"] if r.get(way) is not None]
        ax.plot([p for p, _ in points], [t for _, t in points], "o-", label=way)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel(f"routes (tokens x {result['top_k']})")
    ax.set_ylabel("us per sort")
    ax.set_title(f"MoE routes sorted by expert (E = {result['experts']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 32, 64, 128, 256, 303, 512, 1024, 2048,
                                                                    4096, 8192])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="route_sort_h200")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device (the Triton kernels)")
    gen = torch.Generator(device="cuda").manual_seed(0)
    result = {"code": code_version(), "machine": machine_info(), "experts": args.experts, "top_k": args.top_k,
              "calls": args.calls, "repeats": args.repeats, "rows": []}
    print(f"{'tokens':>7} {'routes':>7} " + " ".join(f"{way + ' us':>15}" for way in WAYS), flush=True)
    for tokens in args.tokens:
        logits = torch.randn(tokens, args.experts, generator=gen, device="cuda")
        ids = logits.topk(args.top_k).indices
        row = {"tokens": tokens, "routes": tokens * args.top_k}
        for way in WAYS:
            too_many = way == "one_program" and row["routes"] > ONE_PROGRAM_LIMIT
            row[way] = None if too_many else time_way(way, ids, args.experts, args.calls, args.repeats)
        result["rows"].append(row)
        print(f"{tokens:>7} {row['routes']:>7} " + " ".join(
            f"{'-' if row[way] is None else f'{row[way]:.1f}':>15}" for way in WAYS), flush=True)
    print(machine_line(result["machine"]))
    print(f"wrote {write_results(result, args.out, args.name, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
