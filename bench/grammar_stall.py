"""A streaming bystander's largest token gap while a new structured-output grammar compiles beside it.

Starts `forkpoint serve` (embedded model unless --model) on a free loopback port, or uses --url. Each
trial streams one bystander completion (greedy, ignore_eos, --bystander-tokens tokens); once it has
20 chunks, one 1-token completion with `structured_outputs.choice` of --choices strings is sent and
waited for. Two modes: `new` (a list the server has not seen: its grammar compiles, ~70 ms for 4,096
strings on 2 cores) and `cached` (one list, compiled by a first trial: the request's step costs alone).
Per trial: the bystander's largest gap between chunks while the constrained request was in flight,
its median gap over the whole stream, and the constrained request's time. The first trial of each
mode is a warm-up, left out of the medians.

Usage:
    python bench/grammar_stall.py --trials 7 --choices 4096
Writes bench/results/grammar_stall_cpu.json and .png.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402
from served import start_server  # noqa: E402

WARM_CHUNKS = 20  # the bystander has streamed this many chunks before the constrained request goes


def _bystander(url: str, model: str, tokens: int, times: list[float]) -> None:
    body = {"model": model, "prompt": "Count:", "max_tokens": tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                times.append(time.monotonic())


def trial(url: str, model: str, choices: list[str], bystander_tokens: int) -> dict:
    """One bystander stream and one constrained request beside it; times in ms."""
    times: list[float] = []
    stream = threading.Thread(target=_bystander, args=(url, model, bystander_tokens, times))
    stream.start()
    while len(times) < WARM_CHUNKS and stream.is_alive():
        time.sleep(0.002)
    sent = time.monotonic()
    answer = httpx.post(f"{url}/v1/completions", timeout=600, json={
        "model": model, "prompt": "Pick:", "max_tokens": 1, "temperature": 0,
        "structured_outputs": {"choice": choices}})
    done = time.monotonic()
    stream.join()
    if answer.status_code != 200:
        raise RuntimeError(f"the constrained request failed: {answer.status_code} {answer.text[:300]}")
    gaps = [(a, b) for a, b in zip(times, times[1:])]
    beside = [b - a for a, b in gaps if b > sent and a < done]
    if not beside or times[-1] < done:
        raise RuntimeError("the bystander ended before the constrained request: raise --bystander-tokens")
    return {"max_gap_beside_ms": round(1e3 * max(beside), 1),
            "median_gap_ms": round(1e3 * statistics.median(b - a for a, b in gaps), 1),
            "constrained_ms": round(1e3 * (done - sent), 1)}


def summary(mode: str, rows: list[dict]) -> dict:
    measured = rows[1:]  # the first is a warm-up
    return {"mode": mode, "trials": rows,
            "max_gap_beside_ms_median": statistics.median(r["max_gap_beside_ms"] for r in measured),
            "median_gap_ms_median": statistics.median(r["median_gap_ms"] for r in measured),
            "constrained_ms_median": statistics.median(r["constrained_ms"] for r in measured)}


def plot(result: dict, path: str) -> None:
    """Per mode: the bystander's largest gap beside the constrained request and its median gap."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["modes"]
    labels = [m["mode"] for m in modes]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(labels))
    ax.bar([x - 0.2 for x in xs], [m["max_gap_beside_ms_median"] for m in modes], 0.4,
           label="largest gap beside the request")
    ax.bar([x + 0.2 for x in xs], [m["median_gap_ms_median"] for m in modes], 0.4, label="median gap")
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("bystander token gap (ms, median over trials)")
    ax.set_title(f"a {result['choices']}-string choice beside a stream ({result['model']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one on loopback)")
    parser.add_argument("--model", default=None, help="model directory for the started server (default: embedded)")
    parser.add_argument("--trials", type=int, default=7, help="trials per mode, the first a warm-up")
    parser.add_argument("--choices", type=int, default=4096, help="strings in the choice list (at most 4,096)")
    parser.add_argument("--bystander-tokens", type=int, default=150)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="grammar_stall_cpu")
    args = parser.parse_args()
    process, url = (None, args.url) if args.url else start_server(["--log-level", "warning"], args.model, 600)
    result = {"code": code_version(), "machine": machine_info(), "model": args.model or "embedded model",
              "command": " ".join(sys.argv), "choices": args.choices, "modes": []}
    print(machine_line(result["machine"]), flush=True)
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        run = f"{time.time_ns()}"  # lists no earlier run on a --url server has compiled
        for mode in ("new", "cached"):
            rows = []
            for i in range(args.trials):
                tag = f"{run}-{i}" if mode == "new" else f"{run}-cached"
                rows.append(trial(url, model, [f"{tag} choice {j}" for j in range(args.choices)],
                                  args.bystander_tokens))
            result["modes"].append(summary(mode, rows))
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    print(f"{'mode':<8} {'largest gap beside (ms)':>24} {'median gap (ms)':>16} {'constrained request (ms)':>25}")
    for m in result["modes"]:
        print(f"{m['mode']:<8} {m['max_gap_beside_ms_median']:>24.1f} {m['median_gap_ms_median']:>16.1f} "
              f"{m['constrained_ms_median']:>25.1f}")
    print(f"commit {result['code']['commit']} (forkpoint modified: {result['code']['forkpoint_modified']})")
    print(f"wrote {write_results(result, args.out, args.name, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
