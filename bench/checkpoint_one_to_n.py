"""CPU benchmark of prefix checkpoints on the 1-to-N workload (embedded default model).

One anchor of P random token ids, then N requests ``anchor + marker + suffix_i`` (S random ids each),
all submitted at once, max_tokens=1 greedy (scoring). Checkpoints ON: one request produces the
anchor's checkpoint and the other N-1 consume it, so the engine should compute P + N*S prompt
tokens. OFF (`enable_checkpoints=False`, same settings otherwise): the same prompts without the
marker, N*(P+S) tokens. Ideal ratio N(P+S)/(P+NS).

Both engines live in one process. Every (N, repeat) uses a fresh seeded anchor, so ON never finds
the checkpoint already cached; ON and OFF run the same prompts back to back, alternating which goes
first. The script drives `engine.add_request` / `engine.step` itself and records, for every request,
the time from its submission to the step that returned its first token (TTFT). "Consumers" are
requests 2..N (in ON they reuse the checkpoint: num_cached_tokens == P, checked); their TTFT p50 and
max are reported for ON and OFF. Prompt tokens computed come from `LLM.metrics()` deltas. Greedy
tokens of ON and OFF are compared for every request. A 1024^3 float32 matmul (GFLOP/s) is timed
before each pair as a load probe: the machine is shared, and its speed varies. Reported numbers are
medians over --repeats timed repeats, after untimed warm-up pairs (--warmup-ns).

Usage:
    python bench/checkpoint_one_to_n.py --threads 1      # writes bench/results/checkpoint_one_to_n.{json,png}
    python bench/checkpoint_one_to_n.py --ns 1 4 16 64 --repeats 5
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

from forkpoint import LLM, SamplingParams  # noqa: E402


class LmHeadTimer:
    """Accumulates wall time spent in the model's lm_head (forward hooks, no code change)."""

    def __init__(self, llm: LLM) -> None:
        self.total = 0.0
        self._t0 = 0.0
        lm_head = llm.engine.runner.model.lm_head
        self._hooks = [lm_head.register_forward_pre_hook(self._pre), lm_head.register_forward_hook(self._post)]

    def _pre(self, module, inputs) -> None:
        self._t0 = time.perf_counter()

    def _post(self, module, inputs, output) -> None:
        self.total += time.perf_counter() - self._t0


def run_workload(llm: LLM, lm_timer: LmHeadTimer, prompts: list[dict], params: SamplingParams, tag: str) -> dict:
    """Submit all prompts at once, step to completion; per-request TTFT from its own submission."""
    engine = llm.engine
    before = llm.metrics()
    lm_before = lm_timer.total
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    submitted: dict[str, float] = {}
    t0 = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(request_id, prompt, params)
        submitted[request_id] = time.perf_counter()
    first_token: dict[str, float] = {}
    finished: dict[str, object] = {}
    steps = 0
    while len(finished) < len(ids):
        outputs = engine.step()
        now = time.perf_counter()
        steps += 1
        for output in outputs:
            if output.request_id not in first_token and output.outputs[0].token_ids:
                first_token[output.request_id] = now
            if output.finished:
                finished[output.request_id] = output
    wall = time.perf_counter() - t0
    after = llm.metrics()
    outs = [finished[i] for i in ids]
    return {
        "wall_s": wall,
        "ttft_s": [first_token[i] - submitted[i] for i in ids],
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "prompt_token_ids_len": [len(o.prompt_token_ids) for o in outs],
        "num_cached_tokens": [o.num_cached_tokens for o in outs],
        "prompt_tokens_computed": after["prompt_tokens_computed"] - before["prompt_tokens_computed"],
        "prompt_tokens_total": after["prompt_tokens_total"] - before["prompt_tokens_total"],
        "checkpoint_hits": after["checkpoint_hits"] - before["checkpoint_hits"],
        "checkpoints_created": after["checkpoints_created"] - before["checkpoints_created"],
        "engine_steps": after["steps"] - before["steps"],
        "loop_iterations": steps,
        "lm_head_s": lm_timer.total - lm_before,
    }


def make_prompts(rng: random.Random, n: int, anchor_len: int, suffix_len: int, marker: int):
    anchor = [rng.randrange(VOCAB_LIMIT) for _ in range(anchor_len)]
    suffixes = [[rng.randrange(VOCAB_LIMIT) for _ in range(suffix_len)] for _ in range(n)]
    on = [{"prompt_token_ids": anchor + [marker] + s} for s in suffixes]
    off = [{"prompt_token_ids": anchor + s} for s in suffixes]
    return on, off


def summarize(n: int, p: int, s: int, runs: list[dict]) -> dict:
    def med(mode: str, key: str) -> float:
        return statistics.median(r[mode][key] for r in runs)

    def consumer_stat(mode: str, fn) -> float | None:
        if n < 2:
            return None
        return statistics.median(fn(r[mode]["ttft_s"][1:]) for r in runs)

    identical = sum(a == b for r in runs for a, b in zip(r["on"]["tokens"], r["off"]["tokens"]))
    wall_on, wall_off = med("on", "wall_s"), med("off", "wall_s")
    comp_on, comp_off = med("on", "prompt_tokens_computed"), med("off", "prompt_tokens_computed")
    return {
        "n": n,
        "computed_on": comp_on, "computed_off": comp_off,
        "expected_on": p + n * s, "expected_off": n * (p + s),
        "token_ratio": comp_off / comp_on,
        "ideal_ratio": n * (p + s) / (p + n * s),
        "wall_on_s": wall_on, "wall_off_s": wall_off,
        "speedup": wall_off / wall_on,
        "speedup_paired": statistics.median(r["off"]["wall_s"] / r["on"]["wall_s"] for r in runs),
        "speedup_runs": [r["off"]["wall_s"] / r["on"]["wall_s"] for r in runs],
        # the same ratio with each run's lm_head time taken out of both walls (median of the paired ratios)
        "speedup_excl_lm_head": statistics.median((r["off"]["wall_s"] - r["off"]["lm_head_s"])
                                                  / (r["on"]["wall_s"] - r["on"]["lm_head_s"]) for r in runs),
        "producer_ttft_on_s": statistics.median(r["on"]["ttft_s"][0] for r in runs),
        "producer_ttft_off_s": statistics.median(r["off"]["ttft_s"][0] for r in runs),
        "consumer_ttft_p50_on_s": consumer_stat("on", statistics.median),
        "consumer_ttft_p50_off_s": consumer_stat("off", statistics.median),
        "consumer_ttft_max_on_s": consumer_stat("on", max),
        "consumer_ttft_max_off_s": consumer_stat("off", max),
        "steps_on": med("on", "engine_steps"), "steps_off": med("off", "engine_steps"),
        "lm_head_on_s": med("on", "lm_head_s"), "lm_head_off_s": med("off", "lm_head_s"),
        "identical": identical, "compared": n * len(runs),
        "checkpoint_hits_on": med("on", "checkpoint_hits"),
        "probe_gflops": [r["probe_gflops"] for r in runs],
    }


def ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:,.0f}"


def print_table(result: dict) -> None:
    m, p, s = result["machine"], result["args"]["anchor_len"], result["args"]["suffix_len"]
    print("\n" + machine_line(m))
    print(f"P = {p}, S = {s}, max_tokens = {result['args']['max_tokens']}, medians of "
          f"{result['args']['repeats']} repeats; times in ms\n")
    print("| N | computed on | computed off | token ratio off/on | ideal N(P+S)/(P+NS) | wall on | wall off | "
          "speedup off/on | consumer TTFT p50 on / off | consumer TTFT max on / off | steps on / off | "
          "greedy tokens identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(f"| {row['n']} | {row['computed_on']:,.0f} | {row['computed_off']:,.0f} | {row['token_ratio']:.2f} | "
              f"{row['ideal_ratio']:.2f} | {ms(row['wall_on_s'])} | {ms(row['wall_off_s'])} | "
              f"{row['speedup']:.2f}x | {ms(row['consumer_ttft_p50_on_s'])} / {ms(row['consumer_ttft_p50_off_s'])} | "
              f"{ms(row['consumer_ttft_max_on_s'])} / {ms(row['consumer_ttft_max_off_s'])} | "
              f"{row['steps_on']:.0f} / {row['steps_off']:.0f} | {row['identical']}/{row['compared']} |")
    print("\nper-repeat speedups, lm_head time (median, ms), speedup with lm_head time taken out of both walls:")
    for row in result["rows"]:
        print(f"  N={row['n']:>3}: speedups " + ", ".join(f"{x:.2f}" for x in row["speedup_runs"])
              + f"; lm_head on {ms(row['lm_head_on_s'])} / off {ms(row['lm_head_off_s'])}"
              + f"; excl. lm_head {row['speedup_excl_lm_head']:.2f}x"
              + "; probe GFLOP/s " + ", ".join(f"{x:.0f}" for x in row["probe_gflops"]))


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    ns = [r["n"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    ax.plot(ns, [r["ideal_ratio"] for r in rows], color="0.6", lw=4, label="ideal N(P+S)/(P+NS)")
    ax.plot(ns, [r["token_ratio"] for r in rows], ls=":", marker="s", label="tokens computed off/on (measured)")
    ax.plot(ns, [r["speedup"] for r in rows], marker="^", label="wall speedup off/on (median)")
    for r in rows:
        ax.scatter([r["n"]] * len(r["speedup_runs"]), r["speedup_runs"], color="tab:orange", s=10, alpha=0.6)
    ax.plot(ns, [r["speedup_excl_lm_head"] for r in rows], ls="--", marker="v",
            label="wall speedup, lm_head time taken out of both")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("N (requests sharing the anchor)")
    ax.set_ylabel("ratio")
    ax.set_title(f"1-to-N, P={result['args']['anchor_len']}, S={result['args']['suffix_len']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)

    ax = axes[1]
    ax.plot(ns, [r["wall_on_s"] * 1e3 for r in rows], marker="o", label="wall, checkpoints on")
    ax.plot(ns, [r["wall_off_s"] * 1e3 for r in rows], marker="o", label="wall, checkpoints off")
    multi = [r for r in rows if r["n"] > 1]
    ax.plot([r["n"] for r in multi], [r["consumer_ttft_p50_on_s"] * 1e3 for r in multi], ls=":", marker="^",
            label="consumer TTFT p50, on")
    ax.plot([r["n"] for r in multi], [r["consumer_ttft_p50_off_s"] * 1e3 for r in multi], ls=":", marker="^",
            label="consumer TTFT p50, off")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_xlabel("N")
    ax.set_ylabel("ms (median of repeats)")
    ax.set_title("wall time and consumer latency")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, which="both")
    m = result["machine"]
    fig.suptitle(f"forkpoint prefix checkpoints, embedded default model, CPU: {m['cpu_model']}, "
                 f"{m['cpu_cores']} cores, torch {m['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--anchor-len", type=int, default=512, help="P")
    parser.add_argument("--suffix-len", type=int, default=32, help="S")
    parser.add_argument("--ns", type=int, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup-ns", type=int, nargs="*", default=[16],
                        help="N of the untimed on/off pairs run first (lazy initialisation, allocator warm-up)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice, one per core); on a shared machine "
                        "1 is far more stable, see docs/benchmarks_cpu.md")
    parser.add_argument("--max-tokens", type=int, default=1)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    machine = machine_info({"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "platform": platform.platform()})
    code = code_version()
    t0 = time.perf_counter()
    settings = dict(seed=args.seed, max_num_batched_tokens=args.max_num_batched_tokens)
    llm_on = LLM(enable_checkpoints=True, **settings)
    llm_off = LLM(enable_checkpoints=False, **settings)
    marker = llm_on.checkpoint_token_id
    print(f"engines built in {time.perf_counter() - t0:.1f} s; marker id {marker}", flush=True)
    timers = {"on": LmHeadTimer(llm_on), "off": LmHeadTimer(llm_off)}
    engines = {"on": llm_on, "off": llm_off}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    p, s = args.anchor_len, args.suffix_len

    runs: dict[int, list[dict]] = {n: [] for n in args.ns}
    schedule = [(-1, n) for n in args.warmup_ns] + [(rep, n) for rep in range(args.repeats) for n in args.ns]
    for index, (rep, n) in enumerate(tqdm(schedule, desc="1-to-N pairs (on + off)")):
        prompts_on, prompts_off = make_prompts(rng, n, p, s, marker)
        pair = {"repeat": rep, "probe_gflops": probe_gflops()}
        order = ("on", "off") if (rep + index) % 2 == 0 else ("off", "on")  # each N alternates across repeats
        for mode in order:
            prompts = prompts_on if mode == "on" else prompts_off
            pair[mode] = run_workload(engines[mode], timers[mode], prompts, params, f"{mode}-{rep}-{n}")
        pair["first"] = order[0]
        on, off = pair["on"], pair["off"]
        if on["prompt_token_ids_len"] != off["prompt_token_ids_len"] or on["prompt_tokens_total"] != n * (p + s):
            raise RuntimeError("ON and OFF prompts differ after marker removal")
        if n > 1 and (on["num_cached_tokens"][0] != 0 or any(c != p for c in on["num_cached_tokens"][1:])):
            raise RuntimeError(f"unexpected num_cached_tokens with checkpoints on: {on['num_cached_tokens']}")
        if rep >= 0:
            runs[n].append(pair)

    rows = [summarize(n, p, s, runs[n]) for n in args.ns]
    machine["load_average_end"] = list(os.getloadavg())
    result = {"benchmark": "checkpoint_one_to_n", "args": vars(args), "machine": machine, "code": code,
              "model": {"name": "embedded default (random Qwen3.5-MoE)", "layers": "3 GDN + 1 attention",
                        "hidden": llm_on.engine.model_config.hidden_size,
                        "vocab": llm_on.engine.model_config.vocab_size, "dtype": str(llm_on.engine.dtype)},
              "settings": settings, "rows": rows,
              "runs": {str(n): runs[n] for n in args.ns},
              "elapsed_s": time.perf_counter() - t0}
    print_table(result)
    json_path, png_path = out / "checkpoint_one_to_n.json", out / "checkpoint_one_to_n.png"
    json_path.write_text(json.dumps(result, indent=1))
    plot(result, png_path)
    print(f"\nwrote {json_path} and {png_path} ({result['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
