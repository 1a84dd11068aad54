"""The /v1/responses store (forkpoint/server/response_store.py): bounded in bytes, least recently
used dropped first, entries keyed by tenant so that one tenant never reads another's."""

from __future__ import annotations

import pytest

from forkpoint.server.response_store import ResponseStore, StoredResponse


def entry(text: str) -> StoredResponse:
    return StoredResponse.of([{"role": "user", "content": text}], {"id": "resp", "output": [text]})


def test_an_entry_counts_the_json_of_its_messages_and_response():
    small, large = entry("a"), entry("a" * 1000)
    assert large.nbytes - small.nbytes == 2 * 999
    assert entry("é").nbytes - small.nbytes == 2  # bytes of UTF-8, not characters


def test_least_recently_used_is_dropped_to_stay_within_the_bound():
    size = entry("x").nbytes
    store = ResponseStore(3 * size)
    for name in "abc":
        assert store.put("t", name, entry("x"))
    assert store.get("t", "a") is not None  # a is now the most recently used: b is the oldest
    assert store.put("t", "d", entry("x"))
    assert [store.get("t", name) is not None for name in "abcd"] == [True, False, True, True]
    assert store.used_bytes == 3 * size and len(store) == 3
    store.check_integrity()


def test_a_large_entry_drops_as_many_as_it_needs_and_one_larger_than_the_bound_is_not_kept():
    size = entry("x").nbytes
    store = ResponseStore(4 * size)
    for name in "abcd":
        store.put("t", name, entry("x"))
    big = entry("x" * (1 + 3 * size // 4))  # 2.5 small entries' bytes: three of the four must go
    assert 2 * size < big.nbytes < 3 * size
    assert store.put("t", "big", big)
    assert [store.get("t", name) is not None for name in "abcd"] == [False, False, False, True]
    assert not store.put("t", "huge", entry("x" * 4 * size))
    assert store.get("t", "huge") is None and store.get("t", "big") is big
    store.check_integrity()


def test_tenants_never_read_or_delete_each_others_entries():
    store = ResponseStore(10_000)
    alice = entry("alice's secret")
    store.put("alice", "resp_1", alice)
    assert store.get("mallory", "resp_1") is None
    assert not store.delete("mallory", "resp_1")
    assert store.get("alice", "resp_1") is alice
    store.put("mallory", "resp_1", entry("mallory's"))  # the same id under another tenant: its own entry
    assert store.get("alice", "resp_1") is alice
    assert store.delete("alice", "resp_1") and store.get("alice", "resp_1") is None
    assert store.get("mallory", "resp_1") is not None
    store.check_integrity()


def test_putting_an_id_again_replaces_it():
    store = ResponseStore(10_000)
    store.put("t", "r", entry("one"))
    second = entry("two, longer")
    store.put("t", "r", second)
    assert len(store) == 1 and store.get("t", "r") is second and store.used_bytes == second.nbytes
    store.check_integrity()


def test_zero_bytes_is_no_store():
    store = ResponseStore(0)
    assert not store.enabled
    assert not store.put("t", "r", entry("x"))
    assert store.get("t", "r") is None and len(store) == 0
    with pytest.raises(ValueError, match="max_bytes must be >= 0"):
        ResponseStore(-1)
