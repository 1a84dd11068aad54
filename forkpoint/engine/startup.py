"""The engine's start-up, phase by phase, for the start-up log: where the seconds go (loading weights,
capturing graphs, sizing pools, warming up kernels) is what a restart costs.

    timer = StartupTimer()
    ...load weights...;   timer.lap("load weights")
    ...capture graphs...; timer.lap("graphs capture")
    timer.summary()   # "start-up 41.2 s: load weights 30.1 s, graphs capture 11.1 s"
"""

from __future__ import annotations

import time


class StartupTimer:
    """Consecutive phases of one start-up: each `lap(name)` closes the phase that began at the previous
    lap (or at construction). `phases`: (name, seconds) in order."""

    def __init__(self) -> None:
        self._start = self._last = time.perf_counter()
        self.phases: list[tuple[str, float]] = []

    def lap(self, name: str) -> float:
        """Close the current phase as `name`; returns its seconds."""
        now = time.perf_counter()
        seconds, self._last = now - self._last, now
        self.phases.append((name, seconds))
        return seconds

    def split_last(self, first: str, second: str, second_seconds: float) -> None:
        """Split the last phase into `first` and `second`, the latter taking `second_seconds` of it
        (a phase whose inner part a component measured itself, e.g. the runner's warm-up)."""
        _, total = self.phases.pop()
        second_seconds = min(max(second_seconds, 0.0), total)
        self.phases += [(first, total - second_seconds), (second, second_seconds)]

    @property
    def total_seconds(self) -> float:
        return sum(seconds for _, seconds in self.phases)

    def summary(self) -> str:
        """One line: the total, then each phase with its seconds."""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in self.phases)
        return f"start-up {self.total_seconds:.1f} s: {parts}"
