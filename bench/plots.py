"""Plot and output helpers shared by the benchmarks (matplotlib, no display)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path


def write_results(res: dict, out: str, name: str, plot: Callable[[dict, str], None]) -> str:
    """`res` as <out>/<name>.json, then plot(res, <out>/<name>.png), whose failure is printed, not
    raised (the numbers matter more than the picture). Returns the JSON's path."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    try:
        plot(res, os.path.join(out, f"{name}.png"))
    except Exception as err:  # noqa: BLE001 - the numbers matter more than the picture
        print(f"plot failed: {err}")
    return path


def stacked_bars(path: Path, labels: list[str], parts: dict[str, list[float]], ylabel: str, title: str,
                 size: tuple[float, float] = (8, 4)) -> None:
    """One bar per label, stacked from `parts` (name -> one value per label, bottom first); PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        ax.bar(labels, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
