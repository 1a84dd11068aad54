"""The checkpoint-affinity policy on its own (no Ray): decisions, pins, reports, membership."""

from __future__ import annotations

import pytest

from forkpoint.server.replicas.router import CheckpointAffinityPolicy, Decision, held_keys
from forkpoint.server.replicas.routing_keys import RequestKeys

ANCHOR = list(range(100, 120))  # 20 tokens
OTHER = list(range(200, 230))


def keys(ids, *positions):
    return RequestKeys(ids, positions, block_size=4)


def consumer(i, *, marker=True, anchor=ANCHOR):
    return keys(anchor + [10 + i, 11 + i], *([len(anchor)] if marker else []))


@pytest.fixture
def policy():
    p = CheckpointAffinityPolicy(balance_abs_threshold=4, balance_rel_threshold=1.5, pin_ttl_s=10.0)
    yield p
    p.check_integrity()


def test_new_key_goes_to_least_loaded_and_its_consumers_follow(policy):
    first = policy.choose(consumer(0), {"a": 3, "b": 1}, now=0.0)
    assert first.replica == "b" and first.decision is Decision.NEW
    for i in range(1, 8):  # consumers follow the pin although "a" is less loaded
        choice = policy.choose(consumer(i), {"a": 0, "b": 4}, now=0.1)
        assert (choice.replica, choice.decision) == ("b", Decision.AFFINE)
    # a consumer without a marker is found through the pinned length
    assert policy.choose(consumer(9, marker=False), {"a": 0, "b": 3}, now=0.2).decision is Decision.AFFINE
    assert policy.pinned() == {consumer(0).own[0].key: "b"}


def test_overloaded_replica_falls_back_to_load_within_bounds(policy):
    policy.choose(consumer(0), {"a": 0, "b": 0}, now=0.0)  # pinned to "a" (tie: by name)
    # imbalance 4 is within the absolute bound: still affine
    assert policy.choose(consumer(1), {"a": 4, "b": 0}, now=0.1).decision is Decision.AFFINE
    # 5 over the least loaded and more than 1.5x: load fallback, the pin stays
    choice = policy.choose(consumer(2), {"a": 5, "b": 0}, now=0.2)
    assert (choice.replica, choice.decision) == ("b", Decision.LOAD)
    # relative bound: 12 vs 9 is 3 over but not 1.5x; 20 vs 9 is 11 over and > 1.5x
    assert policy.choose(consumer(3), {"a": 12, "b": 9}, now=0.3).decision is Decision.AFFINE
    assert policy.choose(consumer(4), {"a": 20, "b": 9}, now=0.4).decision is Decision.LOAD
    assert set(policy.pinned().values()) == {"a"}
    # once "b" reports the key too (its fallback consumer produced it), the least loaded holder wins
    policy.observe("b", frozenset({consumer(0).own[0].key}), now=0.5)
    assert policy.choose(consumer(5), {"a": 3, "b": 1}, now=0.6) == policy.choose(consumer(6), {"a": 3, "b": 1}, 0.6)
    assert policy.choose(consumer(7), {"a": 3, "b": 1}, now=0.6).replica == "b"


def test_longest_prefix_wins_and_nested_keys_are_pinned_with_it(policy):
    system = ANCHOR[:8]
    policy.choose(keys(system + [1, 2], 8), {"a": 0, "b": 1}, now=0.0)  # 8-token key on "a"
    policy.choose(keys(ANCHOR + [3], 20), {"a": 1, "b": 0}, now=0.0)    # 20-token key: its prefix is on "a"
    assert set(policy.pinned().values()) == {"a"}
    other = policy.choose(keys(system + OTHER, 8, 30), {"a": 1, "b": 0}, now=0.0)
    assert other == policy.choose(keys(system + OTHER + [5]), {"a": 1, "b": 0}, now=0.0)
    assert other.replica == "a" and other.decision is Decision.AFFINE
    assert len(policy.pinned("a")) == 3


def test_requests_without_keys_go_to_least_loaded(policy):
    assert policy.choose(keys(OTHER), {"a": 2, "b": 1}, now=0.0).decision is Decision.UNKEYED
    assert policy.choose(None, {"a": 0, "b": 1}, now=0.0).replica == "a"
    with pytest.raises(ValueError, match="no live replica"):
        policy.choose(consumer(0), {}, now=0.0)


def test_pins_are_confirmed_then_dropped_on_eviction(policy):
    key = consumer(0).own[0].key
    policy.choose(consumer(0), {"a": 0, "b": 1}, now=0.0)
    policy.observe("a", frozenset(), now=1.0)  # not produced yet: the pin stays
    assert policy.pinned() == {key: "a"}
    policy.observe("a", frozenset({key}), now=2.0)
    policy.observe("b", frozenset(), now=2.0)  # another replica's report leaves the pin alone
    assert policy.pinned() == {key: "a"}
    policy.observe("a", frozenset(), now=3.0)  # evicted
    assert policy.pinned() == {} and policy.unpinned["evicted"] == 1
    assert policy.choose(consumer(1), {"a": 5, "b": 0}, now=4.0) .decision is Decision.NEW


def test_unconfirmed_pins_expire_unless_traffic_refreshes_them(policy):
    policy.choose(consumer(0), {"a": 0, "b": 1}, now=0.0)
    policy.choose(consumer(1), {"a": 1, "b": 1}, now=8.0)  # a consumer refreshes the pin
    policy.observe("a", frozenset(), now=15.0)
    assert len(policy.pinned()) == 1
    policy.observe("a", frozenset(), now=18.5)
    assert policy.pinned() == {} and policy.unpinned["expired"] == 1


def test_pins_of_a_gone_replica_move(policy):
    policy.choose(consumer(0), {"a": 0, "b": 1}, now=0.0)
    policy.observe("a", frozenset({consumer(0).own[0].key}), now=1.0)
    # the dead replica is still listed by an older report but not among the live loads
    choice = policy.choose(consumer(1), {"b": 2, "c": 0}, now=2.0)
    assert (choice.replica, choice.decision) == ("c", Decision.NEW)
    assert policy.pinned() == {consumer(0).own[0].key: "c"}
    policy.retain(["b"])
    assert policy.pinned() == {} and policy.unpinned["replica_gone"] == 1


def test_held_keys_read_the_routing_stats():
    assert held_keys({}) == frozenset()
    assert held_keys({"checkpoint_keys": ["00ff", "10"]}) == {b"\x00\xff", b"\x10"}


def test_bad_thresholds_are_rejected():
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        CheckpointAffinityPolicy(balance_rel_threshold=0.5)


def test_prompt_cache_key_groups_requests_without_checkpoints(policy):
    """OpenAI's prompt_cache_key: requests of one group follow each other when no checkpoint key decides,
    within the overload bound; a checkpoint key wins over the group; a gone replica drops the group."""
    first = policy.choose(None, {"a": 2, "b": 0}, now=0.0, cache_key="user-1")
    assert (first.replica, first.decision) == ("b", Decision.UNKEYED)
    follow = policy.choose(None, {"a": 0, "b": 3}, now=0.1, cache_key="user-1")
    assert (follow.replica, follow.decision) == ("b", Decision.CACHE_KEY)
    assert policy.choose(None, {"a": 0, "b": 3}, now=0.1, cache_key="user-2").replica == "a"
    assert policy.choose(None, {"a": 0, "b": 9}, now=0.2, cache_key="user-1").decision is Decision.LOAD
    # the group followed its last request to "a"; a pinned checkpoint on "b" wins over it
    policy.choose(consumer(0), {"a": 1, "b": 0}, now=0.3)  # the anchor's key pinned to "b"
    assert policy.choose(consumer(1), {"a": 0, "b": 1}, now=0.4, cache_key="user-1").decision is Decision.AFFINE
    policy.retain(["a"])  # the group had followed that request to "b", which left: routed afresh
    assert policy.choose(None, {"a": 0}, now=0.5, cache_key="user-1").decision is Decision.UNKEYED
