"""CPU benchmark of the engine foundation on the embedded default model.

Three measurements on one engine (`LLM(max_num_seqs=--sched-seqs)`; the embedded default is a random
Qwen3.5-MoE: 4 layers (3 GDN + 1 attention), hidden 256, 8 experts top-2, vocab 248320, float32 on CPU):

(a) prefill tokens/s: --prefill-prompts prompts of --prefill-len random token ids, max_tokens=1,
    greedy; wall time of `LLM.generate`, after --warmup untimed calls. Fresh prompts every call, so
    nothing is reused (checked: prompt_tokens_computed grows by the full prompt length).
(b) decode tokens/s: --decode-seqs sequences of --decode-prompt-len tokens, max_tokens=--decode-tokens,
    ignore_eos, greedy. The script drives `engine.step()` itself and classifies each step from the
    scheduler's plan: a *decode step* has only single-token decode segments. Decode tokens/s =
    tokens sampled in decode steps / wall time of those steps (the prefill step is excluded).
(c) host overhead per step with --sched-seqs running sequences: that many short requests are added
    and prefilled, then --sched-steps decode steps run (the forward still runs). Timed with
    time.perf_counter around the calls: `scheduler.schedule()`, `build_forward_batch` (the runner's
    host-side metadata), the model forward, `sample`, and the rest of `step()` (post-processing:
    `_make_output` and the freeing of the step's [R, vocab] logits separately, then the rest).
    Median and p99 in microseconds.

Timing is by wrapping (at run time, in this process only) `engine.scheduler.schedule`,
`engine._make_output`, `forkpoint.runner.model_runner.build_forward_batch`, `engine.runner.model`
and `forkpoint.engine.engine.sample`, plus forward hooks on `lm_head`; forkpoint's code is unchanged.
Every measurement is repeated (--repeats) and the median is reported: the machine is small and
other processes may share its CPUs. A 1024^3 float32 matmul (GFLOP/s) is timed before each run as
a load probe and reported with the results.

Usage:
    python bench/cpu_engine.py --threads 1     # writes bench/results/cpu_engine.{json,png}
    python bench/cpu_engine.py --repeats 9 --sched-steps 60
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import VOCAB_LIMIT, code_version, machine_info, machine_line, probe_gflops  # noqa: E402

import forkpoint.engine.engine as engine_module  # noqa: E402
import forkpoint.runner.model_runner as runner_module  # noqa: E402
from forkpoint import LLM, SamplingParams  # noqa: E402
from forkpoint.step.plan import SegmentKind  # noqa: E402

# ---------------------------------------------------------------- instrumentation

class StepProbe:
    """Times the parts of `LLMEngine.step()` by wrapping them; `records` gets one dict per non-empty
    step: seconds in schedule / build / forward / lm_head / sample / outputs (`_make_output`) /
    free_logits / rest (everything after sampling) / step, plus the plan's shape."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.records: list[dict] = []
        self._current: dict = {}
        self._saved = None
        self._logits = None

    def __enter__(self) -> StepProbe:
        engine = self.engine
        schedule, model = engine.scheduler.schedule, engine.runner.model
        build, sample = runner_module.build_forward_batch, engine_module.sample
        make_output = engine._make_output
        self._saved = (schedule, model, build, sample)
        cur = self

        def timed_schedule(*args, **kwargs):
            t0 = time.perf_counter()
            step = schedule(*args, **kwargs)
            cur._current["schedule"] = time.perf_counter() - t0
            cur._current["segments"] = len(step.plan.segments)
            cur._current["decodes"] = sum(1 for s in step.plan.segments if s.kind is SegmentKind.DECODE)
            cur._current["tokens"] = step.plan.num_tokens
            return step

        def timed(fn, key, add=False):
            """fn, with each call's seconds stored in this step's record under `key` (summed if `add`)."""
            def wrapper(*args, **kwargs):
                t0 = time.perf_counter()
                out = fn(*args, **kwargs)
                elapsed = time.perf_counter() - t0
                cur._current[key] = cur._current.get(key, 0.0) + elapsed if add else elapsed
                return out
            return wrapper

        timed_build, timed_sample = timed(build, "build"), timed(sample, "sample")
        timed_make_output = timed(make_output, "outputs", add=True)
        timed_forward = timed(model, "forward")

        def timed_model(*args, **kwargs):
            out = cur._logits = timed_forward(*args, **kwargs)  # freed (and timed) after step() returns, see step()
            return out

        def lm_pre(module, inputs):
            cur._current["_lm0"] = time.perf_counter()

        def lm_post(module, inputs, output):
            cur._current["lm_head"] = time.perf_counter() - cur._current.pop("_lm0")

        engine.scheduler.schedule = timed_schedule
        engine.runner.model = timed_model
        runner_module.build_forward_batch = timed_build
        engine_module.sample = timed_sample
        engine._make_output = timed_make_output
        lm_head = model.lm_head
        self._hooks = [lm_head.register_forward_pre_hook(lm_pre), lm_head.register_forward_hook(lm_post)]
        return self

    def __exit__(self, *exc) -> None:
        schedule, model, build, sample = self._saved
        del self.engine.scheduler.schedule  # back to the bound methods
        del self.engine._make_output
        self.engine.runner.model = model
        runner_module.build_forward_batch = build
        engine_module.sample = sample
        for hook in self._hooks:
            hook.remove()
        self._logits = None

    def step(self):
        """One engine step; returns (outputs, record or None when the plan was empty)."""
        self._current = {}
        t0 = time.perf_counter()
        outputs = self.engine.step()
        t1 = time.perf_counter()
        self._logits = None  # the step's logits [R, vocab] die here instead of at step()'s return
        elapsed = time.perf_counter() - t0
        if not self._current.get("segments"):
            return outputs, None
        record = dict(self._current, step=elapsed, free_logits=elapsed - (t1 - t0))
        record.setdefault("outputs", 0.0)
        record["rest"] = elapsed - sum(record.get(k, 0.0) for k in ("schedule", "build", "forward", "sample"))
        record["other"] = record["rest"] - record["outputs"] - record["free_logits"]
        record["is_decode"] = record["decodes"] == record["segments"]
        self.records.append(record)
        return outputs, record


def random_prompt(rng: random.Random, length: int) -> dict:
    return {"prompt_token_ids": [rng.randrange(VOCAB_LIMIT) for _ in range(length)]}


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


# ---------------------------------------------------------------- (a) prefill

def bench_prefill(llm: LLM, args, rng: random.Random) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=1)
    tokens = args.prefill_prompts * args.prefill_len
    runs = []
    bar = tqdm(total=args.warmup + args.repeats, desc="(a) prefill", leave=False)
    for i in range(args.warmup + args.repeats):
        prompts = [random_prompt(rng, args.prefill_len) for _ in range(args.prefill_prompts)]
        gflops = probe_gflops()
        before = llm.metrics()["prompt_tokens_computed"]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - t0
        computed = llm.metrics()["prompt_tokens_computed"] - before
        if computed != tokens:
            raise RuntimeError(f"prefill computed {computed} tokens, expected {tokens}")
        if i >= args.warmup:
            runs.append({"wall_s": wall, "tokens_per_s": tokens / wall, "probe_gflops": gflops})
        bar.update(1)
    bar.close()
    return {"prompts": args.prefill_prompts, "prompt_len": args.prefill_len, "tokens": tokens, "runs": runs,
            "median_wall_s": statistics.median(r["wall_s"] for r in runs),
            "median_tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs)}


# ---------------------------------------------------------------- (b) decode

def run_batch(llm: LLM, probe: StepProbe, prompts: list[dict], params: SamplingParams, tag: str) -> list[dict]:
    """Add `prompts` and step until all finish; returns this batch's step records."""
    engine = llm.engine
    first = len(probe.records)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
    pending = set(ids)
    while pending:
        outputs, _ = probe.step()
        for output in outputs:
            if output.finished:
                pending.discard(output.request_id)
    return probe.records[first:]


def bench_decode(llm: LLM, args, rng: random.Random) -> dict:
    params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    runs = []
    with StepProbe(llm) as probe:
        for r in tqdm(range(args.repeats + 1), desc="(b) decode", leave=False):
            prompts = [random_prompt(rng, args.decode_prompt_len) for _ in range(args.decode_seqs)]
            gflops = probe_gflops()
            records = run_batch(llm, probe, prompts, params, f"decode{r}")
            if r == 0:
                continue  # warm-up for this batch shape
            decode = [x for x in records if x["is_decode"]]
            tokens = sum(x["segments"] for x in decode)
            seconds = sum(x["step"] for x in decode)
            runs.append({
                "probe_gflops": gflops, "decode_steps": len(decode), "decode_tokens": tokens, "decode_s": seconds,
                "tokens_per_s": tokens / seconds,
                "total_s": sum(x["step"] for x in records),
                "median_step_ms": statistics.median(x["step"] for x in decode) * 1e3,
                "median_forward_ms": statistics.median(x["forward"] for x in decode) * 1e3,
                "median_lm_head_ms": statistics.median(x["lm_head"] for x in decode) * 1e3,
                "median_sample_ms": statistics.median(x["sample"] for x in decode) * 1e3,
                "median_host_ms": statistics.median(x["schedule"] + x["build"] + x["rest"] for x in decode) * 1e3,
            })
    keys = [k for k in runs[0] if k.startswith("median_")] + ["tokens_per_s"]
    return {"seqs": args.decode_seqs, "prompt_len": args.decode_prompt_len, "max_tokens": args.decode_tokens,
            "runs": runs, "median": {k: statistics.median(r[k] for r in runs) for k in keys}}


# ---------------------------------------------------------------- (c) scheduler / host overhead

def bench_host(llm: LLM, args, rng: random.Random) -> dict:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.sched_steps + 2, ignore_eos=True)
    ids = [f"host-{i}" for i in range(args.sched_seqs)]
    for request_id in ids:
        engine.add_request(request_id, random_prompt(rng, args.sched_prompt_len), params)
    records = []
    gflops_before = probe_gflops()
    with StepProbe(llm) as probe:
        bar = tqdm(total=args.sched_steps, desc=f"(c) {args.sched_seqs} running", leave=False)
        while len(records) < args.sched_steps:
            _, record = probe.step()
            if record is None or not record["is_decode"]:
                continue  # the prefill step(s)
            if record["segments"] != args.sched_seqs:
                raise RuntimeError(f"decode step ran {record['segments']} sequences, expected {args.sched_seqs}")
            records.append(record)
            bar.update(1)
        bar.close()
    for request_id in ids:
        engine.abort_request(request_id)
    summary = {}
    for key in ("schedule", "build", "rest", "outputs", "free_logits", "other", "sample", "forward", "lm_head",
                "step"):
        values = [x[key] * 1e6 for x in records]
        summary[key] = {"median_us": statistics.median(values), "p99_us": pct(values, 99),
                        "max_us": max(values), "min_us": min(values)}
    host = [(x["schedule"] + x["build"] + x["rest"]) * 1e6 for x in records]
    summary["host_total"] = {"median_us": statistics.median(host), "p99_us": pct(host, 99), "max_us": max(host),
                             "min_us": min(host)}
    return {"running": args.sched_seqs, "prompt_len": args.sched_prompt_len, "steps": len(records),
            "probe_gflops_before": gflops_before, "probe_gflops_after": probe_gflops(),
            "summary": summary, "schedule_us": [x["schedule"] * 1e6 for x in records],
            "build_us": [x["build"] * 1e6 for x in records], "rest_us": [x["rest"] * 1e6 for x in records],
            "outputs_us": [x["outputs"] * 1e6 for x in records],
            "free_logits_us": [x["free_logits"] * 1e6 for x in records],
            "step_ms": [x["step"] * 1e3 for x in records]}


# ---------------------------------------------------------------- report

def print_tables(result: dict) -> None:
    m, a, b, c = result["machine"], result["prefill"], result["decode"], result["host"]
    print("\n" + machine_line(m))
    print("\n| measurement | setting | result (median of runs) | runs |")
    print("|---|---|---|---|")
    print(f"| (a) prefill | {a['prompts']} x {a['prompt_len']} tokens, max_tokens=1 | "
          f"{a['median_tokens_per_s']:,.0f} tokens/s ({a['median_wall_s'] * 1e3:.0f} ms per generate) | "
          + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in a["runs"]) + " |")
    md = b["median"]
    probes = [r["probe_gflops"] for r in a["runs"]] + [r["probe_gflops"] for r in b["runs"]]
    print(f"| (b) decode | {b['seqs']} seqs, prompt {b['prompt_len']}, max_tokens={b['max_tokens']}, ignore_eos | "
          f"{md['tokens_per_s']:,.0f} tokens/s (step {md['median_step_ms']:.1f} ms: forward "
          f"{md['median_forward_ms']:.1f} of which lm_head {md['median_lm_head_ms']:.1f}, sample "
          f"{md['median_sample_ms']:.1f}, host {md['median_host_ms']:.2f}) | "
          + ", ".join(f"{r['tokens_per_s']:,.0f}" for r in b["runs"]) + " |")
    print("\nload probe (1024^3 fp32 matmul) before each run, GFLOP/s: (a)+(b) "
          + ", ".join(f"{x:.0f}" for x in probes)
          + f"; (c) {c['probe_gflops_before']:.0f} before, {c['probe_gflops_after']:.0f} after")
    print(f"\n(c) per decode step with {c['running']} running sequences, {c['steps']} steps (microseconds)")
    print("\n| part | median | p99 | max |")
    print("|---|---|---|---|")
    names = {
        "schedule": "scheduler.schedule()",
        "build": "build_forward_batch (runner, host)",
        "rest": "rest of step() (post-processing)",
        "outputs": "... of which _make_output (RequestOutputs)",
        "free_logits": "... of which freeing the step's logits tensor",
        "other": "... of which the rest (token append, counters)",
        "host_total": "host total (schedule + build + rest)",
        "sample": "sample (argmax over vocab)",
        "lm_head": "lm_head (in forward)",
        "forward": "model forward",
        "step": "whole step",
    }
    for key, label in names.items():
        s = c["summary"][key]
        print(f"| {label} | {s['median_us']:,.0f} | {s['p99_us']:,.0f} | {s['max_us']:,.0f} |")
    verdict = "meets" if c["summary"]["schedule"]["p99_us"] < 2000 else "misses"
    print(f"\nscheduler p99 {c['summary']['schedule']['p99_us']:,.0f} us {verdict} the 2 ms target")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    a, b, c = result["prefill"], result["decode"], result["host"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    ax = axes[0]
    labels = ["prefill", "decode"]
    medians = [a["median_tokens_per_s"], b["median"]["tokens_per_s"]]
    ax.bar(labels, medians, color=["tab:blue", "tab:orange"], alpha=0.7)
    for i, runs in enumerate([[r["tokens_per_s"] for r in a["runs"]], [r["tokens_per_s"] for r in b["runs"]]]):
        ax.scatter([i] * len(runs), runs, color="k", s=12, zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel("tokens/s (bar: median, dots: runs)")
    ax.set_title(f"(a) {a['prompts']}x{a['prompt_len']} prefill, (b) {b['seqs']}-seq decode")

    ax = axes[1]
    md, cs = b["median"], c["summary"]
    names = ["lm_head", "rest of forward", "sample", "host (schedule + build + post-processing)"]
    small = [md["median_lm_head_ms"], md["median_forward_ms"] - md["median_lm_head_ms"], md["median_sample_ms"],
             md["median_host_ms"]]
    large = [cs["lm_head"]["median_us"] / 1e3, (cs["forward"]["median_us"] - cs["lm_head"]["median_us"]) / 1e3,
             cs["sample"]["median_us"] / 1e3, cs["host_total"]["median_us"] / 1e3]
    bars = [f"(b) {b['seqs']} seqs", f"(c) {c['running']} seqs"]
    bottoms = [0.0, 0.0]
    for name, v_small, v_large in zip(names, small, large):
        ax.bar(bars, [v_small, v_large], bottom=bottoms, label=f"{name}: {v_small:.1f} / {v_large:.1f} ms")
        bottoms = [bottoms[0] + v_small, bottoms[1] + v_large]
    ax.set_ylabel("ms per decode step (medians)")
    ax.legend(fontsize=7)
    ax.set_title("decode step breakdown")

    ax = axes[2]
    for key, label in (("schedule_us", "scheduler.schedule()"), ("build_us", "build_forward_batch"),
                       ("outputs_us", "_make_output"), ("free_logits_us", "freeing the logits"),
                       ("rest_us", "rest of step() (all post-processing)")):
        values = sorted(c[key])
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.axvline(2000, color="r", ls="--", lw=1, label="2 ms target (scheduler)")
    ax.set_xscale("log")
    ax.set_xlabel("microseconds per decode step")
    ax.set_ylabel("CDF")
    ax.set_title(f"(c) host time per step, {c['running']} running")
    ax.legend(fontsize=7, loc="lower right")
    m = result["machine"]
    fig.suptitle(f"forkpoint CPU engine, embedded default model; {m['cpu_model']}, {m['cpu_cores']} cores, "
                 f"torch {m['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of (a) and (b); median reported")
    parser.add_argument("--warmup", type=int, default=4, help="untimed prefill calls first (allocator warm-up)")
    parser.add_argument("--prefill-prompts", type=int, default=8)
    parser.add_argument("--prefill-len", type=int, default=512)
    parser.add_argument("--decode-seqs", type=int, default=16)
    parser.add_argument("--decode-prompt-len", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--sched-seqs", type=int, default=256)
    parser.add_argument("--sched-prompt-len", type=int, default=16)
    parser.add_argument("--sched-steps", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice, one per core); on a shared machine "
                        "1 is far more stable, see docs/benchmarks_cpu.md")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    machine = machine_info({"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "platform": platform.platform()})
    code = code_version()
    t0 = time.perf_counter()
    # enough KV blocks and state slots for --sched-seqs short sequences (the defaults already are)
    blocks = args.sched_seqs * -(-(args.sched_prompt_len + args.sched_steps + 2) // 16) + 4096
    llm = LLM(seed=args.seed, max_num_seqs=args.sched_seqs, num_kv_blocks=blocks)
    print(f"engine built in {time.perf_counter() - t0:.1f} s; kv blocks {llm.metrics()['kv_blocks_total']}, "
          f"state slots {llm.metrics()['state_slots_total']}", flush=True)
    result = {"benchmark": "cpu_engine", "args": vars(args), "machine": machine, "code": code,
              "model": {"name": "embedded default (random Qwen3.5-MoE)", "layers": "3 GDN + 1 attention",
                        "hidden": llm.engine.model_config.hidden_size,
                        "experts": llm.engine.model_config.num_experts,
                        "top_k": llm.engine.model_config.num_experts_per_tok,
                        "vocab": llm.engine.model_config.vocab_size, "dtype": str(llm.engine.dtype)}}
    result["prefill"] = bench_prefill(llm, args, rng)
    print(f"(a) prefill {result['prefill']['median_tokens_per_s']:,.0f} tokens/s", flush=True)
    result["decode"] = bench_decode(llm, args, rng)
    print(f"(b) decode {result['decode']['median']['tokens_per_s']:,.0f} tokens/s", flush=True)
    result["host"] = bench_host(llm, args, rng)
    result["machine"]["load_average_end"] = list(os.getloadavg())
    result["elapsed_s"] = time.perf_counter() - t0
    print_tables(result)
    json_path, png_path = out / "cpu_engine.json", out / "cpu_engine.png"
    json_path.write_text(json.dumps(result, indent=1))
    plot(result, png_path)
    print(f"\nwrote {json_path} and {png_path} ({result['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
