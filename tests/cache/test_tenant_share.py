"""Per-tenant shares of the checkpoint pool (cache/eviction.py, "Tenants"): a client that floods
unique prefixes evicts its own checkpoints, not everyone else's; with one tenant the order is the
plain value policy's. Registry alone (no model, no scheduler)."""

from __future__ import annotations

import pytest

from forkpoint.cache.checkpoint_types import CheckpointKind
from tests.cache.test_eviction import _Pools

SLOTS = 8


def _ready(pools: _Pools, key: bytes, owner: str, kind: CheckpointKind = CheckpointKind.MARKER):
    checkpoint = pools.registry.register(key, 64, f"req-{key.decode()}", 0.0, kind, owner=owner)
    if checkpoint is not None:
        blocks = pools.blocks.allocate(4)
        pools.registry.mark_ready(checkpoint, blocks)
        pools.blocks.release(blocks)
    return checkpoint


@pytest.mark.parametrize("kind", [CheckpointKind.MARKER, CheckpointKind.SHARED_PREFIX])
def test_a_flooding_tenant_evicts_its_own_checkpoints(kind):
    pools = _Pools(SLOTS)
    victims = [f"victim-{i}".encode() for i in range(3)]
    for key in victims:
        _ready(pools, key, "victim", kind)
    for i in range(100):  # far more unique prefixes than the pool has slots
        assert _ready(pools, f"flood-{i}".encode(), "flood", kind) is not None
        pools.check()
    assert all(pools.registry.get(key) is not None for key in victims)
    held = [c.owner for c in pools.registry]
    assert held.count("flood") == SLOTS - 3 and pools.registry.eviction.fair_share("flood") == SLOTS // 2
    assert {c.key for c in pools.registry if c.owner == "flood"} == {f"flood-{i}".encode() for i in range(95, 100)}


def test_without_tenants_the_flood_evicts_everyone():
    """The same flood under one tenant (the old behaviour, and still the offline engine's): the
    victim's checkpoints go, least recently used first."""
    pools = _Pools(SLOTS)
    for i in range(3):
        _ready(pools, f"victim-{i}".encode(), "")
    for i in range(100):
        _ready(pools, f"flood-{i}".encode(), "")
    assert all(pools.registry.get(f"victim-{i}".encode()) is None for i in range(3))


def test_a_tenant_at_its_share_with_nothing_of_its_own_idle_misses():
    """At its share, with every one of its checkpoints pinned, a tenant registers nothing rather than
    evict another tenant's idle checkpoint; an under-share tenant may still evict over-share ones."""
    pools = _Pools(SLOTS)
    for i in range(4):
        _ready(pools, f"other-{i}".encode(), "other")
    pinned = [_ready(pools, f"flood-{i}".encode(), "flood") for i in range(4)]
    for checkpoint in pinned:
        pools.registry.pin(checkpoint, checkpoint.num_tokens)
    assert pools.registry.register(b"flood-new", 64, "req", 0.0, owner="flood") is None
    assert all(pools.registry.get(f"other-{i}".encode()) is not None for i in range(4))
    for checkpoint in pinned:
        pools.registry.unpin(checkpoint)
    pools.check()


def test_over_share_tenants_are_evicted_first_under_memory_pressure():
    """`evict_one()` (the scheduler's, when KV blocks run out) takes an over-share tenant's
    checkpoints before a fair tenant's, even the fair tenant's least recently used one, which the
    plain order would take first."""
    pools = _Pools(SLOTS)
    _ready(pools, b"late-0", "late")  # the least recently used of all
    for i in range(SLOTS - 1):
        _ready(pools, f"early-{i}".encode(), "early")  # 7 of 8: over its share of 4
    while sum(c.owner == "early" for c in pools.registry) > SLOTS // 2:
        assert pools.registry.evict_one()
        assert pools.registry.get(b"late-0") is not None
        pools.check()
    assert pools.registry.evict_one() and pools.registry.get(b"late-0") is None  # then the plain order
