"""What one prefill token's attention costs per context position on this machine, against the attention
parity C the engine counts from the model's shape (forkpoint/engine/attention_parity.py).

Times the attention op the CPU path runs (`forkpoint.kernels.attention.reference.paged_attention`) at the
model's attention shape (query heads, kv heads, head dim; float32, blocks of 16), for t queries after c
context positions, and fits per (t, c) grid: time = fixed + gather x c + per_pair x t x c (least squares;
`gather`: the reference copies the whole context's keys and values once a segment, whatever t). With
--token-ms (a prefill token's other work: bench/mixed_step_cost.py's first band, the 64-token chunk's step
over the decode step, divided by 64), the measured C = token_ms / per_pair x attention layers, beside the
counted one.

Usage:
    python bench/attention_parity_cpu.py --token-ms 0.147              # the embedded model
    python bench/attention_parity_cpu.py --model DIR --contexts 0 8192 32768
Writes bench/results/attention_parity_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint.config import ModelConfig  # noqa: E402
from forkpoint.engine.attention_parity import attention_parity  # noqa: E402
from forkpoint.inputs.default_model import ensure_default_model  # noqa: E402
from forkpoint.kernels.attention.reference import paged_attention  # noqa: E402

BLOCK = 16


def time_attention(model: ModelConfig, queries: int, context: int, reps: int) -> float:
    """Median seconds of one segment's paged attention: `queries` queries after `context` positions."""
    heads, kv_heads, dim = model.num_attention_heads, model.num_key_value_heads, model.head_dim
    blocks = -(-(context + queries) // BLOCK)
    k, v = torch.randn(blocks, BLOCK, kv_heads, dim), torch.randn(blocks, BLOCK, kv_heads, dim)
    args = (torch.randn(queries, heads, dim), k, v, torch.arange(blocks, dtype=torch.int32)[None],
            torch.tensor([0, queries]), [0, queries], torch.tensor([context + queries]), [context + queries])
    times = []
    for i in range(reps + 2):
        begin = time.perf_counter()
        paged_attention(*args, scale=dim ** -0.5)
        if i >= 2:
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def fit(points: list[dict]) -> dict:
    """Least squares of seconds = fixed + gather x c + per_pair x t x c over `points`."""
    rows = torch.tensor([[1.0, p["context"], p["queries"] * p["context"]] for p in points], dtype=torch.float64)
    seconds = torch.tensor([[p["seconds"]] for p in points], dtype=torch.float64)
    fixed, gather, per_pair = torch.linalg.lstsq(rows, seconds).solution.flatten().tolist()
    return {"fixed_s": fixed, "gather_s_per_position": gather, "per_pair_s": per_pair}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for queries in result["queries"]:
        points = [p for p in result["points"] if p["queries"] == queries]
        ax.plot([p["context"] for p in points], [1000 * p["seconds"] for p in points], "o-", label=f"{queries} queries")
    ax.set_xlabel("context positions before the queries")
    ax.set_ylabel("attention, one layer (ms)")
    ax.set_title(f"CPU attention reference; counted C = {result['counted_parity']}, "
                 f"measured C = {result.get('measured_parity') or '-'}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--queries", type=int, nargs="+", default=[1, 16, 32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[0, 4096, 8192, 12288, 16384])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--token-ms", type=float, default=None,
                        help="a prefill token's other work, ms (from bench/mixed_step_cost.py): prints the measured C")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="attention_parity_cpu")
    args = parser.parse_args()
    model = ModelConfig.from_hf_dir(args.model or ensure_default_model())
    result = {"code": code_version(), "machine": machine_info(), "model": args.model or "embedded model",
              "queries": args.queries, "counted_parity": attention_parity(model), "points": []}
    print(f"{'context':>8} " + " ".join(f"{f't={q} ms':>9}" for q in args.queries), flush=True)
    for context in args.contexts:
        row = []
        for queries in args.queries:
            seconds = time_attention(model, queries, context, args.reps)
            result["points"].append({"queries": queries, "context": context, "seconds": seconds})
            row.append(f"{1000 * seconds:>9.2f}")
        print(f"{context:>8} " + " ".join(row), flush=True)
    result["fit"] = fit(result["points"])
    layers = sum(t in ("full_attention", "parallel") for t in model.layer_types)
    print(f"fit: {1000 * result['fit']['fixed_s']:.3f} ms + {1e9 * result['fit']['gather_s_per_position']:.0f} ns x c "
          f"+ {1e9 * result['fit']['per_pair_s']:.1f} ns x t x c, per attention layer ({layers} in the model)")
    if args.token_ms is not None:
        result["token_ms"] = args.token_ms
        result["measured_parity"] = round(args.token_ms / 1000 / (layers * result["fit"]["per_pair_s"]))
    print(f"C counted from the shape: {result['counted_parity']}; measured: {result.get('measured_parity', '-')}")
    print(machine_line(result["machine"]))
    print(f"wrote {write_results(result, args.out, args.name, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
