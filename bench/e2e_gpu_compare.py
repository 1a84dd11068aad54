"""Side by side: `e2e_gpu.py` results of one baseline (35B bf16) and others (35B FP8, 80B FP8), as
markdown tables of each one's values and its ratio to the baseline.

    python bench/e2e_gpu_compare.py BASE.json OTHER.json [OTHER.json ...]   # prints the tables

Rows are matched by (group, shape, N, max_tokens, engine, checkpoints): requests/s, TTFT p50 and TPOT
p50 of each run; then full-step prefill tokens/s (the default engine's steps of exactly
max_num_batched_tokens prompt tokens, median), the engine's start-up (its phases, weights loaded),
weight bytes and peak GPU memory. For a result of the baseline's architecture (the same config but
its `quantization_config`), issue 28's targets are judged: decode TPOT at batch 64 at most 0.7x the
baseline's, full-step prefill at least 1.3x its tokens/s. A file that is missing or unreadable (its
run stopped before writing) is named, not fatal: without the baseline the others' values still print.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TPOT_TARGET = 0.7      # issue 28: FP8 decode TPOT at batch 64 <= 0.7x bf16
PREFILL_TARGET = 1.3   # issue 28: FP8 full-step prefill tokens/s >= 1.3x bf16
TARGET_BATCH = 64


def load(path: str | Path) -> tuple[dict | None, str | None]:
    """(results, None), or (None, why not) for a missing or unreadable file."""
    try:
        return json.loads(Path(path).read_text()), None
    except (OSError, json.JSONDecodeError) as err:
        return None, f"{path}: {err}"


def _key(run: dict) -> tuple:
    return (run["group"], run["shape"], run["N"], run["max_tokens"], run["engine"], run["checkpoints"])


def runs_by_key(results: dict) -> dict[tuple, dict]:
    """The last run of each key (a row measured twice keeps its later run)."""
    return {_key(run): run for run in results.get("runs", [])}


def same_architecture(a: dict, b: dict) -> bool:
    """Whether two results' configs differ at most in their quantization_config."""
    strip = ({k: v for k, v in r.get("config", {}).items() if k != "quantization_config"} for r in (a, b))
    return next(strip) == next(strip)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or not base else value / base


def _label(results: dict) -> str:
    return results.get("model", results.get("shape", "?"))


def run_table(base: dict, others: list[dict]) -> list[str]:
    """Per matched run: each result's req/s, TTFT p50, TPOT p50, and the others' ratios to the baseline."""
    head = "| row | N | max_tokens | ckpt | metric | baseline |"
    rule = "|---|---|---|---|---|---|"
    for i, _ in enumerate(others, 1):
        head += f" #{i} | #{i} / baseline |"
        rule += "---|---|"
    lines = [head, rule]
    base_runs = runs_by_key(base)
    other_runs = [runs_by_key(o) for o in others]
    keys = list(dict.fromkeys([*base_runs, *(k for runs in other_runs for k in runs)]))  # first-seen order
    for key in keys:
        run = base_runs.get(key, {})
        group, shape, n, max_tokens, engine, ckpt = key
        metrics = [("req/s", "requests_per_s", 2), ("TTFT p50 ms", "ttft_p50_ms", 0)]
        if max_tokens > 1:
            metrics.append(("TPOT p50 ms", "tpot_ms", 2))
        for name, field, digits in metrics:
            cells = [f"{group} {shape}" + ("" if engine == "default" else f" {engine}"), str(n), str(max_tokens),
                     ckpt, name, _fmt(run.get(field), digits)]
            for runs in other_runs:
                value = runs.get(key, {}).get(field)
                ratio = _ratio(value, run.get(field))
                cells += [_fmt(value, digits), "-" if ratio is None else f"{ratio:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def _full_step(results: dict, mode: str) -> float | None:
    return results.get("full_steps", {}).get(mode, {}).get("tokens_per_s_median")


def _engine(results: dict, field: str) -> float | None:
    return results.get("engine", {}).get(field)


def _load_s(results: dict) -> float | None:
    return results.get("engine", {}).get("start_up_phases_s", {}).get("load weights")


def summary_table(base: dict, others: list[dict]) -> list[str]:
    """Engine-level numbers: full-step prefill, start-up, weights, memory, pools."""
    rows = [("full-step prefill tok/s, ckpt off", lambda r: _full_step(r, "off"), 0),
            ("full-step prefill tok/s, ckpt on", lambda r: _full_step(r, "on"), 0),
            ("engine start s", lambda r: _engine(r, "init_s"), 1),
            ("load weights s", _load_s, 1),
            ("weights GB", lambda r: _engine(r, "weights_gb"), 1),
            ("FP8 weights GB", lambda r: _engine(r, "fp8_weights_gb"), 1),
            ("GPU allocated after start GB", lambda r: _engine(r, "gpu_mem_allocated_gb"), 1),
            ("GPU peak allocated GB", lambda r: r.get("gpu_mem_peak_allocated_gb"), 1),
            ("KV blocks", lambda r: _engine(r, "kv_blocks"), 0),
            ("checkpoint slots", lambda r: _engine(r, "checkpoint_slots"), 0)]
    head = "| | baseline |" + "".join(f" #{i} | #{i} / baseline |" for i in range(1, len(others) + 1))
    lines = [head, "|---|---|" + "---|---|" * len(others)]
    for name, get, digits in rows:
        cells = [name, _fmt(get(base), digits)]
        for other in others:
            ratio = _ratio(get(other), get(base))
            cells += [_fmt(get(other), digits), "-" if ratio is None else f"{ratio:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def targets(base: dict, other: dict) -> list[str]:
    """Issue 28's two targets for `other` against `base` (same architecture only), met or missed."""
    if not same_architecture(base, other):
        return []
    out = []
    base_runs, other_runs = runs_by_key(base), runs_by_key(other)
    decode = [k for k in base_runs if k[0] == "decode" and k[2] == TARGET_BATCH and k[4] == "default"]
    if not decode:
        out.append(f"decode TPOT at batch {TARGET_BATCH}: not measured (the baseline has no such row)")
    for key in decode:
        ratio = _ratio(other_runs.get(key, {}).get("tpot_ms"), base_runs[key].get("tpot_ms"))
        verdict = "not measured" if ratio is None else ("met" if ratio <= TPOT_TARGET else "MISSED")
        out.append(f"decode TPOT at batch {TARGET_BATCH} ({key[1]}, checkpoints {key[5]}): "
                   f"{'-' if ratio is None else f'{ratio:.2f}x'} the baseline (target <= {TPOT_TARGET}x): {verdict}")
    ratio = _ratio(_full_step(other, "off"), _full_step(base, "off"))
    verdict = "not measured" if ratio is None else ("met" if ratio >= PREFILL_TARGET else "MISSED")
    out.append(f"full-step prefill tokens/s: {'-' if ratio is None else f'{ratio:.2f}x'} the baseline "
               f"(target >= {PREFILL_TARGET}x): {verdict}")
    return out


def compare(base: dict, others: list[dict]) -> str:
    """The markdown report: legend, per-run table, engine table, targets."""
    lines = [f"baseline: {_label(base)}"]
    lines += [f"#{i}: {_label(other)}" + ("" if same_architecture(base, other) else " (another architecture: "
                                                                                    "ratios are not FP8 / bf16)")
              for i, other in enumerate(others, 1)]
    lines += ["", *run_table(base, others), "", *summary_table(base, others), ""]
    for i, other in enumerate(others, 1):
        lines += [f"#{i} {line}" for line in targets(base, other)]
        if other.get("error"):
            lines.append(f"#{i} stopped: {str(other['error'])[-300:]}")
    if base.get("error"):
        lines.append(f"baseline stopped: {str(base['error'])[-300:]}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    loaded = [load(path) for path in argv]
    for _, why in loaded:
        if why is not None:
            print(f"not compared: {why}")
    base = loaded[0][0] or {"model": f"missing ({argv[0]})"}
    others = [results for results, _ in loaded[1:] if results is not None]
    if not others:
        print("nothing to compare: no result besides the baseline")
        return 1
    print(compare(base, others))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
