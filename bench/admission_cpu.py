"""CPU benchmark of request admission: the host time of `add_request` for a 1-to-N burst.

The H200 rows of bench/e2e_gpu.py showed that a burst's wall time minus the sum of its steps is the
same with checkpoints on and off (0.65 s for 256 prompts of 4,353 ids at Qwen3.5-35B-A3B and
Nemotron-3-Nano shapes: docs/e2e_h200.md, session 5). That time is admission, which the model does
not change: validating the ids, stripping the marker, hashing every 16-token block of the prompt and
looking its prefix up. This script times exactly that on a tiny random Qwen3.5-MoE (its model size
does not enter): per N, `add_request` of N prompts of P ids + marker + S ids (one shared anchor),
the fastest of --repeats bursts (each aborted after timing), in seconds and microseconds per prompt
token, split by wrapping (in this process only) the input processor, its hasher cache's `build` (the
block hash chain; packing the ids is part of processing) and the scheduler's `add`.

Usage:
    python bench/admission_cpu.py                 # writes bench/results/admission_cpu.{json,png}
    python bench/admission_cpu.py --n 64 256 --p 4096 --s 256
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import stacked_bars  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

PARTS = ("process", "hash", "schedule")


class PartTimer:
    """Wraps `obj.name` so that its calls' wall time adds up under `part` (undone by `restore`)."""

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, obj, name: str, part: str) -> None:
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        self._undo.append((obj, name, original))
        setattr(obj, name, timed)

    def restore(self) -> None:
        for obj, name, original in reversed(self._undo):
            setattr(obj, name, original)
        self._undo.clear()


def burst(llm: LLM, n: int, args, rng: np.random.Generator, tag: str) -> dict:
    """Seconds of `add_request` for one burst of n prompts, and its parts; the requests are aborted."""
    engine = llm.engine
    vocab = min(args.vocab_limit, llm.checkpoint_token_id)
    anchor = rng.integers(0, vocab, args.p).tolist() + [llm.checkpoint_token_id]
    prompts = [anchor + rng.integers(0, vocab, args.s).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=1)
    timer = PartTimer()
    timer.wrap(engine.inputs, "process", "process")
    timer.wrap(engine.inputs.hashers, "build", "hash")
    timer.wrap(engine.scheduler, "add", "schedule")
    start = time.perf_counter()
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": prompt}, params, stream=False)
        total = time.perf_counter() - start
    finally:
        timer.restore()
    for i in range(n):
        engine.abort_request(f"{tag}-{i}")
    engine.check_integrity()
    # the hasher runs inside process(): report process without it
    return {"total_s": total, "process_s": timer.seconds["process"] - timer.seconds["hash"],
            "hash_s": timer.seconds["hash"], "schedule_s": timer.seconds["schedule"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, nargs="+", default=[16, 64, 256], help="prompts per burst")
    parser.add_argument("--p", type=int, default=4096, help="anchor ids before the marker")
    parser.add_argument("--s", type=int, default=256, help="suffix ids after it")
    parser.add_argument("--repeats", type=int, default=3, help="bursts per N; the fastest is reported")
    parser.add_argument("--vocab-limit", type=int, default=200, help="ids drawn below this (and the marker)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="admission_cpu")
    args = parser.parse_args()
    machine = machine_info({"p": args.p, "s": args.s})
    print(machine_line(machine))
    rng = np.random.default_rng(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "moe"
        model_dir.mkdir()
        build_tiny_model(model_dir, "qwen3_5_moe_text")
        blocks = -(-max(args.n) * (args.p + args.s + 1) // 16) + 64
        llm = LLM(str(model_dir), device="cpu", max_model_len=args.p + args.s + 64, num_kv_blocks=blocks,
                  max_num_seqs=max(args.n), num_state_slots=max(args.n))
        for n in args.n:
            runs = [burst(llm, n, args, rng, f"n{n}-{r}") for r in range(args.repeats)]
            best = min(runs, key=lambda r: r["total_s"])
            tokens = n * (args.p + args.s + 1)
            rows.append({"n": n, "prompt_ids": tokens, **best, "us_per_token": 1e6 * best["total_s"] / tokens})
    print(f"{'N':>5} {'prompt ids':>11} {'add_request s':>14} {'us/token':>9} " +
          " ".join(f"{p + ' s':>11}" for p in PARTS))
    for row in rows:
        print(f"{row['n']:>5} {row['prompt_ids']:>11,} {row['total_s']:>14.3f} {row['us_per_token']:>9.2f} " +
              " ".join(f"{row[p + '_s']:>11.3f}" for p in PARTS))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "code": code_version(), "params": vars(args), "rows": rows}
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / f"{args.name}.png", machine, args)
    print(f"wrote {out / args.name}.json and .png")


def plot(rows: list[dict], path: Path, machine: dict, args) -> None:
    stacked_bars(path, [f"N={r['n']}" for r in rows], {part: [r[f"{part}_s"] for r in rows] for part in PARTS},
                 "seconds of add_request per burst",
                 f"admission of N prompts of {args.p} + 1 + {args.s} ids, CPU ({machine['cpu_cores']} cores)",
                 size=(7, 4))


if __name__ == "__main__":
    main()
