"""Table, step-time fit and plot of an `e2e_gpu.py` result (the dict it writes as JSON).

`python bench/e2e_gpu_report.py RESULT.json` reprints the table and redraws the PNG beside it, so a
run stopped before its end can still be reported from what it saved.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f}"


def table(results: dict) -> str:
    """One line per run (on above off), the pair's ratios on the 'on' line; then skipped rows and the peer,
    set against forkpoint's scoring rows of its P and N (main, or long for the long anchors)."""
    runs = results["runs"]
    peer = {(r["P"], r["N"]): r for r in results.get("peer", {}).get("runs", []) if "error" not in r}
    lines = ["| row | shape | N | max_tokens | engine | ckpt | req/s | TTFT p50 / p99 ms | "
             "consumer TTFT p50 / p99 ms | prompt tokens computed | computed tok/s | MFU | TPOT p50 ms | on/off | "
             "ideal | of ideal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for sp in results["speedups"]:
        for mode in ("on",) if sp["engine"] in ("checkpoint_exact", "auto_checkpoints") else ("on", "off"):
            r = runs[sp[mode]]
            cons = (f"{r['consumer_ttft_p50_ms']:.0f} / {r['consumer_ttft_p99_ms']:.0f}"
                    if r["consumer_ttft_p50_ms"] is not None else "-")
            ratio = (f"{sp['speedup']:.2f}x | {sp['ideal']:.2f}x | {100 * sp['fraction_of_ideal']:.0f}%"
                     if mode == "on" else " | | ")
            if "vs_default_on" in sp:
                ratio += f" ({sp['vs_default_on']:.3f}x the default on run)"
            lines.append(
                f"| {r['group']} | {r['shape']} | {r['N']} | {r['max_tokens']} | {r['engine']} | {mode} | "
                f"{r['requests_per_s']:.2f} | "
                f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | {cons} | {r['prompt_tokens_computed']:,} | "
                f"{r['computed_tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {_ms(r['tpot_ms'])} | {ratio} |")
    if results["skipped"]:
        lines += ["", "| skipped | shape | N | max_tokens | engine | reason |", "|---|---|---|---|---|---|"]
        for s in results["skipped"]:
            cells = (s.get(k, "") for k in ("group", "shape", "N", "max_tokens", "engine", "reason"))
            lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    if peer:
        ours = {(r["P"], r["N"], r["checkpoints"]): r for r in runs
                if r["max_tokens"] == 1 and r["engine"] == "default" and r["group"] in ("main", "long")}
        lines += ["", "| P | S | N | transformers req/s | transformers tok/s | forkpoint off req/s | "
                      "forkpoint on req/s | off vs transformers | on vs transformers |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for (p, n), r in sorted(peer.items()):
            on, off = ours.get((p, n, "on")), ours.get((p, n, "off"))
            cells = [f"{x['requests_per_s']:.2f}" if x else "-" for x in (off, on)]
            ratios = [f"{x['requests_per_s'] / r['requests_per_s']:.2f}x" if x else "-" for x in (off, on)]
            lines.append(f"| {p} | {r['S']} | {n} | {r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:,.0f} | "
                         f"{cells[0]} | {cells[1]} | {ratios[0]} | {ratios[1]} |")
    return "\n".join(lines)


def step_fit(results: dict, engine: str = "default") -> dict | None:
    """Least-squares step_s = a + b * prompt_tokens over the prefill steps of the max_tokens-1 runs."""
    steps = [s for r in results["runs"] if r["max_tokens"] == 1 and r["engine"] == engine
             for s in r["steps"] if s["prompt_tokens"] > 0]
    if len(steps) < 3:
        return None
    x = np.array([s["prompt_tokens"] for s in steps], dtype=np.float64)
    y = np.array([s["s"] for s in steps], dtype=np.float64)
    if np.ptp(x) == 0:
        return None
    b, a = np.polyfit(x, y, 1)
    enqueue = [s["enqueue_s"] / s["s"] for s in steps if s.get("enqueue_s") is not None and s["s"] > 0]
    a, b = float(a), float(b)
    return {"engine": engine, "fixed_ms_per_step": 1e3 * a, "us_per_token": 1e6 * b,
            "tokens_per_s_marginal": 1.0 / b if b > 0 else None, "num_steps": len(steps),
            "enqueue_fraction_median": float(np.median(enqueue)) if enqueue else None,
            "max_step_tokens_per_s": float(np.max(x / y))}


def plot(results: dict, path: Path) -> None:
    """2 x 2: on/off vs ideal per shape; requests/s (and the peer); consumer TTFT p50; TPOT p50."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    fig, axes = plt.subplots(2, 2, figsize=(15, 10))
    (ax_ratio, ax_rate), (ax_ttft, ax_tpot) = axes
    runs = results["runs"]
    keys = sorted({(r["shape"], r["max_tokens"], r["engine"]) for r in runs})
    palette = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
    colors = {shape: palette[i % len(palette)] for i, shape in enumerate(sorted({k[0] for k in keys}))}
    for shape, max_tokens, engine in keys:
        color = colors[shape]
        marker = "o" if engine == "default" else "x"
        line = "-" if max_tokens == 1 else "-."
        label = f"{shape} mt={max_tokens}" + ("" if engine == "default" else f" {engine}")
        sps = sorted((s for s in results["speedups"] if (s["shape"], s["max_tokens"], s["engine"]) ==
                      (shape, max_tokens, engine)), key=lambda s: s["N"])
        if sps:
            ax_ratio.plot([s["N"] for s in sps], [s["speedup"] for s in sps], line + marker, color=color,
                          label=f"measured {label}")
            if max_tokens == 1 and engine == "default":
                ax_ratio.plot([s["N"] for s in sps], [s["ideal"] for s in sps], ":", color=color,
                              label=f"ideal {shape}")
        for mode, style in (("on", line + marker), ("off", "--" + ("s" if engine == "default" else "x"))):
            rows = sorted((r for r in runs if (r["shape"], r["max_tokens"], r["engine"], r["checkpoints"]) ==
                           (shape, max_tokens, engine, mode)), key=lambda r: r["N"])
            if not rows:
                continue
            if max_tokens == 1:
                ax_rate.plot([r["N"] for r in rows], [r["requests_per_s"] for r in rows], style, color=color,
                             label=f"{label} ckpt {mode}")
                cons = [(r["N"], r["consumer_ttft_p50_ms"]) for r in rows if r["consumer_ttft_p50_ms"] is not None]
                if cons:
                    ax_ttft.plot(*zip(*cons), style, color=color, label=f"{label} ckpt {mode}")
            else:
                ax_tpot.plot([r["N"] for r in rows], [r["tpot_ms"] for r in rows], style, color=color,
                             label=f"{label} ckpt {mode}")
    peer = [r for r in results.get("peer", {}).get("runs", []) if "error" not in r]
    for p in sorted({r["P"] for r in peer}):
        rows = sorted((r for r in peer if r["P"] == p), key=lambda r: r["N"])
        ax_rate.plot([r["N"] for r in rows], [r["requests_per_s"] for r in rows], ":^", color="black",
                     alpha=0.4 + 0.6 * (p == max(r["P"] for r in peer)), label=f"transformers P={p} S={rows[0]['S']}")
    titles = ("on/off speedup vs ideal (N*P + sum S) / (P + sum S)", "requests/s (max_tokens 1)",
              "consumer TTFT p50 (max_tokens 1)", "TPOT p50 (max_tokens > 1)")
    for ax, title, ylabel in zip(axes.flat, titles, ("speedup", "requests/s", "ms", "ms")):
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(sorted({r["N"] for r in runs})))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ys = [float(y) for line in ax.lines for y in line.get_ydata() if y is not None and y == y]
        if ys and min(ys) > 0 and max(ys) / min(ys) > 10:  # several decades: log, labelled at 1, 2, 5 x 10^k
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("N (requests per anchor)")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6)
    fig.suptitle(f"forkpoint 1-to-N, {results['model']}, {results['machine'].get('gpu', 'cpu')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    source = Path(sys.argv[1])
    data = json.loads(source.read_text())
    print(table(data))
    if data["speedups"]:
        plot(data, source.with_suffix(".png"))
        print(f"wrote {source.with_suffix('.png')}")
