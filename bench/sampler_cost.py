"""What sampling a step's rows costs on this machine: `Sampler.sample` (runner/sampler.py) over a
248,320-token vocabulary for 1, 16 and 128 rows, per kind of request, and the primitives it is built of.

Cases (every row of a call alike): greedy; temperature 0.8 (no generator: the default one); the same
seeded (one torch.Generator per row, as `seed` gives); top-k 50; top-p 0.9; min-p 0.05; penalties
(frequency 0.5, repetition 1.1, temperature 0.8, state kept across calls as in decoding). Logits are
Zipf-like (logit = -1.2 ln(rank), ranks shuffled per row, plus N(0, 0.1) noise) or `--logits normal`
(N(0, 3^2): a flat tail, the widest top-p sets). Each call is timed --reps times after one warm-up; the
table gives the median ms per call and per row. Then the primitives' ms per call on the same rows
(where the time goes): softmax, exponential_ over the vocabulary, a full sort, topk 50, cumsum,
argmax, an elementwise division.

With --baseline FILE (another version's runner/sampler.py, loaded beside this tree's modules) each
call of this tree's sampler alternates with one of the baseline's on the same rows, so both see the
same load on a shared machine; the table adds the baseline's ms and the ratio.

Usage:
    python bench/sampler_cost.py                          # writes bench/results/sampler_cost_cpu.json/.png
    python bench/sampler_cost.py --rows 128 --reps 3 --name sampler_cost_cpu_128
    git archive 86c77c3 forkpoint/runner/sampler.py | tar -x -C /tmp/old
    python bench/sampler_cost.py --baseline /tmp/old/forkpoint/runner/sampler.py --name sampler_cost_cpu_vs_86c77c3
    python bench/sampler_cost.py --rows 128 --cases temperature --chunk-mib 4 --no-primitives --name chunk_4mib
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from host_info import code_version, machine_info, machine_line  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint.runner import random_draw  # noqa: E402
from forkpoint.runner.sampler import Sampler  # noqa: E402
from forkpoint.sampling_params import SamplingParams  # noqa: E402

VOCAB = 248_320
CASES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "temperature_seeded": SamplingParams(temperature=0.8, seed=1),
    "top_k_50": SamplingParams(temperature=0.8, top_k=50),
    "top_p_0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "min_p_0.05": SamplingParams(temperature=0.8, min_p=0.05),
    "penalties": SamplingParams(temperature=0.8, frequency_penalty=0.5, repetition_penalty=1.1),
}


def make_logits(rows: int, kind: str, generator: torch.Generator) -> torch.Tensor:
    """[rows, VOCAB] float32 logits of the chosen shape."""
    if kind == "normal":
        return torch.randn(rows, VOCAB, generator=generator) * 3.0
    ranks = torch.arange(1, VOCAB + 1, dtype=torch.float32)
    base = -1.2 * ranks.log()
    order = torch.stack([torch.randperm(VOCAB, generator=generator) for _ in range(rows)])
    return base[order] + 0.1 * torch.randn(rows, VOCAB, generator=generator)


class Timed:
    """One sampler implementation (`module`: runner/sampler.py or a baseline's copy) sampling the same
    rows call after call; penalty state (and each row's output history) carried from call to call."""

    def __init__(self, module, params: SamplingParams, rows: int) -> None:
        self.module, self.params = module, params
        self.sampler = module.Sampler(VOCAB, torch.device("cpu"))
        self.generators = [torch.Generator().manual_seed(i) if params.seed is not None else None
                           for i in range(rows)]
        self.outputs: list[list[int]] = [[] for _ in range(rows)]
        self.times: list[float] = []

    def call(self, logits: torch.Tensor, record: bool) -> None:
        prompt = list(range(100, 164))
        rows = [self.module.SamplingRow(f"r{i}", self.params, self.generators[i], prompt, list(self.outputs[i]))
                for i in range(logits.shape[0])]
        begin = time.perf_counter()
        out = self.sampler.sample(logits, rows)
        if record:
            self.times.append(time.perf_counter() - begin)
        for i, token in enumerate(out):
            self.outputs[i].append(token.token_id)


def time_case(params: SamplingParams, logits: torch.Tensor, reps: int, baseline) -> tuple[list[float], list[float]]:
    """Seconds per `Sampler.sample` call on `logits` (reps calls after a warm-up), this tree's and,
    alternating with it, the baseline module's (empty without one)."""
    ours = Timed(sys.modules[Sampler.__module__], params, logits.shape[0])
    theirs = Timed(baseline, params, logits.shape[0]) if baseline is not None else None
    for rep in range(reps + 1):
        ours.call(logits, record=rep > 0)
        if theirs is not None:
            theirs.call(logits, record=rep > 0)
    return ours.times, theirs.times if theirs is not None else []


def load_baseline(path: str):
    """Another version's runner/sampler.py as a module of its own (its imports resolve to this tree)."""
    spec = importlib.util.spec_from_file_location("baseline_sampler", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def primitives(logits: torch.Tensor, reps: int) -> dict[str, float]:
    """Median ms per call of the operations a sampler is made of, on `logits` [R, V]."""
    other = torch.rand_like(logits) + 0.5
    ops = {
        "softmax": lambda: torch.softmax(logits, dim=-1),
        "exponential_": lambda: torch.empty_like(logits).exponential_(),
        "sort": lambda: logits.sort(dim=-1),
        "topk_50": lambda: logits.topk(50, dim=-1),
        "cumsum": lambda: logits.cumsum(dim=-1),
        "argmax": lambda: logits.argmax(dim=-1),
        "divide": lambda: logits / other,
    }
    out = {}
    for name, op in ops.items():
        op()
        times = []
        for _ in range(max(1, reps if name != "sort" else 1)):
            begin = time.perf_counter()
            op()
            times.append(time.perf_counter() - begin)
        out[name] = 1000 * statistics.median(times)
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for n, case in enumerate(CASES):
        points = [r for r in res["rows"] if r["case"] == case]
        colour = colours[n % len(colours)]
        ax.plot([p["rows"] for p in points], [p["ms_per_call"] for p in points], marker="o", color=colour,
                label=case)
        if any("baseline_ms_per_call" in p for p in points):
            ax.plot([p["rows"] for p in points], [p["baseline_ms_per_call"] for p in points], marker="x",
                    linestyle="--", color=colour)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("rows sampled in one call")
    ax.set_ylabel("ms per call (median)")
    baseline = ", dashed: --baseline" if res.get("baseline") else ""
    ax.set_title(f"Sampler.sample, vocabulary {VOCAB:,}, {res['logits']} logits, "
                 f"{str(res['code']['commit'])[:7]}{baseline}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 128])
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--logits", choices=["zipf", "normal"], default="zipf")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-primitives", action="store_true")
    parser.add_argument("--baseline", help="another version's runner/sampler.py, timed alternately")
    parser.add_argument("--chunk-mib", type=float, help="CPU chunk of rows sampled together, MiB of logits "
                        "(runner/random_draw.py's CHUNK_BYTES; default: its value)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--name", default="sampler_cost_cpu")
    args = parser.parse_args()
    machine = machine_info()
    print(machine_line(machine))
    generator = torch.Generator().manual_seed(0)
    baseline = load_baseline(args.baseline) if args.baseline else None
    if args.chunk_mib is not None:
        random_draw.CHUNK_BYTES = int(args.chunk_mib * (1 << 20))
    results, prims = [], {}
    print(f"{'case':<20} {'rows':>5} {'ms/call':>9} {'ms/row':>8} {'min':>8} {'max':>8}"
          + (f" {'baseline':>9} {'min':>8} {'ratio':>7}" if baseline else ""))
    for rows in args.rows:
        logits = make_logits(rows, args.logits, generator)
        for case in args.cases:
            times, base = time_case(CASES[case], logits, args.reps, baseline)
            median = 1000 * statistics.median(times)
            row = {"case": case, "rows": rows, "ms_per_call": median, "ms_per_row": median / rows,
                   "ms_min": 1000 * min(times), "ms_max": 1000 * max(times)}
            line = (f"{case:<20} {rows:>5} {median:>9.2f} {median / rows:>8.3f} {1000 * min(times):>8.2f} "
                    f"{1000 * max(times):>8.2f}")
            if base:
                row.update(baseline_ms_per_call=1000 * statistics.median(base), baseline_ms_min=1000 * min(base))
                line += (f" {row['baseline_ms_per_call']:>9.2f} {row['baseline_ms_min']:>8.2f} "
                         f"{row['baseline_ms_per_call'] / median:>6.1f}x")
            results.append(row)
            print(line)
        if not args.no_primitives:
            prims[rows] = primitives(logits, args.reps)
    if prims:
        names = list(next(iter(prims.values())))
        print("\nprimitives, ms per call on the same logits\n" + f"{'rows':>5} " + " ".join(f"{n:>13}" for n in names))
        for rows, values in prims.items():
            print(f"{rows:>5} " + " ".join(f"{values[n]:>13.2f}" for n in names))
    res = {"vocab": VOCAB, "logits": args.logits, "reps": args.reps, "machine": machine, "code": code_version(),
           "torch_threads": torch.get_num_threads(), "baseline": args.baseline,
           "chunk_bytes": random_draw.CHUNK_BYTES, "rows": results, "primitives_ms": prims}
    print("wrote", write_results(res, args.out, args.name, plot))


if __name__ == "__main__":
    main()
