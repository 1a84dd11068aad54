"""What a long prompt's prefill chunk adds to a step that also decodes: step time against the chunk's
tokens and its position in the prompt, on this machine, with the embedded default model (or --model).

Per chunk size N (`long_prefill_token_threshold` = N, and a mixed-step prefill budget of N: every step
of the long prompt takes N of its tokens at position 0, fewer further in, N / (1 + position / C) with C
the model's attention parity, engine/prefill_budget.py; --attention-parity sets C, a large one keeps N
tokens a step throughout): --streams greedy streams (short prompts,
ignore_eos) decode alone for --decode-steps steps, timed (the decode baseline); then a --prompt-tokens
prompt of random ids arrives and every `engine.step()` is timed until its prefill ends. A row per
(N, position band): the median step time and its ratio to the decode baseline. The bar of issue 27
(a bystander's gap within 2x of its own baseline) holds for chunk N at a position when that ratio is
under 2.

Usage:
    python bench/mixed_step_cost.py                                   # N in 64 128 256 512, 16k prompt
    python bench/mixed_step_cost.py --chunks 128 256 --prompt-tokens 8192
    python bench/mixed_step_cost.py --chunks 64 32 --attention-parity 1000000000   # N tokens at every position
    python bench/mixed_step_cost.py --model DIR --dummy --chunks 512 1024 2048 4096 --name mixed_step_cost_h200
Writes bench/results/mixed_step_cost_cpu.json and .png.
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
from plots import write_results  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402


def start_streams(engine, streams: int) -> None:
    """`streams` greedy streams (ids stream-0 ...; short prompts, ignore_eos) admitted into `engine`
    (an `LLMEngine`), their first tokens out: every later step decodes each of them."""
    params = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i in range(streams):
        engine.add_request(f"stream-{i}", f"Stream {i} tells a story:", params)
    for _ in range(3):
        engine.step()


def stop_streams(engine, streams: int) -> None:
    """Abort the streams `start_streams` began and run `engine` until nothing is left."""
    for i in range(streams):
        engine.abort_request(f"stream-{i}")
    while engine.has_unfinished_requests():
        engine.step()


def measure(chunk: int, args: argparse.Namespace) -> dict:
    """Step times of one engine whose long prompt runs in chunks of `chunk` tokens beside the streams."""
    llm = LLM(args.model, long_prefill_token_threshold=chunk, max_prefill_tokens_with_decodes=chunk, seed=0,
              attention_parity_tokens=args.attention_parity, **({"load_format": "dummy"} if args.dummy else {}))
    engine = llm.engine
    start_streams(engine, args.streams)
    decode = []
    for _ in range(args.decode_steps):
        begin = time.perf_counter()
        engine.step()
        decode.append(time.perf_counter() - begin)
    rng = random.Random(chunk)
    prompt = [rng.randrange(1000, VOCAB_LIMIT) for _ in range(args.prompt_tokens)]
    engine.add_request("long", {"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=1))
    long_request = engine.sequences("long")[0]
    mixed = []  # (position before the step, prefill tokens of the step, seconds)
    while long_request.num_computed_tokens < args.prompt_tokens and not long_request.is_finished:
        position = long_request.num_computed_tokens
        begin = time.perf_counter()
        engine.step()
        mixed.append((position, long_request.num_computed_tokens - position, time.perf_counter() - begin))
    stop_streams(engine, args.streams)
    return {"chunk": chunk, "decode_s": decode, "decode_median_s": statistics.median(decode), "mixed": mixed}


def bands(run: dict, band: int) -> list[dict]:
    """The mixed steps of `run` grouped by position band: median seconds, mean prefill tokens a step and the
    ratio of the median to the decode median."""
    rows = []
    for lo in range(0, max(p for p, _, _ in run["mixed"]) + 1, band):
        times = [s for p, n, s in run["mixed"] if lo <= p < lo + band and n > 0]
        if times:
            median = statistics.median(times)
            tokens = statistics.mean(n for p, n, _ in run["mixed"] if lo <= p < lo + band and n > 0)
            rows.append({"chunk": run["chunk"], "from": lo, "to": lo + band, "steps": len(times), "tokens": tokens,
                         "median_s": median,
                         "max_s": max(times), "x_decode": median / run["decode_median_s"]})
    return rows


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for run in result["runs"]:
        points = [(p, s / run["decode_median_s"]) for p, n, s in run["mixed"] if n > 0]
        ax.plot([p for p, _ in points], [r for _, r in points], ".", label=f"chunk {run['chunk']}", markersize=3)
    ax.axhline(2.0, color="red", linestyle="--", label="2x the decode step (issue 27)")
    ax.set_xlabel("position of the chunk in the prompt (tokens)")
    ax.set_yscale("log")  # a few steps share the CPU with other jobs: outliers up to 100x
    ax.set_ylabel("mixed step time / decode step time")
    ax.set_title(f"{result['streams']} decoding streams + one prefill chunk ({result.get('model', 'embedded model')})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--dummy", action="store_true", help="random weights from the model's config.json")
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512])
    parser.add_argument("--prompt-tokens", type=int, default=16384)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=20)
    parser.add_argument("--band", type=int, default=4096, help="position band of the table's rows")
    parser.add_argument("--attention-parity", type=int, default=None,
                        help="EngineConfig.attention_parity_tokens (default: counted from the model's shape)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="mixed_step_cost_cpu")
    args = parser.parse_args()
    result = {"code": code_version(), "machine": machine_info(), "model": args.model or "embedded model",
              "prompt_tokens": args.prompt_tokens, "attention_parity": args.attention_parity,
              "streams": args.streams, "runs": []}
    print(f"{'chunk':>6} {'positions':>13} {'steps':>6} {'tokens':>7} {'decode s':>9} {'mixed median s':>15} "
          f"{'max s':>7} {'x decode':>9}", flush=True)
    for chunk in args.chunks:
        run = measure(chunk, args)
        result["runs"].append(run)
        for row in bands(run, args.band):
            print(f"{chunk:>6} {row['from']:>6}-{row['to']:<6} {row['steps']:>6} {row['tokens']:>7.1f} "
                  f"{run['decode_median_s']:>9.3f} "
                  f"{row['median_s']:>15.3f} {row['max_s']:>7.3f} {row['x_decode']:>9.2f}", flush=True)
    print(machine_line(result["machine"]))
    print(f"wrote {write_results(result, args.out, args.name, plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
