"""Block pool, state pool and checkpoint registry invariants."""

from __future__ import annotations

import pytest
import torch

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.checkpoints import CheckpointRegistry
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.cache.state_pool import RecurrentStateSpec, StatePool


def _spec(conv_dim: int, width: int, heads: int, k: int, v: int) -> RecurrentStateSpec:
    """A GDN-shaped state: conv [conv_dim, width - 1], SSM [heads, k, v], float32."""
    return RecurrentStateSpec((conv_dim, width - 1), torch.float32, (heads, k, v))


def test_state_pool_takes_any_mixer_declaration():
    spec = RecurrentStateSpec((20, 3), torch.bfloat16, (4, 8, 6))  # Mamba2: [H, P, N]
    pool = StatePool(3, 2, 5, spec, torch.device("cpu"))
    # rows: zero, 3 requests, 2 checkpoints, scratch
    assert pool.conv_stack.shape == (5, 7, 20, 3) and pool.conv_stack.dtype == torch.bfloat16
    assert pool.ssm_stack.shape == (5, 7, 4, 8, 6) and pool.ssm_stack.dtype == torch.float32
    assert pool.scratch_slot == 6
    assert StatePool.bytes_per_slot(5, spec) == 5 * (20 * 3 * 2 + 4 * 8 * 6 * 4)
    pool.check_integrity()


def test_block_pool_refcounts_and_integrity():
    pool = BlockPool(6, 4, 1, 2, 8, torch.float32, torch.device("cpu"))
    a = pool.allocate(3)
    pool.incref(a[:2])
    pool.check_integrity({a[0]: 2, a[1]: 2, a[2]: 1})
    pool.release(a)
    assert pool.num_free == 4
    pool.release(a[:2])
    assert pool.num_free == 6
    pool.check_integrity({})
    # the scratch block sits after the counted ones and is never handed out
    assert pool.scratch_block == 6 and pool.k[0].shape[0] == 7
    assert pool.scratch_block not in pool.allocate(6)
    pool.release(list(range(6)))
    with pytest.raises(MemoryError):
        pool.allocate(7)
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([0])


def test_state_pool_slots_and_zero_row():
    pool = StatePool(2, 1, 2, _spec(12, 4, 2, 4, 4), torch.device("cpu"))
    first, second = pool.requests.allocate(), pool.requests.allocate()
    assert {first, second} == {1, 2}
    with pytest.raises(MemoryError):
        pool.requests.allocate()
    assert pool.checkpoints.allocate() == 3
    pool.check_integrity()
    pool.ssm[0][0, 0, 0, 0] = 1.0
    with pytest.raises(AssertionError, match="zero state row"):
        pool.check_integrity()


def test_state_pool_layers_are_views_of_the_stacked_states():
    pool = StatePool(2, 1, 3, _spec(12, 4, 2, 4, 4), torch.device("cpu"))
    # rows: zero, 2 requests, 1 checkpoint, scratch
    assert pool.conv_stack.shape == (3, 5, 12, 3) and pool.ssm_stack.shape == (3, 5, 2, 4, 4)
    assert StatePool.bytes_per_slot(3, _spec(12, 4, 2, 4, 4)) * 5 == (
        pool.conv_stack.numel() * 4 + pool.ssm_stack.numel() * 4)  # memory as with per-layer tensors
    for layer in range(3):
        assert pool.conv[layer].is_contiguous() and pool.ssm[layer].is_contiguous()
        pool.conv[layer][1].fill_(layer + 1.0)
        pool.ssm[layer][2].fill_(layer + 5.0)
    # layer i's rows are rows i * S .. i * S + S - 1 of the flattened stacks
    flat_conv, flat_ssm = pool.conv_stack.flatten(0, 1), pool.ssm_stack.flatten(0, 1)
    assert [flat_conv[i * 5 + 1, 0, 0].item() for i in range(3)] == [1.0, 2.0, 3.0]
    assert [flat_ssm[i * 5 + 2, 0, 0, 0].item() for i in range(3)] == [5.0, 6.0, 7.0]
    pool.check_integrity()
    pool.conv_stack[2, 0, 5, 1] = 1.0  # layer 2's zero row, through the stack
    with pytest.raises(AssertionError, match="zero state row"):
        pool.check_integrity()
    pool.conv_stack[2, 0].zero_()
    pool.ssm[1] = pool.ssm[1].clone()  # a layer no longer in the stack
    with pytest.raises(AssertionError, match="no longer views"):
        pool.check_integrity()


def test_registry_lru_eviction_skips_pinned_and_unready():
    blocks = BlockPool(8, 4, 1, 1, 4, torch.float32, torch.device("cpu"))
    states = StatePool(1, 2, 1, _spec(4, 4, 1, 2, 2), torch.device("cpu"))
    registry = CheckpointRegistry(states.checkpoints, blocks)
    owned = blocks.allocate(2)
    first = registry.register(b"a", 5, "p", 0.0)
    registry.mark_ready(first, owned)
    second = registry.register(b"b", 6, "p", 0.0)
    assert registry.register(b"c", 7, "p", 0.0) is not None  # evicts the idle ready "a"
    assert registry.get(b"a") is None and registry.num_evicted == 1
    registry.mark_ready(second, owned)
    registry.pin(second, 6)
    assert registry.register(b"d", 8, "p", 0.0) is None  # b pinned, c unready: nothing to evict
    registry.check_integrity(readers={b"b": 1}, waiters={}, producers={b"c": "p"}, reserved={})
    with pytest.raises(AssertionError, match="pins but 0 live readers"):
        registry.check_integrity(readers={}, waiters={}, producers={b"c": "p"}, reserved={})
    registry.unpin(second)
    blocks.release(owned)
    blocks.check_integrity({b: c for b, c in registry.block_refs().items()})


def test_prefix_hashes_are_exact_and_chain():
    tokens = list(range(40))
    hasher = PrefixHasher(tokens, 16)
    assert len({hasher.prefix_hash(n) for n in range(1, 41)}) == 40
    assert hasher.prefix_hash(20) == PrefixHasher(tokens[:20] + [99] * 5, 16).prefix_hash(20)
    assert hasher.prefix_hash(20) != PrefixHasher([1] + tokens[1:], 16).prefix_hash(20)
