"""What the engine thread's output work costs per decode step at many streams, on this machine's CPU: each
stream's incremental detokenisation of its new token and its cumulative `RequestOutput`
(engine/output_processor.py), with the real Qwen3.5 tokenizer (the embedded model's).

Rows: the incremental detokenizer with its windows decoded through the Rust tokenizer directly (the
default, inputs/detokenizer.py `window_decoder`) against through `tokenizer.decode` (the wrapper, as
before session 16); and `make_output` for N streams with P-token prompts, once per --outputs-so-far
O: after each stream has generated O tokens already. Each measurement decodes --steps tokens for every
stream, --reps times, alternating the two decoders so both see the same load; the table gives the median
microseconds per token and milliseconds per step of N streams. Beside each `make_output` row, the same
with `make_delta_output` (only what is new: a streamed response's outputs).

`make_output` builds a cumulative `RequestOutput` (every token id copied, the whole text), so its cost per
step grows with O: a prompt reported every step (a streamed response) costs host time in proportion to
its output so far, quadratic over a long generation. The engine reports a prompt whose response does not
stream only at its first token and when it finishes, and a streamed one as deltas until its finished
output (engine/engine.py `add_request`).
The outputs built in a step are kept until the next step's are (as the server holds each prompt's latest
until the event loop has read it), so their memory is not simply reused.

Usage:
    python bench/output_path_cost.py                  # N = 256, P = 3,700: bench/results/output_path_cost_cpu.*
    python bench/output_path_cost.py --outputs-so-far 0 2000 8000 --steps 20 --name output_path_cost_long_cpu
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint.cache.hashing import PrefixHasher  # noqa: E402
from forkpoint.engine.output_processor import OutputProcessor  # noqa: E402
from forkpoint.engine.request import Request  # noqa: E402
from forkpoint.inputs import detokenizer  # noqa: E402
from forkpoint.inputs.detokenizer import IncrementalDetokenizer  # noqa: E402
from forkpoint.sampling_params import SamplingParams  # noqa: E402

WORDS = ("river", "basin", "flood", "level", "spring", "report", "station", "gauge", "rain", "upstream", "naïve",
         "café", "日本語", "🤖", "valley", "north", "meter", "daily", "peak", "record", "season", "storm")


def wrapper_decoder(tokenizer, skip_special_tokens: bool, spaces_between_special_tokens: bool = True):
    """The decode before session 16: through the tokenizer's Python `decode` (the spaces option is the
    Rust decode's behaviour either way: the default)."""
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


def time_detokenizers(tokenizer, ids: list[int], streams: int, steps: int, through) -> float:
    """Seconds to add `steps` tokens to each of `streams` detokenizers built with `through` as the
    window decoder factory."""
    original = detokenizer.window_decoder
    detokenizer.window_decoder = through
    try:
        detoks = [IncrementalDetokenizer(tokenizer) for _ in range(streams)]
    finally:
        detokenizer.window_decoder = original
    begin = time.perf_counter()
    for step in range(steps):
        for d in detoks:
            d.add([ids[step]])
    return time.perf_counter() - begin


def time_outputs(tokenizer, ids: list[int], streams: int, steps: int, prompt_tokens: int,
                 outputs_so_far: int = 0, deltas: bool = False) -> float:
    """Seconds of `make_output` for `streams` requests with `prompt_tokens`-token prompts that have
    generated `outputs_so_far` tokens already, one token appended to each per step (the engine's per-step
    output work, detokenisation included); `deltas`: `make_delta_output` instead (only what is new, a
    streamed response's outputs). Three untimed steps first: the detokenizers catch up with the tokens
    appended before (a first window over all of them)."""
    processor = OutputProcessor(tokenizer, eos_token_ids=(), max_model_len=1 << 30)
    params = SamplingParams(max_tokens=outputs_so_far + steps + 4, ignore_eos=True)
    prompt = [ids[i % len(ids)] for i in range(prompt_tokens)]
    requests = [Request(f"r{i}", f"r{i}", 0, prompt, (), params, 0.0, PrefixHasher(prompt, 16), None)
                for i in range(streams)]
    for r in requests:
        for position in range(outputs_so_far):
            processor.append_token(r, ids[position % len(ids)], None, 0.0)

    make = processor.make_delta_output if deltas else processor.make_output

    def step(position: int, kept: list) -> list:
        built = []
        for r in requests:
            processor.append_token(r, ids[position % len(ids)], None, 0.0)
            built.append(make(r.request_id, None, prompt, [], [r]))
        return built  # held until the next step's are built, as the server holds each prompt's latest

    kept: list = []
    for position in range(outputs_so_far, outputs_so_far + 3):
        kept = step(position, kept)
    begin = time.perf_counter()
    for position in range(outputs_so_far + 3, outputs_so_far + 3 + steps):
        kept = step(position, kept)
    return time.perf_counter() - begin


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--prompt-tokens", type=int, default=3700)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--outputs-so-far", type=int, nargs="+", default=[0],
                        help="tokens each stream has generated before the timed steps (one make_output row each)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="output_path_cost_cpu")
    args = parser.parse_args()

    from forkpoint import LLM

    tokenizer = LLM().get_tokenizer()
    rng = random.Random(0)
    needed = max(args.outputs_so_far) + args.steps + 3
    ids = tokenizer(" ".join(rng.choice(WORDS) for _ in range(4 * needed)))["input_ids"][:needed]
    outputs_key = {(so_far, deltas): ("make_delta_output" if deltas else "make_output")
                   + ("" if so_far == 0 else f"_after_{so_far}")
                   for so_far in args.outputs_so_far for deltas in (False, True)}
    runs = {"rust": [], "wrapper": [], **{key: [] for key in outputs_key.values()}}
    for _ in range(args.reps):
        runs["rust"].append(time_detokenizers(tokenizer, ids, args.streams, args.steps, detokenizer.window_decoder))
        runs["wrapper"].append(time_detokenizers(tokenizer, ids, args.streams, args.steps, wrapper_decoder))
        for (so_far, deltas), key in outputs_key.items():
            runs[key].append(time_outputs(tokenizer, ids, args.streams, args.steps, args.prompt_tokens, so_far,
                                          deltas))
    tokens = args.streams * args.steps
    rows = {name: {"us_per_token": 1e6 * statistics.median(seconds) / tokens,
                   "ms_per_step": 1e3 * statistics.median(seconds) / args.steps} for name, seconds in runs.items()}
    res = {"config": vars(args), "machine": machine_info(), "code": code_version(), "rows": rows}
    print(machine_line(res["machine"]))
    print(f"{args.streams} streams, {args.steps} tokens each, median of {args.reps}")
    print(f"{'what':<48} {'us/token':>9} {'ms/step':>8}")
    labels = {"rust": "detokenize, windows through the Rust tokenizer",
              "wrapper": "detokenize, through tokenizer.decode",
              **{key: f"{'make_delta_output' if deltas else 'make_output'} ({so_far} out)"
                 for (so_far, deltas), key in outputs_key.items()}}
    for name, row in rows.items():
        print(f"{labels[name]:<48} {row['us_per_token']:>9.2f} {row['ms_per_step']:>8.2f}")

    def plot(result: dict, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        names = list(result["rows"])
        ax.barh([labels[n] for n in names], [result["rows"][n]["ms_per_step"] for n in names])
        ax.set_xlabel(f"ms per decode step of {args.streams} streams")
        ax.set_title("engine thread output work per step (CPU)")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)

    print("results:", write_results(res, args.out, args.name, plot))


if __name__ == "__main__":
    main()
