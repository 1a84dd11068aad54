"""The registry's restore-or-recompute decision (cache/checkpoints.py `restore_pays`, the rule of
cache/reuse_rule.py): on the registry alone, with a host tier, a disk tier's index, and rates given."""

from __future__ import annotations

from collections import Counter

import pytest

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoint_types import CacheMissReason, CheckpointKind
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.cache.disk_tier import DiskTier
from forkpoint.cache.host_tier import HostTier
from forkpoint.cache.reuse_rates import MeasuredCost, ReuseRates, StepCost
from forkpoint.cache.reuse_rule import Tier
from forkpoint.cache.state_pool import StatePool
from forkpoint.step.plan import Restore

SLOT, BLOCK = 1000, 100  # bytes of a state row and of a KV block: a 32-token host entry is 1000 + 2 * 100


def prefix_hash(length: int) -> bytes:
    return f"prefix-{length}".encode()


class _Registry:
    def __init__(self, rates: ReuseRates, disk: DiskTier | None = None, restore_rule: bool = True) -> None:
        self.blocks = BlockPool(64, 16)
        self.states = StatePool(1, 4)
        self.host = HostTier(1 << 20, SLOT, BLOCK)
        self.registry = CheckpointRegistry(self.states.checkpoints, self.blocks, self.host, disk, rates,
                                           restore_rule=restore_rule)

    def ready(self, length: int) -> None:
        checkpoint = self.registry.register(prefix_hash(length), length, "producer", 0.0, CheckpointKind.MARKER)
        blocks = self.blocks.allocate(-(-length // 16))
        self.registry.mark_ready(checkpoint, blocks)
        self.blocks.release(blocks)

    def check(self) -> None:
        self.registry.check_integrity(readers={}, waiters={}, producers={}, reserved={})
        self.blocks.check_integrity(Counter(self.registry.block_refs()))
        self.host.check_integrity()


def _spilled_32_over_device_16(rates: ReuseRates, **kwargs) -> _Registry:
    """A 32-token checkpoint in the host tier (1200 bytes), a 16-token one on the device."""
    pools = _Registry(rates, **kwargs)
    pools.ready(32)
    assert pools.registry.evict_one() and prefix_hash(32) in pools.host
    pools.ready(16)
    pools.registry.take_writes()  # the spill (a step's plan takes it)
    return pools


def _rates(prefill: float, host_restore: float) -> ReuseRates:
    return ReuseRates(step=StepCost.per_token_prior(prefill), host_restore=MeasuredCost(host_restore, 1.0))


def test_a_host_hit_that_costs_more_than_its_tokens_is_recomputed_from_the_device_checkpoint():
    # 1200 bytes at 1e-4 s/byte (0.12 s) against 16 tokens at 1e-3 s/token (0.016 s)
    pools = _spilled_32_over_device_16(_rates(prefill=1e-3, host_restore=1e-4))
    registry = pools.registry
    longest, ready = registry.lookup(prefix_hash, 100)
    assert longest is ready and ready.num_tokens == 16
    assert prefix_hash(32) in pools.host and registry.declined == Counter({Tier.HOST: 1})
    assert registry.take_writes()[1] == ()  # nothing moves
    assert registry.tier_miss(prefix_hash, 16, 100) is CacheMissReason.RECOMPUTE_FASTER
    assert registry.tier_miss(prefix_hash, 16, 32) is None  # (a prompt of 32 tokens could not have used it)
    assert registry.tier_miss(prefix_hash, 32, 100) is None
    pools.check()


def test_a_host_hit_that_pays_is_restored_and_its_decline_forgotten():
    rates = _rates(prefill=1e-3, host_restore=1e-4)
    pools = _spilled_32_over_device_16(rates)
    registry = pools.registry
    registry.lookup(prefix_hash, 100)  # declined (above)
    rates.host_restore = MeasuredCost(1e-6, 1.0)  # 1.2 ms against 16 ms
    longest, ready = registry.lookup(prefix_hash, 100)
    assert ready.num_tokens == 32 and prefix_hash(32) not in pools.host
    [write] = registry.take_writes()[1]
    assert isinstance(write, Restore)
    assert registry.tier_miss(prefix_hash, 16, 100) is None
    pools.check()


def test_the_tokens_saved_count_from_the_device_checkpoint_below():
    # 1200 bytes at 1e-5 s/byte: 12 ms to move. At 0.25 ms per token, over the 16-token checkpoint the 32-token
    # one saves 16 tokens, 4 ms (12 > 2 x 4: declined); a reader that may not read the 16-token one (accept)
    # saves 32 tokens, 8 ms (12 <= 2 x 8: restored)
    pools = _spilled_32_over_device_16(_rates(prefill=0.25e-3, host_restore=1e-5))
    registry = pools.registry
    _, ready = registry.lookup(prefix_hash, 100)
    assert ready.num_tokens == 16
    _, ready = registry.lookup(prefix_hash, 100, accept=lambda c: c.num_tokens != 16)
    assert ready.num_tokens == 32
    pools.check()


def test_the_rule_off_restores_every_hit():
    pools = _spilled_32_over_device_16(_rates(prefill=1e-3, host_restore=1e-4), restore_rule=False)
    _, ready = pools.registry.lookup(prefix_hash, 100)
    assert ready.num_tokens == 32 and not pools.registry.declined
    pools.check()


@pytest.mark.parametrize("disk_read, issued", [(1e-3, False), (1e-9, True)])
def test_a_disk_read_ahead_is_issued_only_when_it_pays(tmp_path, disk_read, issued):
    disk = DiskTier(tmp_path, b"identity".ljust(32, b"\0"), 1 << 20, SLOT, BLOCK, block_size=16)
    disk.save(prefix_hash(48), 48, 3)  # counted, never written: a read of it would find it missing
    rates = ReuseRates(step=StepCost.per_token_prior(1e-3), disk_read=MeasuredCost(disk_read, 1.0))
    pools = _Registry(rates, disk=disk)
    pools.ready(16)  # 32 tokens saved: 32 ms against ~1.3 s (declined) or ~1.3 us
    pools.registry.read_ahead(prefix_hash, 100)
    assert disk.counters.read_ahead == int(issued)
    assert pools.registry.declined[Tier.DISK] == int(not issued)
    expected = None if issued else CacheMissReason.RECOMPUTE_FASTER
    assert pools.registry.tier_miss(prefix_hash, 16, 100) is expected
    pools.check()
