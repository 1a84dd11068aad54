"""The start-up log: each phase's seconds, in order, summing to the whole; kernel caches under the
forkpoint cache directory unless the user chose their own."""

from __future__ import annotations

import logging
from pathlib import Path

from forkpoint import LLM
from forkpoint.engine.startup import MemoryPlan, StartupTimer
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


def test_memory_plan_says_what_fits():
    plan = MemoryPlan(checkpoint_rows=385, request_rows=256, row_bytes=64_389_120, num_kv_blocks=76_022, block_size=16,
                      block_bytes=327_680, host_bytes=32 << 30, on_gpu=True)
    assert plan.host_checkpoints == 533
    assert plan.summary() == ("385 checkpoints of 61 MiB on the GPU, 533 in host memory (32.0 GiB, fewer with long "
                              "prefixes: KV 320 KiB per 16 tokens); 256 request state rows; 76,022 KV blocks "
                              "(1,216,352 tokens)")
    cpu = MemoryPlan(checkpoint_rows=8, request_rows=2, row_bytes=9600, num_kv_blocks=16, block_size=16,
                     block_bytes=4096, host_bytes=0, on_gpu=False)
    assert cpu.summary().startswith("8 checkpoints of 0.0092 MiB in the CPU pools, none in host memory")
    off = MemoryPlan(checkpoint_rows=0, request_rows=2, row_bytes=9600, num_kv_blocks=16, block_size=16,
                     block_bytes=4096, host_bytes=0, on_gpu=False)
    assert off.summary() == "checkpoints off; 2 request state rows; 16 KV blocks (256 tokens)"


def test_wait_for_host_tier_returns_once_a_tier_pinned_ahead_is_allocated(moe_model, monkeypatch):
    """The server waits here before serving (server/app.py): an arena allocating ahead in the background
    (pinned on a GPU; plain memory here, held back by a gate) is whole when the wait returns."""
    import threading
    import time

    from forkpoint.runner.host_arena import HostArena
    from forkpoint.runner.host_copies import ArenaHostCopies

    llm = LLM(str(moe_model[0]), max_model_len=256)
    llm.engine.wait_for_host_tier()  # the CPU's plain copies: nothing to wait for
    storage = llm.engine.runner.storage
    gate, real_chunk = threading.Event(), HostArena._new_chunk
    monkeypatch.setattr(HostArena, "_new_chunk", lambda self, index: (gate.wait(), real_chunk(self, index))[1])
    host = ArenaHostCopies(storage.host.pools, capacity_bytes=4 * storage.host.pools.conv_stack[0, 0].numel())
    host.arena = HostArena(num_pages=8, page_bytes=16, pinned=False, chunk_bytes=32, ahead=True)  # 4 chunks
    monkeypatch.setattr(storage, "host", host)
    assert host.arena.allocated_bytes == 0 and host.arena.ahead_seconds is None  # held at the gate
    threading.Timer(0.2, gate.set).start()
    began = time.perf_counter()
    llm.engine.wait_for_host_tier()
    assert time.perf_counter() - began >= 0.15
    assert host.arena.ahead_seconds is not None and host.arena.allocated_bytes == 8 * 16
