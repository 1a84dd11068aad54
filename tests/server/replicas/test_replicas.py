"""Two engine replicas of a tiny model on a local Ray instance, behind one OpenAI endpoint.

Checkpoint-affine routing computes a shared prefix once across the cluster, round-robin computes
it on both replicas, outputs equal one engine's, and a replica killed mid-run leaves no request
hanging.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.server.config import ServerConfig
from forkpoint.server.replicas.cluster import ClusterWorker, aggregate_metrics
from forkpoint.server.replicas.deployment import ReplicaOptions, ReplicaSnapshot
from forkpoint.server.replicas.launch import ReplicaCluster
from tests.server.replicas.conftest import running_app
from tests.tiny_models import token_words, words

MARKER = "<|mamba_checkpoint|>"
ENGINE = {"device": "cpu", "max_model_len": 512, "num_kv_blocks": 512, "checkpoint_pool_size": 8}
CONFIG = ServerConfig(served_model_name="tiny", max_num_seqs_per_request=64, max_request_bytes=1 << 20)


@dataclass
class Served:
    cluster: ReplicaCluster
    worker: ClusterWorker
    url: str

    def snapshots(self, until_total: float, timeout: float = 30) -> dict[str, ReplicaSnapshot]:
        """Replica snapshots once the cluster has seen `until_total` prompt tokens and is idle."""
        deadline = time.monotonic() + timeout
        while True:
            snaps = self.worker.snapshots()
            total = aggregate_metrics(snaps)
            if (total.get("prompt_tokens_total", 0) >= until_total
                    and total.get("num_running", 0) + total.get("num_waiting", 0) == 0):
                return {s.replica: s for s in snaps}
            if time.monotonic() > deadline:
                raise AssertionError(f"the replicas did not report {until_total} prompt tokens: {snaps}")
            time.sleep(0.05)

    def totals(self) -> dict[str, float]:
        return aggregate_metrics(self.worker.snapshots())


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> str:
    return str(tiny_model_factory("qwen3_5_text")[0])


@pytest.fixture(scope="module")
def clusters(ray_instance, model_dir) -> Iterator[dict[str, Served]]:
    """An affine and a round-robin cluster of two replicas each, deployed at the same time."""
    options = {router: ReplicaOptions(num_replicas=2, router=router, app_name=router, stats_period_s=0.2,
                                      graceful_shutdown_timeout_s=2.0) for router in ("affine", "round_robin")}
    with ExitStack() as stack:
        served = {}
        for router, opts in options.items():
            cluster = stack.enter_context(ReplicaCluster({"model": model_dir, **ENGINE}, opts))
            app = cluster.app(CONFIG)
            served[router] = Served(cluster, app.state.cluster, stack.enter_context(running_app(app)))
        yield served


@pytest.fixture(scope="module")
def affine(clusters) -> Served:
    return clusters["affine"]


@pytest.fixture(scope="module")
def round_robin(clusters) -> Served:
    return clusters["round_robin"]


@pytest.fixture(scope="module")
def single(model_dir) -> LLM:
    return LLM(model=model_dir, **ENGINE)


def one_to_n(tag: int, n: int) -> tuple[str, list[str], int, list[int]]:
    """(anchor text with marker, n prompts, anchor tokens P, suffix tokens S_i)."""
    anchor = words(*range(tag, tag + 40))  # 40 tokens
    suffixes = [words(*range(100 + i, 103 + i)) for i in range(n)]  # 3 tokens each
    return anchor + MARKER, [anchor + MARKER + " " + s for s in suffixes], 40, [3] * n


def completions(url: str, prompts, **body) -> list[httpx.Response]:
    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            return await asyncio.gather(*(client.post("/v1/completions", json={
                "model": "tiny", "prompt": p, "temperature": 0, "max_tokens": 4, "logprobs": 2, **body})
                for p in prompts))
    return asyncio.run(main())


def assert_same_as_one_engine(single: LLM, prompts: list[str], choices: list[dict]) -> None:
    expected = single.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, logprobs=2), use_tqdm=False)
    assert [c["text"] for c in choices] == [o.outputs[0].text for o in expected]
    for choice, out in zip(choices, expected):
        want = [lp[t] for lp, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(want, abs=1e-5)


def test_one_to_eight_computes_the_prefix_once_across_the_cluster(affine, single):
    before = affine.totals()
    _, prompts, p, s = one_to_n(0, 8)
    (response,) = completions(affine.url, [prompts])  # one request, eight prompts
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    snaps = affine.snapshots(before.get("prompt_tokens_total", 0) + 8 * (p + 3))
    computed = aggregate_metrics(snaps.values())["prompt_tokens_computed"] - before.get("prompt_tokens_computed", 0)
    assert computed <= p + sum(s) + 2
    routes = {d: sum(x.routes.get(d, 0) for x in snaps.values()) for d in ("new", "affine", "load")}
    assert routes == {"new": 1, "affine": 7, "load": 0}
    assert_same_as_one_engine(single, prompts, choices)

    # consumers without a marker, in separate requests, follow the checkpoint too
    anchor = prompts[0].split(MARKER)[0]
    later = [anchor + " " + words(140 + i, 141 + i) for i in range(4)]
    responses = completions(affine.url, later)
    assert all(r.status_code == 200 for r in responses)
    assert [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in responses] == [p] * 4
    snaps = affine.snapshots(before.get("prompt_tokens_total", 0) + 8 * (p + 3) + 4 * (p + 2))
    assert sum(x.routes["affine"] for x in snaps.values()) == 7 + 4


def test_round_robin_computes_the_prefix_on_both_replicas(round_robin, single):
    before = {s.replica: s.metrics for s in round_robin.worker.snapshots()}
    _, prompts, p, s = one_to_n(50, 8)
    responses = completions(round_robin.url, prompts)  # eight requests at once
    assert all(r.status_code == 200 for r in responses)
    snaps = round_robin.snapshots(sum(m["prompt_tokens_total"] for m in before.values()) + 8 * (p + 3))
    per_replica = {r: x.metrics["prompt_tokens_computed"] - before[r]["prompt_tokens_computed"]
                   for r, x in snaps.items()}
    assert len(per_replica) == 2 and all(c >= p for c in per_replica.values())
    assert sum(per_replica.values()) >= 2 * p + sum(s) - 2
    assert [x.routes["round_robin"] for x in snaps.values()] == [4, 4]
    assert_same_as_one_engine(single, prompts, [r.json()["choices"][0] for r in responses])


def test_the_ingress_counts_n_in_admission(affine):
    """The replicas' front end admits like one server's: 2 prompts x n=40 are 80 sequences, over
    --max-num-seqs-per-request (64 here) though under --max-waiting-requests: a 400 naming n, before any
    replica sees them."""
    (response,) = completions(affine.url, [[words(*range(i, i + 5)) for i in range(2)]], n=40, max_tokens=1)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"


def test_the_ingress_refuses_a_text_that_cannot_fit_before_tokenising_it_all(affine):
    """Like one server (server/prompt_length.py): the front end refuses a prompt text longer than
    max_model_len after tokenising little more than max_model_len tokens of it."""
    (response,) = completions(affine.url, ["many words here " * 5_000], max_tokens=1)  # 80 KB, 15k tokens
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and "the first part of its text alone has" in error["message"]


def test_a_constraint_that_cannot_compile_is_a_400_and_the_replica_keeps_serving(affine):
    """A replica compiles a request's constraint before its engine takes the request (off the engine thread);
    one that cannot compile (this tiny model's tokenizer is no byte-level one llguidance can read) comes back
    as one server's 400, nothing is left running, and the replica serves the next request."""
    routed_before = sum(sum(s.routes.values()) for s in affine.worker.snapshots())
    (bad,) = completions(affine.url, [words(1, 2, 3)], max_tokens=2, logprobs=None,
                         structured_outputs={"choice": ["alpha", "beta"]})
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["type"] == "invalid_request_error"
    (after,) = completions(affine.url, [words(4, 5, 6)], max_tokens=2)
    assert after.status_code == 200, after.text
    # both routes are published (the refused request's too), so later tests' route counts start from them
    deadline = time.monotonic() + 10
    while sum(sum(s.routes.values()) for s in affine.worker.snapshots()) < routed_before + 2:
        assert time.monotonic() < deadline, "the replicas did not publish the two requests' routes"
        time.sleep(0.05)
    totals = affine.totals()
    assert totals.get("num_running", 0) + totals.get("num_waiting", 0) == 0


def test_prompt_cache_key_routes_a_group_together(affine):
    """OpenAI's prompt_cache_key through HTTP: prompts of one group that share no checkpoint follow the group's
    replica ("cache_key" decisions), while a prompt without the key is routed by load alone ("unkeyed")."""
    before = {s.replica: dict(s.routes) for s in affine.worker.snapshots()}
    group = [words(*range(100 + i, 130 + i)) for i in range(4)]  # no shared prefix with anything pinned
    for prompt in group:  # one after another: each request sees the group's replica
        (response,) = completions(affine.url, [prompt], prompt_cache_key="session-7", max_tokens=1)
        assert response.status_code == 200, response.text
    (response,) = completions(affine.url, [words(*range(60, 90))], max_tokens=1)
    assert response.status_code == 200, response.text
    deadline = time.monotonic() + 10
    while True:
        added = {s.replica: {d: n - before[s.replica].get(d, 0) for d, n in s.routes.items()}
                 for s in affine.worker.snapshots()}
        if sum(sum(a.values()) for a in added.values()) >= 5 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert sum(a["cache_key"] for a in added.values()) == 3
    assert sum(a["unkeyed"] for a in added.values()) == 2  # the group's first request and the one without a key
    (home,) = [r for r, a in added.items() if a["cache_key"]]  # all three followers on one replica
    assert added[home]["cache_key"] == 3


def test_chat_turns_follow_their_session_and_reuse_its_history(affine):
    """Chat sessions through the replicas: each turn's boundary is checkpointed on the replica that served it
    and its key pinned there, so the next turn (the reply sent back as other text, as a client that edits it)
    goes to that replica and reuses all of its history but the assistant header."""
    before = affine.totals()
    routes_before = {s.replica: dict(s.routes) for s in affine.worker.snapshots()}
    sessions = [[{"role": "system", "content": token_words(300 + s, 40)},
                 {"role": "user", "content": token_words(310 + s, 12)}] for s in range(2)]
    previous: list[list[int] | None] = [None, None]
    sent = 0
    for turn in range(3):
        for s, messages in enumerate(sessions):
            response = httpx.post(f"{affine.url}/v1/chat/completions", timeout=120, json={
                "model": "tiny", "messages": messages, "max_tokens": 3, "temperature": 0})
            assert response.status_code == 200, response.text
            ids = httpx.post(f"{affine.url}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
            cached = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            sent += response.json()["usage"]["prompt_tokens"]
            if previous[s] is not None:
                shared = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(previous[s], ids)))
                assert shared - 2 <= cached <= shared, (s, turn)
            previous[s] = ids
            messages += [{"role": "assistant", "content": token_words(320 + 10 * s + turn, 3)},
                         {"role": "user", "content": token_words(340 + 10 * s + turn, 5)}]
    snaps = affine.snapshots(before.get("prompt_tokens_total", 0) + sent)
    added = {d: sum(x.routes.get(d, 0) - routes_before.get(x.replica, {}).get(d, 0) for x in snaps.values())
             for d in ("new", "affine", "load", "unkeyed")}
    assert added == {"new": 2, "affine": 4, "load": 0, "unkeyed": 0}
    hits = aggregate_metrics(snaps.values())["checkpoint_hits_chat_turn"] - before.get("checkpoint_hits_chat_turn", 0)
    assert hits == 4


def test_a_replica_killed_mid_run_leaves_no_request_hanging(affine):
    _, prompts, _, _ = one_to_n(10, 7)
    before = {s.replica: s.routes["new"] for s in affine.worker.snapshots()}

    async def main():
        async with httpx.AsyncClient(base_url=affine.url, timeout=90) as client:
            body = {"model": "tiny", "temperature": 0, "ignore_eos": True}
            async with client.stream("POST", "/v1/completions", json={
                    **body, "prompt": prompts[0], "max_tokens": 400, "stream": True}) as stream:
                lines = stream.aiter_lines()
                while not (await lines.__anext__()).startswith("data: {"):
                    pass  # the producer is streaming: its checkpoint exists, its replica is known
                others = [asyncio.ensure_future(client.post("/v1/completions", json={
                    **body, "prompt": q, "max_tokens": 200})) for q in prompts[1:]]
                await asyncio.sleep(0.3)
                victim = _replica_with_new_key(affine, before)
                os.kill(victim.pid, signal.SIGKILL)
                started = time.monotonic()
                rest = [line async for line in lines]
                results = await asyncio.wait_for(asyncio.gather(*others), timeout=60)
                return rest, results, time.monotonic() - started

    rest, results, elapsed = asyncio.run(main())
    assert elapsed < 60
    events = [json.loads(line[6:]) for line in rest if line.startswith("data: {")]
    assert "error" in events[-1] and "failed" in events[-1]["error"]["message"]  # streamed: a clear error
    assert [line for line in rest if line][-1] == "data: [DONE]"
    for response in results:  # each consumer finished elsewhere (sent again) or failed clearly
        assert response.status_code in (200, 500), response.text
        if response.status_code == 200:
            assert response.json()["usage"]["completion_tokens"] == 200
        else:
            assert "failed" in response.json()["error"]["message"]
    # the survivor serves the anchor afterwards
    (after,) = completions(affine.url, [prompts[0]])
    assert after.status_code == 200


def _replica_with_new_key(served: Served, before: dict[str, int]) -> ReplicaSnapshot:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for snap in served.worker.snapshots():
            if snap.routes["new"] > before.get(snap.replica, 0):
                return snap
        time.sleep(0.05)
    raise AssertionError("no replica reported the producer")
