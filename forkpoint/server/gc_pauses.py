"""Python's cyclic garbage collector in the serving process, timed: every collection's pause by generation.

A collection holds the GIL, so it stalls the engine thread's step loop and the event loop alike; what it
costs grows with the container objects it traverses. `forkpoint serve` freezes its start-up heap
(server/cli.py `freeze_startup_heap`: ~380k objects, a 160-250 ms full collection, out of the collector's
view); what serving creates (requests, token lists, prefix-index nodes, outputs) is still collected, and
`GcPauses` says how long that takes, on the stats line and /metrics (vLLM's GC debugger measures the same).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

GENERATIONS = (0, 1, 2)


class GcPauses:
    """Collections and their seconds per generation while installed (`install`, `uninstall`).

    values() keys: gc_collections_gen{0,1,2}, gc_pause_seconds_gen{0,1,2}, gc_longest_pause_seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self._began: float | None = None
        self.collections = dict.fromkeys(GENERATIONS, 0)
        self.seconds = dict.fromkeys(GENERATIONS, 0.0)
        self.longest_s = 0.0

    def install(self) -> None:
        if self._on_collection not in gc.callbacks:
            gc.callbacks.append(self._on_collection)

    def uninstall(self) -> None:
        if self._on_collection in gc.callbacks:
            gc.callbacks.remove(self._on_collection)

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {f"gc_collections_gen{g}": self.collections[g] for g in GENERATIONS}
        out.update({f"gc_pause_seconds_gen{g}": self.seconds[g] for g in GENERATIONS})
        out["gc_longest_pause_seconds"] = self.longest_s
        return out

    def _on_collection(self, phase: str, info: dict[str, int]) -> None:
        """gc's callback: "start" then "stop" of one collection (they never nest: a collection holds
        the GIL and the collector does not re-enter itself)."""
        if phase == "start":
            self._began = self._clock()
            return
        if self._began is None:  # installed during a collection
            return
        elapsed = self._clock() - self._began
        self._began = None
        generation = info["generation"]
        self.collections[generation] += 1
        self.seconds[generation] += elapsed
        self.longest_s = max(self.longest_s, elapsed)
