"""Does the restore-versus-recompute rule (cache/reuse_rule.py) pick the faster way? CPU, embedded default model.

For each prefix length L (--lengths), one cycle on each of three engines, alternating, --repeats times:

1. a prompt of L random token ids plus a 16-token tail, with a checkpoint at L (max_tokens=1);
2. `registry.evict_all_idle()`: the checkpoint spills to the host tier (--host-mib), then an unrelated
   8-token prompt carries the spill (so the timed request does not);
3. timed: the same L tokens plus another tail (max_tokens=1, greedy), wall time of `LLM.generate`.

The engines differ only in the rule: `restore` (checkpoint_restore_rule=False: every hit restored, as
before the rule), `recompute` (a host restore cost of 1 s/byte given: every hit declined) and `rule`
(the costs the engine measured itself: --warmup cycles at L=64 first, on every engine). The table gives the
medians, which of restore and recompute was faster, what the rule chose (its request's cached tokens)
and its estimate (restore_s against recompute_s at its rates when it decided). The rule is right where
it chose the faster way, or where the two are within the spread of the repeats.

Usage:
    python bench/reuse_rule.py                     # writes bench/results/reuse_rule.{json,png}
    python bench/reuse_rule.py --lengths 1,16,256 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from host_info import VOCAB_LIMIT, code_version, machine_info, machine_line, probe_gflops  # noqa: E402
from plots import write_results  # noqa: E402

from forkpoint import LLM, SamplingParams  # noqa: E402
from forkpoint.cache.reuse_rates import MeasuredCost  # noqa: E402
from forkpoint.cache.reuse_rule import Tier, estimate  # noqa: E402

ONE = SamplingParams(temperature=0.0, max_tokens=1)
MODES = ("restore", "recompute", "rule")


def make_engine(mode: str, host_mib: int) -> LLM:
    llm = LLM(auto_checkpoints=False, checkpoint_host_bytes=host_mib << 20,
              checkpoint_restore_rule=mode != "restore")
    if mode == "recompute":  # (the bench sets the cost it stands for; the engine never measures a restore)
        llm.engine.registry.rates.host_restore = MeasuredCost(1.0, 1.0, decay=1.0)
    return llm


def cycle(llm: LLM, rng: random.Random, length: int) -> dict:
    """Steps 1-3 of the module docstring; the timed request's seconds, cached tokens and the rule's estimate."""
    ids = [rng.randrange(VOCAB_LIMIT) for _ in range(length + 32)]
    anchor = ids[:length]
    llm.generate({"prompt_token_ids": anchor + ids[length:length + 16], "checkpoint_positions": [length]}, ONE,
                 use_tqdm=False)
    registry = llm.engine.registry
    registry.evict_all_idle()
    llm.generate({"prompt_token_ids": [rng.randrange(VOCAB_LIMIT) for _ in range(8)]}, ONE, use_tqdm=False)
    host = registry.host
    num_bytes = host.slot_bytes + -(-length // llm.engine.config.block_size) * host.block_bytes
    verdict = estimate(registry.rates, Tier.HOST, num_bytes, length)
    start = time.perf_counter()
    out = llm.generate({"prompt_token_ids": anchor + ids[length + 16:]}, ONE, use_tqdm=False)[0]
    return {"seconds": time.perf_counter() - start, "cached": out.num_cached_tokens, "bytes": num_bytes,
            "estimate_restore_s": verdict.restore_s, "estimate_recompute_s": verdict.recompute_s}


def run(args: argparse.Namespace) -> dict:
    engines = {mode: make_engine(mode, args.host_mib) for mode in MODES}
    rng = random.Random(args.seed)
    for _ in range(args.warmup):
        for llm in engines.values():
            cycle(llm, rng, 64)
    rows = []
    for length in args.lengths:
        runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for _ in range(args.repeats):
            for mode, llm in engines.items():
                runs[mode].append(cycle(llm, rng, length))
        row = {"length": length, "bytes": runs["rule"][0]["bytes"]}
        for mode in MODES:
            seconds = [r["seconds"] for r in runs[mode]]
            row[f"{mode}_ms"] = 1e3 * statistics.median(seconds)
            row[f"{mode}_ms_range"] = [1e3 * min(seconds), 1e3 * max(seconds)]
            row[f"{mode}_cached"] = [r["cached"] for r in runs[mode]]
        row["faster"] = "restore" if row["restore_ms"] <= row["recompute_ms"] else "recompute"
        chose = {"restore" if c == length else "recompute" for c in row["rule_cached"]}
        row["rule_chose"] = "/".join(sorted(chose))
        row["rule_estimate_restore_ms"] = 1e3 * statistics.median(r["estimate_restore_s"] for r in runs["rule"])
        recompute = [r["estimate_recompute_s"] for r in runs["rule"] if r["estimate_recompute_s"] is not None]
        row["rule_estimate_recompute_ms"] = 1e3 * statistics.median(recompute) if recompute else None
        rows.append(row)
        print_row(row)
    return {"rows": rows, "rates": engines["rule"].engine.registry.rates.values(), "args": vars(args)}


def print_row(row: dict) -> None:
    estimate_recompute = row["rule_estimate_recompute_ms"]
    print(f"{row['length']:>6} {row['bytes'] / 1024:>9.0f} {row['restore_ms']:>10.2f} {row['recompute_ms']:>12.2f} "
          f"{row['faster']:>9} {row['rule_chose']:>17} {row['rule_ms']:>8.2f} {row['rule_estimate_restore_ms']:>10.3f} "
          f"{estimate_recompute if estimate_recompute is not None else float('nan'):>12.3f}")


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = res["rows"]
    lengths = [r["length"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, style in (("restore", "o-"), ("recompute", "s-"), ("rule", "x--")):
        ax.plot(lengths, [r[f"{mode}_ms"] for r in rows], style, label=f"{mode} (measured, median)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prefix tokens in the host tier (L)")
    ax.set_ylabel("request wall time, ms")
    commit = (res["machine"].get("commit") or "")[:8]
    ax.set_title(f"restore vs recompute, CPU default model ({commit})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--host-mib", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = machine_info({"gflops_probe": probe_gflops(), **code_version()})
    print(machine_line(machine))
    print(f"{'L':>6} {'KiB':>9} {'restore ms':>10} {'recompute ms':>12} {'faster':>9} {'rule chose':>17} "
          f"{'rule ms':>8} {'est rest ms':>10} {'est recomp ms':>12}")
    res = run(args)
    res["machine"] = {**machine, "load_average_end": list(os.getloadavg())}
    print("rule engine's measured costs:", {k: f"{v:.3g}" for k, v in res["rates"].items()})
    print("wrote", write_results(res, args.out, "reuse_rule", plot))


if __name__ == "__main__":
    main()
