"""The server talks: a start-up summary, a periodic stats line, the reason of every error answer,
and aborted requests."""

from __future__ import annotations

import logging
import time

import httpx
import pytest

from forkpoint.server.config import ServerConfig
from forkpoint.server.stats import StatsLine, disk_tier_summary, host_tier_summary, http_summary
from tests.server.conftest import RunningServer, serve


def messages(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "forkpoint.server"]


def stats_lines(caplog: pytest.LogCaptureFixture, running: RunningServer) -> list[str]:
    """The stats lines of `running` alone (the session-wide server logs on the same logger)."""
    return [r.getMessage() for r in caplog.records
            if r.name == "forkpoint.server" and r.thread == running.thread.ident and "tokens/s" in r.getMessage()]


def wait_for(caplog: pytest.LogCaptureFixture, text: str, timeout: float = 10,
             running: RunningServer | None = None) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [m for m in (messages(caplog) if running is None else stats_lines(caplog, running)) if text in m]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError(f"no log line with {text!r} in {messages(caplog)}")


def test_startup_summary_stats_errors_and_aborts(spare_llm, caplog):
    caplog.set_level(logging.INFO, logger="forkpoint.server")
    config = ServerConfig(served_model_name="talker", log_stats_interval_s=0.2)
    with serve(spare_llm, config, load_time_s=2.5) as running:
        summary = " | ".join(messages(caplog))
        for text in ("served as talker", "float32 on cpu", "max_model_len 4096", "loaded in 2.5 s",
                     "2048 KV blocks x 16 tokens", "state slots", "32 checkpoint slots", "checkpoints on",
                     "'<|mamba_checkpoint|>'", "at most 4 per request", "kernels: ", "attention reference",
                     "--max-request-bytes", "stats every 0.2 s",
                     "CUDA graphs: off, every step runs eagerly (no CUDA device (cpu))", "host tier: "):
            assert text in summary, text
        caplog.clear()
        time.sleep(0.5)
        assert not stats_lines(caplog, running), "an idle server logs no stats"

        out = running.client().completions.create(model="talker", prompt="Hello there, general", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
        line = wait_for(caplog, "tokens/s", running=running)
        for text in ("prompt ", "generation ", "running ", "waiting ", "KV ", "state slots ", "checkpoint slots ",
                     "hits", "prompt tokens reused", "hit rate"):
            assert text in line, (text, line)

        # every error answer is logged with its reason (and the field at fault)
        bad = running.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert bad.status_code == 400
        line = wait_for(caplog, "-> 400")
        assert "POST /v1/completions" in line and "(param model)" in line and "'nope' does not exist" in line
        oversized = b"x" * (running.app.state.max_request_bytes + 1)
        too_big = httpx.post(f"{running.base_url}/v1/completions", content=oversized,
                             headers={"content-type": "application/json"}, timeout=30)
        assert too_big.status_code == 413
        assert "--max-request-bytes" in wait_for(caplog, "-> 413")

        # a client that goes away: its request is aborted, and the log says so
        stream = running.client().completions.create(model="talker", prompt="Tell me a story", max_tokens=2000,
                                                     stream=True, extra_body={"ignore_eos": True})
        for received, _ in enumerate(stream):
            if received == 2:
                break
        stream.close()
        assert "aborted" in wait_for(caplog, "aborted")
        running.wait_idle()


def test_stats_line_rates_and_quiet_when_idle():
    idle = {"prompt_tokens_total": 0, "prompt_tokens_computed": 0, "generation_tokens_total": 0,
            "checkpoint_hits": 0, "num_running": 0, "num_waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 100,
            "state_slots_used": 0, "state_slots_total": 8, "checkpoint_slots_used": 0, "checkpoint_slots_total": 4}
    stats = StatsLine(idle, now=0.0)
    assert stats.line(idle, now=10.0) is None
    busy = {**idle, "prompt_tokens_total": 1000, "prompt_tokens_computed": 400, "generation_tokens_total": 50,
            "checkpoint_hits": 3, "num_running": 2, "kv_blocks_used": 25, "checkpoint_slots_used": 1}
    line = stats.line(busy, now=20.0)
    assert "prompt 40.0 tokens/s" in line and "generation 5.0 tokens/s" in line
    assert "running 2, waiting 0" in line and "KV 25.0% (25/100)" in line and "checkpoint slots 1/4" in line
    assert "3 hits" in line and "600 prompt tokens reused, hit rate 60.0% of prompt tokens since start" in line
    done = {**busy, "num_running": 0, "kv_blocks_used": 0}
    assert "prompt 0.0 tokens/s" in stats.line(done, now=30.0)  # one line that shows it idle
    assert stats.line(done, now=40.0) is None


def test_stats_line_and_start_up_summary_show_the_host_tier():
    base = {"prompt_tokens_total": 0, "prompt_tokens_computed": 0, "generation_tokens_total": 0,
            "checkpoint_hits": 0, "num_running": 1, "num_waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 100,
            "state_slots_used": 0, "state_slots_total": 8, "checkpoint_slots_used": 0, "checkpoint_slots_total": 4,
            "checkpoints_spilled": 2, "checkpoints_restored": 1, "checkpoints_dropped_from_host": 0,
            "host_tier_checkpoints": 2, "host_tier_bytes": 2**29, "host_tier_capacity_bytes": 2**31}
    stats = StatsLine(base, now=0.0)
    later = {**base, "checkpoints_spilled": 7, "checkpoints_restored": 4, "checkpoints_dropped_from_host": 1,
             "host_tier_checkpoints": 6, "host_tier_bytes": 3 * 2**29, "checkpoints_unspilled_passed": 2}
    line = stats.line(later, now=10.0)
    assert "host tier: 5 spilled, 3 restored, 1 dropped, 2 passed turns not spilled, 6 held (1.50 of 2.0 GiB)" in line
    assert "host tier" not in StatsLine({**base}, 0.0).line(
        {k: v for k, v in base.items() if "tier" not in k and "spilled" not in k}, 10.0)
    assert host_tier_summary(later).startswith("host tier: 2.0 GiB of host memory")
    assert host_tier_summary({"host_tier_capacity_bytes": 0}).startswith("host tier: off")


def test_stats_line_disk_tier():
    base = {"prompt_tokens_total": 0, "prompt_tokens_computed": 0, "num_running": 1, "checkpoints_saved_to_disk": 3,
            "checkpoints_loaded_from_disk": 1, "disk_files_rejected_corrupt": 0, "disk_files_rejected_foreign": 0,
            "disk_tier_checkpoints": 3, "disk_tier_bytes": 2**29, "disk_tier_capacity_bytes": 2**32}
    later = {**base, "checkpoints_saved_to_disk": 8, "checkpoints_loaded_from_disk": 3,
             "disk_files_rejected_corrupt": 1, "disk_files_rejected_foreign": 1, "disk_tier_checkpoints": 7,
             "disk_tier_bytes": 2**30}
    line = StatsLine(base, now=0.0).line(later, now=10.0)
    assert "disk tier: 5 saved, 2 loaded, 2 rejected, 7 files (1.00 GiB)" in line
    assert "disk tier" not in StatsLine({"num_running": 1}, 0.0).line({"num_running": 1}, 10.0)
    assert disk_tier_summary(later, "/ckpt").startswith("disk tier: /ckpt, 7 checkpoint files of this model found, "
                                                        "at most 4.0 GiB")
    assert disk_tier_summary({}, None).startswith("disk tier: off")


def test_stats_line_reuse_by_kind_evictions_and_misses():
    before = {"prompt_tokens_total": 0, "prompt_tokens_computed": 0, "checkpoint_tokens_saved_chat_turn": 0,
              "checkpoint_tokens_saved_marker": 0, "cache_misses_template_divergence": 0,
              "cache_misses_evicted_device": 0, "checkpoints_evicted": 0, "num_running": 1}
    stats = StatsLine(before, now=0.0)
    after = {**before, "prompt_tokens_total": 1000, "prompt_tokens_computed": 300,
             "checkpoint_tokens_saved_chat_turn": 600, "checkpoint_tokens_saved_marker": 100,
             "cache_misses_template_divergence": 3, "checkpoints_evicted": 2}
    line = stats.line(after, now=10.0)
    assert line.endswith("| by kind chat_turn 60.0%, marker 10.0%; 2 evicted; misses template_divergence 3")
    assert "evicted_device" not in line  # no new ones in the interval


def test_start_up_names_the_http_parser_and_event_loop_and_how_to_get_the_fast_ones():
    assert http_summary(lambda name: True) == "HTTP: httptools parser, uvloop event loop"
    slow = http_summary(lambda name: False)
    assert slow.startswith("HTTP: h11 parser, asyncio event loop") and "pip install httptools uvloop" in slow
    assert http_summary() == "HTTP: httptools parser, uvloop event loop"  # both are forkpoint's dependencies
