"""CPU benchmark of the engine's host work per decode step, with and without asynchronous scheduling.

On the CPU the forward is the device work, so nothing overlaps here: what this measures is the host
time around the forward that asynchronous scheduling moves off the device's critical path on a GPU
(there a decode step takes about max(kernels, host work) instead of kernels + the host work that
waits for them). Per mode (`async_scheduling` off / on) and per batch size N: N greedy sequences of
a tiny random Qwen3.5-MoE (tests/tiny_models.py: 4 layers, hidden 64, vocab 160, float32) decode
--steps steady decode steps after --warmup steps; each `engine.step()` is timed, and the parts by
wrapping (in this process only) `scheduler.schedule` / `schedule_ahead`, `runner.prepare` (the
step's metadata), the model's forward, and `sampler.sample_async` (the sampler's enqueue). "host"
is the step's wall time minus the forward; "other" is the host time outside the wrapped parts
(commit, token bookkeeping, stop rules, outputs). Medians over the steps, then over --repeats runs.
`--stream` reports every step's progress (the server's mode: per-step detokenisation), else outputs
come only at the end (the offline API's mode).

Usage:
    python bench/async_scheduling_cpu.py                  # writes bench/results/async_scheduling_cpu.{json,png}
    python bench/async_scheduling_cpu.py --seqs 1 16 64 --steps 200 --stream
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import stacked_bars  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402
from tests.tiny_models import build_tiny_model  # noqa: E402

PARTS = ("schedule", "prepare", "forward", "sample")


class Probe:
    """Times the parts of each `engine.step()` by shadowing bound methods with instance attributes."""

    def __init__(self, llm: LLM) -> None:
        engine = self.engine = llm.engine
        self.current: dict[str, float] = {}
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine.scheduler, "schedule_ahead", "schedule")
        self._wrap(engine.runner, "prepare", "prepare")
        self._wrap(engine.runner.sampling.sampler, "sample_async", "sample")
        model = engine.runner.model
        self._model = model

        def forward(*args, **kwargs):
            start = time.perf_counter()
            out = model(*args, **kwargs)
            self.current["forward"] = self.current.get("forward", 0.0) + time.perf_counter() - start
            return out

        engine.runner.model = forward

    def _wrap(self, owner, name: str, part: str) -> None:
        method = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = method(*args, **kwargs)
            self.current[part] = self.current.get(part, 0.0) + time.perf_counter() - start
            return out

        setattr(owner, name, timed)

    def step(self) -> dict[str, float]:
        self.current = {}
        start = time.perf_counter()
        self.engine.step()
        record = dict(self.current, step=time.perf_counter() - start)
        record["host"] = record["step"] - record.get("forward", 0.0)
        record["other"] = record["host"] - sum(record.get(p, 0.0) for p in PARTS if p != "forward")
        return record


def run(model_dir: Path, async_scheduling: bool, seqs: int, args) -> dict[str, float]:
    llm = LLM(str(model_dir), async_scheduling=async_scheduling, enable_checkpoints=False, max_num_seqs=max(seqs, 1),
              num_kv_blocks=seqs * (-(-(16 + args.warmup + args.steps + 8) // 16)) + 8)
    params = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 4, ignore_eos=True)
    generator = torch.Generator().manual_seed(seqs)
    for i in range(seqs):
        prompt = torch.randint(5, 150, (16,), generator=generator).tolist()
        llm.engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, params, stream=args.stream)
    probe = Probe(llm)
    for _ in range(args.warmup):  # the prefill and the first decodes
        probe.step()
    records = [probe.step() for _ in range(args.steps)]
    for i in range(seqs):
        llm.engine.abort_request(f"r{i}")
    llm.engine.check_integrity()
    keys = ("step", "host", "other") + PARTS
    return {key: statistics.median(r.get(key, 0.0) for r in records) for key in keys}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seqs", type=int, nargs="+", default=[1, 16, 64], help="sequences decoding together")
    parser.add_argument("--steps", type=int, default=150, help="timed decode steps per run")
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps first (prefill included)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--stream", action="store_true", help="per-step outputs (the server's mode)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="async_scheduling_cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info({"stream": args.stream})
    print(machine_line(machine))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "moe"
        model_dir.mkdir()
        build_tiny_model(model_dir, "qwen3_5_moe_text")
        for seqs in args.seqs:
            for mode in (False, True):
                runs = [run(model_dir, mode, seqs, args) for _ in range(args.repeats)]
                row = {"seqs": seqs, "async_scheduling": mode,
                       **{f"{k}_us": 1e6 * statistics.median(r[k] for r in runs) for k in runs[0]}}
                rows.append(row)
    header = f"{'N':>4} {'async':>5} {'step us':>9} {'host us':>9} " + " ".join(f"{p + ' us':>11}" for p in
                                                                              PARTS + ("other",))
    print(header)
    for row in rows:
        print(f"{row['seqs']:>4} {'on' if row['async_scheduling'] else 'off':>5} {row['step_us']:>9.0f} "
              f"{row['host_us']:>9.0f} " + " ".join(f"{row[p + '_us']:>11.0f}" for p in PARTS + ("other",)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"machine": machine, "code": code_version(), "params": vars(args), "rows": rows}
    (out / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / f"{args.name}.png", machine)
    print(f"wrote {out / args.name}.json and .png")


def plot(rows: list[dict], path: Path, machine: dict) -> None:
    parts = ("schedule", "prepare", "sample", "other")
    labels = [f"N={r['seqs']}\n{'async' if r['async_scheduling'] else 'sync'}" for r in rows]
    stacked_bars(path, labels, {part: [r[f"{part}_us"] for r in rows] for part in parts},
                 "host us per decode step (forward excluded)",
                 f"engine host work per decode step, tiny model, CPU ({machine['cpu_cores']} cores)")


if __name__ == "__main__":
    main()
