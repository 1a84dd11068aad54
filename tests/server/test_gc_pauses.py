"""The serving process's garbage collector (server/gc_pauses.py): collections timed by generation, on the
stats line and /metrics while a server runs."""

from __future__ import annotations

import gc
import itertools

from forkpoint.server.config import ServerConfig
from forkpoint.server.gc_pauses import GcPauses
from forkpoint.server.stats import StatsLine
from tests.server.conftest import serve


def test_every_collection_is_timed_by_generation_while_installed():
    ticks = itertools.count(step=0.25)  # each reading of the clock: 0.25 s later
    pauses = GcPauses(clock=lambda: next(ticks))
    gc.collect()
    pauses.install()
    try:
        gc.collect(2)
        gc.collect(0)
    finally:
        pauses.uninstall()
    gc.collect()  # not counted: uninstalled
    assert pauses.collections == {0: 1, 1: 0, 2: 1}
    assert pauses.seconds == {0: 0.25, 1: 0.0, 2: 0.25} and pauses.longest_s == 0.25
    assert pauses.values()["gc_pause_seconds_gen2"] == 0.25


def test_stats_line_shows_the_intervals_collections():
    base = {f"gc_collections_gen{g}": 0 for g in range(3)} | {f"gc_pause_seconds_gen{g}": 0.0 for g in range(3)}
    stats = StatsLine({**base, "num_running": 1}, now=0.0)
    later = {**base, "num_running": 1, "gc_collections_gen0": 30, "gc_collections_gen2": 2,
             "gc_pause_seconds_gen0": 0.012, "gc_pause_seconds_gen2": 0.31}
    assert "| GC: 32 collections, 322 ms (oldest generation 2, 310 ms)" in stats.line(later, now=10.0)
    assert "GC:" not in stats.line(later, now=20.0)  # none in the next interval


def test_a_server_exports_its_collections_while_it_runs(spare_llm):
    with serve(spare_llm, ServerConfig(served_model_name="gc")) as running:
        gc.collect(0)
        assert running.metric("forkpoint_gc_collections_total", generation="0") >= 1
        assert running.metric("forkpoint_gc_pause_seconds_total", generation="0") > 0
        assert running.metric("forkpoint_gc_longest_pause_seconds") > 0
    before = running.app.state.metrics.registry.get_sample_value("forkpoint_gc_collections_total",
                                                                 {"generation": "0"})
    gc.collect(0)  # stopped: no longer counted
    assert running.app.state.metrics.registry.get_sample_value("forkpoint_gc_collections_total",
                                                               {"generation": "0"}) == before
