"""Summarise a compact step trace (bench/step_trace.py with FORKPOINT_STEP_TRACE_COMPACT=1, as
`bench/agent_sessions.py --step-trace` writes it): per window of the run (default: the whole trace), the
steps by kind (decode only, prefill only, mixed), how long each kind took from plan to settle, the
interval between consecutive steps' plans (a step loop that spends time outside plan..settle, in output
work or waiting for the GIL, shows it as interval > duration), and the plan's device writes.

    python bench/step_trace_summary.py TRACE [--from S --to S]   # S: seconds after the first request was added
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import Counter


def load(path: str) -> tuple[list[dict], list[dict]]:
    """(step lines, `added` lines) of a trace, each in file order."""
    steps, added = [], []
    with open(path) as lines:
        for line in lines:
            entry = json.loads(line)
            (added if "added" in entry else steps).append(entry)
    return steps, added


def kind(step: dict) -> str:
    if step["prefill_tokens"] == 0:
        return "decode"
    return "prefill" if step["decodes"] == 0 else "mixed"


def summarise(steps: list[dict]) -> dict:
    """Per kind: steps, seconds plan..settle (sum, mean ms), decodes, prefill tokens and segments, device
    writes by type; and over all: the span, the mean interval between plans."""
    kinds: dict[str, dict] = {}
    for step in steps:
        row = kinds.setdefault(kind(step), {"steps": 0, "seconds": 0.0, "decodes": 0, "prefill_tokens": 0,
                                            "prefill_segments": 0, "writes": Counter()})
        row["steps"] += 1
        row["seconds"] += step["end"] - step["start"]
        row["decodes"] += step["decodes"]
        row["prefill_tokens"] += step["prefill_tokens"]
        row["prefill_segments"] += step["prefill_segments"]
        row["writes"].update(step["writes"])
    for row in kinds.values():
        row["mean_ms"] = 1000 * row["seconds"] / row["steps"]
        row["writes"] = dict(row["writes"])
    starts = [s["start"] for s in steps]
    intervals = [b - a for a, b in zip(starts, starts[1:])]
    return {"steps": len(steps), "span_s": steps[-1]["end"] - steps[0]["start"] if steps else 0.0,
            "plan_interval_mean_ms": 1000 * statistics.mean(intervals) if intervals else 0.0, "kinds": kinds}


def table(summary: dict) -> str:
    lines = [f"{summary['steps']} steps over {summary['span_s']:.1f} s, a plan every "
             f"{summary['plan_interval_mean_ms']:.1f} ms on average",
             f"{'kind':<8} {'steps':>6} {'s':>7} {'mean ms':>8} {'decodes':>8} {'prefill':>9} {'segments':>8}  writes"]
    for name, row in sorted(summary["kinds"].items()):
        lines.append(f"{name:<8} {row['steps']:>6} {row['seconds']:>7.1f} {row['mean_ms']:>8.1f} {row['decodes']:>8} "
                     f"{row['prefill_tokens']:>9} {row['prefill_segments']:>8}  {row['writes']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--from", dest="begin", type=float, default=None,
                        help="seconds after the first request was added (default: the start)")
    parser.add_argument("--to", dest="end", type=float, default=None, help="(default: the end)")
    args = parser.parse_args()
    steps, added = load(args.trace)
    origin = added[0]["at"] if added else steps[0]["start"]
    chosen = [s for s in steps if (args.begin is None or s["start"] >= origin + args.begin)
              and (args.end is None or s["start"] < origin + args.end)]
    print(table(summarise(chosen)))


if __name__ == "__main__":
    main()
