"""Plot helpers shared by the CPU benchmarks (matplotlib, no display)."""

from __future__ import annotations

from pathlib import Path


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
