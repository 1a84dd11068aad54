"""bench/startup.py reads the server's log: the engine's start-up phases, its load time and when `LLM`
began, from the lines `forkpoint serve` writes; a missed target names the phase that costs most."""

from __future__ import annotations

import os
import sys
from datetime import datetime

import pytest

from forkpoint.engine.startup import StartupTimer

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import startup  # noqa: E402

LOG = """2026-12-03 14:23:22,199 INFO forkpoint: kernel caches: Triton /tmp/c/triton (autotune choices kept: True)
2026-12-03 14:23:30,129 INFO forkpoint: {summary}
INFO:     Started server process [8960]
2026-12-03 14:23:31,255 INFO forkpoint.server: model /tmp/m (served as startup-bench), bfloat16 on cuda:0, \
max_model_len 262144, loaded in 142.8 s
"""


def test_the_log_gives_each_phase_the_load_time_and_the_engine_start():
    timer = StartupTimer()
    timer.phases = [("config and tokenizer", 1.25), ("load weights", 9.0), ("tensor-parallel ranks: weights, pools",
                                                                            3.5), ("warm-up", 119.8)]
    parsed = startup.parse_startup_log(LOG.format(summary=timer.summary()))
    assert parsed["phases"] == pytest.approx({"config and tokenizer": 1.2, "load weights": 9.0,
                                              "tensor-parallel ranks: weights, pools": 3.5, "warm-up": 119.8}, abs=0.06)
    assert parsed["engine_s"] == pytest.approx(timer.total_seconds, abs=0.06)
    assert parsed["loaded_in_s"] == 142.8
    assert parsed["llm_start"] == datetime(2026, 12, 3, 14, 23, 22, 199000).timestamp()
    with pytest.raises(ValueError, match="no 'start-up N s"):
        startup.parse_startup_log("INFO:     Started server process [1]\n")


def test_a_missed_target_names_the_phase_that_costs_most():
    rows = [{"run": "cold", "ready_s": 130.0, "imports_s": 12.0, "server_s": 4.0,
             "phases": {"load weights": 10.0, "warm-up": 104.0}},
            {"run": "warm", "ready_s": 19.0, "imports_s": 8.0, "server_s": 3.0, "phases": {"warm-up": 8.0}}]
    cold, warm = startup.verdicts(rows, applies=True)
    assert "MISSED, the largest phase is warm-up (104.0 s)" in cold
    assert warm.endswith("met")
