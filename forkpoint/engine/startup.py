"""The engine's start-up for the start-up log: where the seconds go, phase by phase (loading weights,
capturing graphs, sizing pools, warming up kernels: what a restart costs), and what fits in memory.

    timer = StartupTimer()
    ...load weights...;   timer.lap("load weights")
    ...capture graphs...; timer.lap("graphs capture")
    timer.summary()   # "start-up 41.2 s: load weights 30.1 s, graphs capture 11.1 s"

    MemoryPlan(...).summary()
    # "385 checkpoints of 61 MiB on the GPU, 533 in host memory (32.0 GiB, fewer with long prefixes:
    #  KV 320 KiB per 16 tokens); 256 request state rows; 76,022 KV blocks (1,216,352 tokens)"
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class MemoryPlan:
    """What the pools and the host tier hold. checkpoint_rows, request_rows: device state rows of
    row_bytes each; host_bytes: the host tier's capacity (0: none), where a checkpoint takes its row
    and its prefix's KV blocks (block_bytes per block of block_size tokens); on_gpu: where the pools
    are."""

    checkpoint_rows: int
    request_rows: int
    row_bytes: int
    num_kv_blocks: int
    block_size: int
    block_bytes: int
    host_bytes: int
    on_gpu: bool

    @property
    def host_checkpoints(self) -> int:
        """Checkpoints the host tier holds at most: state rows alone (each also holds its prefix's KV
        blocks, so fewer fit when prefixes are long)."""
        return self.host_bytes // max(self.row_bytes, 1)

    def summary(self) -> str:
        """One line for the start-up log."""
        where = "on the GPU" if self.on_gpu else "in the CPU pools"
        if self.host_bytes:
            host = (f"{self.host_checkpoints:,} in host memory ({self.host_bytes / 2**30:.1f} GiB, "
                    f"fewer with long prefixes: KV {self.block_bytes / 2**10:,.0f} KiB per {self.block_size} tokens)")
        else:
            host = "none in host memory (checkpoint_host_bytes 0: an evicted checkpoint is gone)"
        if not self.checkpoint_rows:
            return (f"checkpoints off; {self.request_rows:,} request state rows; {self.num_kv_blocks:,} KV blocks "
                    f"({self.num_kv_blocks * self.block_size:,} tokens)")
        return (f"{self.checkpoint_rows:,} checkpoints of {_mib(self.row_bytes)} {where}, {host}; "
                f"{self.request_rows:,} request state rows; {self.num_kv_blocks:,} KV blocks "
                f"({self.num_kv_blocks * self.block_size:,} tokens)")


def _mib(num_bytes: int) -> str:
    mib = num_bytes / 2**20
    return f"{mib:.0f} MiB" if mib >= 10 else f"{mib:.2g} MiB"


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
