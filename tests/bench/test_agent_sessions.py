"""bench/agent_sessions.py at tiny size against an in-process server (embedded default model): every
turn after the first reuses all it shares with the previous one but for the assistant header, the
nonce phase reuses nothing, and the JSON and PNG are written."""

from __future__ import annotations

import json
import logging
import os
import random
import sys

import pytest

from forkpoint.server.config import ServerConfig
from tests.server.conftest import serve

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))

import agent_sessions  # noqa: E402
from agent_sessions import (  # noqa: E402
    ServerSample,
    generation_windows,
    latest_evictions,
    logged_parts,
    max_shared_with_others,
    server_sample,
)

from forkpoint.inputs.turns import common_prefix_length  # noqa: E402


def test_agent_sessions_bench(tmp_path, auto_llm):
    log_path = tmp_path / "server.log"  # the in-process server's debug lines, as a started server writes them
    handler = logging.FileHandler(log_path)
    server_logger = logging.getLogger("forkpoint.server")
    level = server_logger.level
    server_logger.addHandler(handler)
    server_logger.setLevel(logging.DEBUG)
    try:
        with serve(auto_llm, ServerConfig(served_model_name="agents", log_stats=False)) as running:
            res = agent_sessions.main(["--url", running.base_url, "--sessions", "2", "--turns", "3", "--system-words",
                                       "40", "--doc-words", "30", "--tool-words", "15", "--reply-tokens", "3",
                                       "--server-log", str(log_path), "--out", str(tmp_path),
                                       "--request-log", str(tmp_path / "requests.jsonl")])
            running.engine_call(lambda engine: engine.check_integrity())
    finally:
        server_logger.removeHandler(handler)
        server_logger.setLevel(level)
        handler.close()
    for phase in ("reuse", "no_reuse"):  # every turn's parts, joined to the requests by response id
        for row in res[phase]["turns"]:
            assert set(row["ttft_parts_p50_ms"]) == {"request", "prompt", "handoff", "queue", "queued_steps", "prefill",
                                                     "prefill_steps", "delivery"}
            assert row["ttft_parts_p50_ms"]["prefill"] > 0
    for row in res["reuse"]["turns"][1:]:
        assert row["cached_tokens"] >= row["shared_tokens"] - 4
        assert row["ttft_parts_p50_ms"]["prefill_steps"] == 1  # a reused turn samples in the step admitting it
        assert set(row["miss_reasons"]) <= {"none", "template_divergence"}
    assert all(row["cached_tokens"] == 0 for row in res["no_reuse"]["turns"])
    assert res["reuse"]["computed_tokens"] < res["no_reuse"]["computed_tokens"]
    assert res["server_misses_reuse_phase"]["template_divergence"] >= 4
    for phase in ("reuse", "no_reuse"):  # ignore_eos + min_tokens: exactly reply-tokens per request
        summary = res[phase]
        assert summary["generated_tokens"] == 2 * 3 * 3
        assert summary["worst_window_tokens_per_s"] == min(summary["generation_windows_tokens_per_s"]) > 0
        assert summary["wall_s"] > 0
        assert summary["evicted_session_latest"] == 0 and 0 < summary["kv_used_fraction_max"] < 1
        parts = summary["ttft_parts_mean_ms"]  # the server's time to first token by part, all measured
        assert set(parts) == set(agent_sessions.FIRST_TOKEN_PARTS) and all(ms >= 0 for ms in parts.values())
        assert parts["prefill"] > 0
    logged = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    requests = [r for r in logged if "id" in r]
    assert len(requests) == 2 * 2 * 3
    for r in requests:  # when each request went out on the wire, from httpcore's trace, in order
        assert r["sent_at"] <= r["write_at"] <= r["written_at"] <= r["headers_at"] <= r["end_at"]
    opened = [r for r in requests if "connect_at" in r]  # new connections (a turn-0 request may reuse /metrics' one)
    assert opened and all(r["sent_at"] <= r["connect_at"] <= r["connected_at"] <= r["write_at"] for r in opened)
    saved = json.loads((tmp_path / "agent_sessions.json").read_text())
    assert saved["reuse"]["prompt_tokens"] == res["reuse"]["prompt_tokens"]
    assert (tmp_path / "agent_sessions.png").stat().st_size > 0


def test_agent_sessions_bench_through_the_agent_apis(tmp_path, auto_llm):
    """--api responses, responses-chained and messages on one server (a seed each: no mode reads another's
    prompts): every turn after the first caches what it shares with the previous one but for the assistant
    header, the nonce phase caches nothing, and `/tokenize` of the chat messages the bench says the server
    renders counts the server's prompt tokens at every turn (so the shared column is the rendered prompt's)."""
    with serve(auto_llm, ServerConfig(served_model_name="agents", log_stats=False)) as running:
        for seed, api in enumerate(("responses", "responses-chained", "messages"), start=1):
            res = agent_sessions.main(["--url", running.base_url, "--api", api, "--seed", str(seed), "--sessions",
                                       "2", "--turns", "3", "--system-words", "40", "--doc-words", "30",
                                       "--tool-words", "15", "--reply-tokens", "3", "--out", str(tmp_path),
                                       "--name", api])
            assert res["config"]["api"] == api and (tmp_path / f"{api}.png").stat().st_size > 0
            for phase in ("reuse", "no_reuse"):
                assert [row["tokenize_mismatches"] for row in res[phase]["turns"]] == [0, 0, 0], api
            for row in res["reuse"]["turns"][1:]:
                assert row["cached_tokens"] >= row["shared_tokens"] - 4, api
                assert set(row["miss_reasons"]) <= {"none", "template_divergence"}, api
            assert all(row["cached_tokens"] == 0 for row in res["no_reuse"]["turns"]), api
        running.engine_call(lambda engine: engine.check_integrity())


def test_agent_sessions_bench_after_a_restart(tmp_path):
    """--restart: the server started again on the same --checkpoint-dir computes, for the first turn of
    new sessions, only what they do not share with each other's (and the first server's) system prompt.
    (--phases reuse: the no-reuse phase after it is test_agent_sessions_bench's.)"""
    res = agent_sessions.main(["--restart", "--phases", "reuse", "--sessions", "2", "--turns", "1", "--system-words",
                               "60", "--doc-words", "20", "--tool-words", "5", "--reply-tokens", "2", "--out",
                               str(tmp_path), "--start-timeout", "300"])
    [row] = res["restart"]["turns"]
    assert row["shared_tokens"] > 200 and row["cached_tokens"] == row["shared_tokens"]
    assert res["restart"]["computed_tokens"] == res["restart"]["prompt_tokens"] - 2 * row["shared_tokens"]


def test_generation_windows_interpolate_the_counter_at_each_edge():
    """Samples of a counter that runs 10 tokens/s for 10 s, stops for 10 s, then runs 30 tokens/s: the
    windows see exactly that; the last partial window is left out."""
    times = (0.0, 3.0, 7.5, 10.0, 12.0, 19.0, 20.0, 21.0, 26.0, 30.0, 34.0)
    samples = [(t, 10.0 * min(t, 10) + 30.0 * max(t - 20, 0)) for t in times]
    assert generation_windows(samples, 10.0) == pytest.approx([10.0, 0.0, 30.0])
    assert generation_windows(samples, 15.0) == pytest.approx([100 / 15, 300 / 15])  # edge 15 between 12 and 19

def test_generation_windows_of_a_phase_shorter_than_one_window():
    assert generation_windows([(1.0, 5.0), (2.0, 9.0), (3.0, 13.0)], 10.0) == [4.0]


def test_max_shared_with_others_equals_all_pairs():
    rng = random.Random(3)
    for _ in range(50):
        prompts = [[rng.randrange(3) for _ in range(rng.randrange(6))] for _ in range(rng.randrange(2, 8))]
        expected = [max(common_prefix_length(p, q) for j, q in enumerate(prompts) if j != i)
                    for i, p in enumerate(prompts)]
        assert max_shared_with_others(prompts) == expected


def test_server_sample_reads_the_three_series():
    page = "\n".join([
        "# TYPE forkpoint_generation_tokens_total counter", "forkpoint_generation_tokens_total 120.0",
        "# TYPE forkpoint_pool_used gauge", 'forkpoint_pool_used{pool="kv_blocks"} 30.0',
        'forkpoint_pool_used{pool="state_slots"} 7.0',
        "# TYPE forkpoint_pool_capacity gauge", 'forkpoint_pool_capacity{pool="kv_blocks"} 40.0',
        'forkpoint_pool_capacity{pool="state_slots"} 8.0',
        "# TYPE forkpoint_checkpoints_evicted_session_latest_total counter",
        "forkpoint_checkpoints_evicted_session_latest_total 3.0", ""])
    assert server_sample(page, 5.0) == ServerSample(5.0, 120.0, 0.75, 3.0)
    with pytest.raises(RuntimeError, match="generation_tokens"):
        server_sample("# TYPE other counter\nother_total 1.0\n", 0.0)


def test_latest_evictions_counts_those_below_the_kv_threshold_apart():
    fractions = [0.1, 0.5, 0.79, 0.85, 0.9, 0.7, 0.6]
    evicted = [0, 1, 3, 6, 10, 11, 13]
    samples = [ServerSample(float(t), 0.0, f, e) for t, (f, e) in enumerate(zip(fractions, evicted))]
    # intervals with both ends below 0.8: 0-1 (+1), 1-2 (+2), 5-6 (+2); the others touch 0.85 / 0.9
    assert latest_evictions(samples) == (13, 5)
    assert latest_evictions(samples, kv_threshold=1.0) == (13, 13)


def test_logged_parts_read_the_prefill_steps_when_the_server_logs_them(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("x DEBUG forkpoint.server: request a-0: first token after 70.0 ms: prompt 4.0, hand-off 9.0, queue "
                   "0.2 (0 steps), prefill 45.0 (1 steps), delivery 3.0 ms; 2 of 9 prompt tokens cached\n"
                   "x DEBUG forkpoint.server: request b-0: first token after 70.0 ms: prompt 4.0, hand-off 9.0, queue "
                   "0.2 (0 steps), prefill 45.0, delivery 3.0 ms; 2 of 9 prompt tokens cached\n")
    parts = logged_parts(str(log))
    assert parts["a"] == {"prompt": 4.0, "handoff": 9.0, "queue": 0.2, "queued_steps": 0.0, "prefill": 45.0,
                          "prefill_steps": 1.0, "delivery": 3.0}
    assert "prefill_steps" not in parts["b"] and parts["b"]["queued_steps"] == 0.0 and parts["b"]["delivery"] == 3.0
    # the median of the keys both lines have: no prefill steps
    assert agent_sessions.parts_p50(list(parts.values())) == {"prompt": 4.0, "handoff": 9.0, "queue": 0.2,
                                                              "queued_steps": 0.0, "prefill": 45.0, "delivery": 3.0}
