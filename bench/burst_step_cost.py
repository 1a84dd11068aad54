"""What a burst of short prompts adds to a step that also decodes: step time against the burst's
sequences and tokens, on this machine, with the embedded default model (or --model).

--streams greedy streams decode; between bursts one decode step is timed (the decode baseline). Each
burst is N prompts of L random token ids (1 token each, so each prompt ends in the step that admits
it), added at once; every `engine.step()` until they have all ended is timed, with how many of them it
ran (sequences that ended in it) and their prompt tokens. The fit (least squares over the
(sequences, tokens) cells, each its median step): step = c + a x sequences + b x tokens; a / b is what
one short prefill sequence costs in prefill tokens (engine/prefill_budget.py's SHORT_SEQUENCE_TOKENS).

Usage:
    python bench/burst_step_cost.py                      # N in 8 32 64, L in 1 8 32, 3 rounds
    python bench/burst_step_cost.py --sizes 16 64 --lengths 4 --rounds 5
Writes bench/results/burst_step_cost_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import VOCAB_LIMIT, code_version, machine_info, machine_line  # noqa: E402
from mixed_step_cost import start_streams, stop_streams  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402


def measure(args: argparse.Namespace) -> dict:
    """Every timed step: decode baselines and burst steps (sequences, tokens, seconds)."""
    llm = LLM(args.model, max_prefill_tokens_with_decodes=args.budget, seed=0)
    engine = llm.engine
    start_streams(engine, args.streams)
    rng = random.Random(0)
    decode, bursts = [], []
    burst_params = SamplingParams(temperature=0.0, max_tokens=1)
    for round_ in range(args.rounds):
        for size in args.sizes:
            for length in args.lengths:
                begin = time.perf_counter()
                engine.step()
                decode.append(time.perf_counter() - begin)
                ids = [f"burst-{round_}-{size}-{length}-{i}" for i in range(size)]
                for rid in ids:
                    engine.add_request(rid, {"prompt_token_ids": [rng.randrange(1000, VOCAB_LIMIT)
                                                                  for _ in range(length)]}, burst_params)
                left = set(ids)
                while left:
                    begin = time.perf_counter()
                    engine.step()
                    seconds = time.perf_counter() - begin
                    ended = {rid for rid in left if not engine.sequences(rid)}
                    left -= ended
                    bursts.append({"size": size, "length": length, "seqs": len(ended),
                                   "tokens": len(ended) * length, "s": seconds})
    stop_streams(engine, args.streams)
    return {"decode_s": decode, "bursts": bursts}


def fit(bursts: list[dict]) -> tuple[float, float, float]:
    """Least squares of step = c + a x seqs + b x tokens over the burst steps' (seqs, tokens) cells,
    each cell's median step: (c, a, b) seconds (c: the step's own cost with its decodes)."""
    import numpy as np

    cells: dict[tuple[int, int], list[float]] = {}
    for b in bursts:
        if b["seqs"]:
            cells.setdefault((b["seqs"], b["tokens"]), []).append(b["s"])
    rows = np.array([[1.0, n, t] for n, t in cells])
    times = np.array([statistics.median(v) for v in cells.values()])
    c, a, b = np.linalg.lstsq(rows, times, rcond=None)[0]
    return float(c), float(a), float(b)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    base = result["decode_median_s"]
    for length in sorted({b["length"] for b in result["bursts"]}):
        points = [(b["seqs"], b["s"] / base) for b in result["bursts"] if b["length"] == length and b["seqs"]]
        ax.plot([n for n, _ in points], [r for _, r in points], "o", label=f"{length}-token prompts", markersize=4)
    ax.axhline(2.0, color="red", linestyle="--", label="2x the decode step (issue 27)")
    ax.set_xlabel("short prompts run in the step (1 token each)")
    ax.set_ylabel("step time / decode step time")
    ax.set_title(f"{result['streams']} decoding streams + a burst of short prompts "
                 f"(commit {result['code']['commit'][:7]})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--budget", type=int, default=64, help="max_prefill_tokens_with_decodes (the CPU server's)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="burst_step_cost_cpu")
    args = parser.parse_args()
    result = {"code": code_version(), "machine": machine_info(), "model": args.model or "embedded model",
              "streams": args.streams, "budget": args.budget, **measure(args)}
    base = statistics.median(result["decode_s"])
    fixed, per_seq, per_token = fit(result["bursts"])
    result.update(decode_median_s=base, fixed_s=fixed, per_seq_s=per_seq, per_token_s=per_token)
    print(f"{'prompts':>8} {'tokens each':>12} {'steps':>6} {'seqs/step':>10} {'median s':>9} {'x decode':>9}")
    for size in args.sizes:
        for length in args.lengths:
            steps = [b for b in result["bursts"] if b["size"] == size and b["length"] == length]
            median = statistics.median(b["s"] for b in steps)
            print(f"{size:>8} {length:>12} {len(steps):>6} {statistics.median(b['seqs'] for b in steps):>10.0f} "
                  f"{median:>9.3f} {median / base:>9.2f}")
    print(f"decode step (median of {len(result['decode_s'])}): {base * 1e3:.1f} ms; fit: "
          f"{fixed * 1e3:.1f} ms + {per_seq * 1e3:.2f} ms a sequence, {per_token * 1e3:.3f} ms a token: "
          f"a sequence = {per_seq / per_token:.0f} tokens")
    print(machine_line(result["machine"]))
    print(f"wrote {write_results(result, args.out, args.name, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
