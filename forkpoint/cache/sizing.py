"""Sizing of the KV block pool and the recurrent state pool, from the model's declarations.

The model declares what one sequence needs (`PoolShapes`: its attention layers' KV shape and its
recurrent layers' `RecurrentStateSpec`); the engine's knobs (`EngineConfig`) bound the memory. On
CPU the pools take at most `kv_cache_bytes` / `state_cache_bytes` (capped further below); on CUDA,
`gpu_memory_utilization` of the memory free after the weights (minus what the caller reserves) is
split: states first (one slot per running sequence and per checkpoint), the rest for KV blocks.
Byte counts come from the declarations alone (dtypes are read for their `itemsize`); the caller
that owns the device says how much memory is free (runner/storage.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.state_pool import RecurrentStateSpec, StatePool

if TYPE_CHECKING:
    import torch

    from forkpoint.config import EngineConfig

CPU_KV_BYTES = 256 << 20
CPU_STATE_BYTES = 512 << 20
DEFAULT_CHECKPOINT_SLOTS = 64


@dataclass(frozen=True)
class PoolShapes:
    """What the model's layers store per sequence.

    num_attention_layers layers of KV [num_kv_heads, head_dim] per token in `kv_dtype`;
    num_recurrent_layers layers of one `state` row each per sequence and per checkpoint.
    """

    num_attention_layers: int
    num_kv_heads: int
    head_dim: int
    kv_dtype: torch.dtype
    num_recurrent_layers: int
    state: RecurrentStateSpec

    @property
    def slot_bytes(self) -> int:
        """One state row over every recurrent layer."""
        return StatePool.bytes_per_slot(self.num_recurrent_layers, self.state)

    def block_bytes(self, block_size: int) -> int:
        """K and V of one block over every attention layer."""
        return BlockPool.bytes_per_block(block_size, self.num_attention_layers, self.num_kv_heads, self.head_dim,
                                         self.kv_dtype)


@dataclass(frozen=True)
class PoolSizes:
    """Result of `plan_pools`: rows and blocks of the two pools."""

    num_kv_blocks: int
    num_request_slots: int
    num_checkpoint_slots: int


def plan_pools(config: EngineConfig, shapes: PoolShapes, max_model_len: int, free_device_bytes: int | None,
               reserved_bytes: int = 0) -> PoolSizes:
    """Sizes within the budget. `free_device_bytes`: the memory free on a CUDA device after the
    weights (None on the CPU); `reserved_bytes` (CUDA only) is set aside from the usable memory for
    caches that fill later on the device (the image embedding cache)."""
    per_block = BlockPool.bytes_per_block(config.block_size, max(shapes.num_attention_layers, 1), shapes.num_kv_heads,
                                          shapes.head_dim, shapes.kv_dtype)
    per_slot = shapes.slot_bytes
    checkpoint_slots = 0
    if config.enable_checkpoints:
        checkpoint_slots = config.checkpoint_pool_size or DEFAULT_CHECKPOINT_SLOTS
    kv_bytes, state_bytes = config.kv_cache_bytes, config.state_cache_bytes
    if free_device_bytes is None:
        kv_bytes, state_bytes = min(kv_bytes, CPU_KV_BYTES), min(state_bytes, CPU_STATE_BYTES)
    else:
        free = free_device_bytes
        usable = int(free * config.gpu_memory_utilization) - reserved_bytes
        if usable <= 0:
            raise ValueError(
                f"no GPU memory left for the KV and state pools: {free >> 20} MiB free after the weights, "
                f"times gpu_memory_utilization {config.gpu_memory_utilization}, minus {reserved_bytes >> 20} MiB "
                "reserved (the image embedding cache): lower image_embedding_cache_bytes or raise "
                "gpu_memory_utilization")
        state_bytes = min(usable // 2, per_slot * (config.max_num_seqs + checkpoint_slots))
        kv_bytes = usable - state_bytes
    request_slots = config.num_state_slots or max(1, min(config.max_num_seqs,
                                                         state_bytes // max(per_slot, 1) - checkpoint_slots))
    num_blocks = config.num_kv_blocks or max(1, min(kv_bytes // per_block,
                                                    request_slots * -(-max_model_len // config.block_size)))
    return PoolSizes(num_blocks, request_slots, checkpoint_slots)


def pools_of_sizes(sizes: PoolSizes, block_size: int) -> tuple[BlockPool, StatePool]:
    """The bookkeeping of the two pools with the given sizes."""
    return BlockPool(sizes.num_kv_blocks, block_size), StatePool(sizes.num_request_slots, sizes.num_checkpoint_slots)
