"""The start-up log: each phase's seconds, in order, summing to the whole; kernel caches under the
forkpoint cache directory unless the user chose their own."""

from __future__ import annotations

import logging
from pathlib import Path

from forkpoint import LLM
from forkpoint.engine.startup import StartupTimer
from forkpoint.kernels.cache_dirs import configure_kernel_caches


def test_timer_laps_and_splits():
    timer = StartupTimer()
    timer.lap("a")
    timer.lap("b")
    timer.split_last("b1", "b2", 0.0)
    assert [name for name, _ in timer.phases] == ["a", "b1", "b2"]
    assert all(seconds >= 0 for _, seconds in timer.phases)
    assert timer.summary().startswith(f"start-up {timer.total_seconds:.1f} s: a ")


def test_kernel_caches_go_under_the_forkpoint_cache_unless_set(tmp_path: Path):
    environ: dict[str, str] = {}
    settings = configure_kernel_caches(tmp_path / "kernels", environ)
    assert settings == {"TRITON_CACHE_DIR": str(tmp_path / "kernels" / "triton"), "TRITON_CACHE_AUTOTUNING": "1"}
    assert (tmp_path / "kernels" / "triton").is_dir() and environ == settings
    mine = {"TRITON_CACHE_DIR": str(tmp_path / "mine"), "TRITON_CACHE_AUTOTUNING": "0"}
    assert configure_kernel_caches(tmp_path / "kernels", dict(mine)) == mine  # the user's choice stands


def test_engine_logs_its_start_up_phases(moe_model, caplog, monkeypatch, tmp_path):
    for name in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING"):  # unset here, restored (unset) afterwards
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    monkeypatch.setenv("FORKPOINT_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="forkpoint"):
        llm = LLM(str(moe_model[0]), max_model_len=256)
    phases = [name for name, _ in llm.engine.startup.phases]
    assert phases == ["config and tokenizer", "load weights", "graphs capture", "pools", "runner"]  # CPU: no warm-up
    assert llm.engine.startup.summary() in caplog.text
    assert str(tmp_path / "kernels" / "triton") in caplog.text
