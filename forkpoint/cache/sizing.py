"""Sizing of the KV block pool and the recurrent state pool from one memory budget.

The model declares what one sequence needs (`PoolShapes`: its attention layers' KV shape and its
recurrent layers' `RecurrentStateSpec`); the engine's knobs (`EngineConfig`) bound the memory. Byte
counts come from the declarations alone (dtypes are read for their `itemsize`); the caller that owns
the device says how much memory is free (runner/storage.py).

One budget, three consumers (request state rows, checkpoint state rows, KV blocks)::

    budget              CUDA: gpu_memory_utilization x (memory free after the weights) - reserved;
                        CPU: min(state_cache_bytes, CPU_STATE_BYTES) for the rows and
                        min(kv_cache_bytes, CPU_KV_BYTES) for the blocks (the CPU keeps two caps)
    R  request rows     max_num_seqs, within REQUEST_STATE_MAX_SHARE of the budget (num_state_slots
                        overrides)
    C  checkpoint rows  CHECKPOINT_SHARE of what the request rows leave (on the CPU, of the state
                        budget), at most MAX_CHECKPOINTS_PER_REQUEST_ROW x R (checkpoint_pool_size
                        overrides)
    KV blocks           the rest, at most R full-length sequences' blocks (num_kv_blocks overrides)

Why half of what requests leave: a conversation's reusable memory is its checkpoint rows (one state
row each: 61 MiB at Qwen3.5-35B-A3B shapes) plus the KV blocks of its prefix (20 KiB per token
there, shared by its checkpoints), so at agent-sized prefixes (a few thousand tokens, two or three
checkpoints per session) the rows and the blocks weigh about the same. At 35B shapes with 77.9 GB
free after the weights (an H200: the free memory behind the 139,099 KV blocks measured with 64
constant rows) that is 385 checkpoint rows and 76,022 KV blocks (1.2M tokens) next to 256 request
rows (tests/cache/test_sizing.py).

Elasticity today is in the bookkeeping: KV blocks are shared by running requests and READY
checkpoints (a checkpoint holds references on its prefix's blocks), and under KV pressure the
scheduler evicts idle checkpoints (value order, cache/eviction.py) until the blocks it needs are
free, so checkpoints use whatever KV the running requests leave and give it back on demand. The row
count C is fixed at start-up. The next step, byte-level elasticity, is one arena: KV pages and state
rows carved from a single device buffer in page units (a 61 MiB state row is 196 KV blocks of
320 KiB at 35B shapes), so that rows and blocks convert into each other at run time, an idle
checkpoint's row becoming blocks under KV pressure and free blocks becoming rows when checkpoints
need them. It needs the kernels to address state rows through a row table (today a row is an index
into the contiguous `[L, rows, ...]` stacks of runner/storage.py, which the CUDA graphs capture) and
is not done yet.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.state_pool import RecurrentStateSpec, StatePool

if TYPE_CHECKING:
    import torch

    from forkpoint.config import EngineConfig

CPU_KV_BYTES = 256 << 20
CPU_STATE_BYTES = 512 << 20
REQUEST_STATE_MAX_SHARE = 0.5  # request rows take at most this share of the budget
CHECKPOINT_SHARE = 0.5  # checkpoint rows' share of what the request rows leave (see above)
# a bound for small models, whose budget would give millions of rows (bookkeeping lists and a
# [L, rows, ...] stack that size are no use): 8 checkpoints per request row
MAX_CHECKPOINTS_PER_REQUEST_ROW = 8
# the host tier when checkpoint_host_bytes is not given: a quarter of the machine's memory, at most
# 64 GiB, split over the tensor-parallel ranks; none on a machine under 16 GiB or on the CPU
HOST_TIER_RAM_SHARE = 0.25
HOST_TIER_MAX_BYTES = 64 << 30
HOST_TIER_MIN_RAM_BYTES = 16 << 30
# the disk tier when checkpoint_dir_bytes is not given: a quarter of the space it may use, the file
# system's free space plus what the checkpoint directory already holds
DISK_TIER_SPACE_SHARE = 0.25


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
    """Sizes within one budget (the module docstring). `free_device_bytes`: the memory free on a CUDA
    device after the weights (None on the CPU); `reserved_bytes` (CUDA only) is set aside from the
    usable memory for caches that fill later on the device (the image embedding cache)."""
    per_block = BlockPool.bytes_per_block(config.block_size, max(shapes.num_attention_layers, 1), shapes.num_kv_heads,
                                          shapes.head_dim, shapes.kv_dtype)
    per_slot = max(shapes.slot_bytes, 1)
    if free_device_bytes is None:
        state_bytes = min(config.state_cache_bytes, CPU_STATE_BYTES)
        request_slots = _request_slots(config, state_bytes, per_slot)
        checkpoint_slots = _checkpoint_slots(config, state_bytes - request_slots * per_slot, per_slot, request_slots)
        kv_bytes = min(config.kv_cache_bytes, CPU_KV_BYTES)
    else:
        usable = int(free_device_bytes * config.gpu_memory_utilization) - reserved_bytes
        if usable <= 0:
            raise ValueError(
                f"no GPU memory left for the KV and state pools: {free_device_bytes >> 20} MiB free after the "
                f"weights, times gpu_memory_utilization {config.gpu_memory_utilization}, minus "
                f"{reserved_bytes >> 20} MiB reserved (the image embedding cache): lower "
                "image_embedding_cache_bytes or raise gpu_memory_utilization")
        request_slots = _request_slots(config, usable, per_slot)
        rest = usable - request_slots * per_slot
        checkpoint_slots = _checkpoint_slots(config, rest, per_slot, request_slots)
        kv_bytes = rest - checkpoint_slots * per_slot
        if kv_bytes < per_block and config.num_kv_blocks is None:
            raise ValueError(
                f"no GPU memory left for KV blocks: {usable >> 20} MiB usable, {request_slots} request state rows "
                f"and {checkpoint_slots} checkpoint rows of {per_slot >> 20} MiB take it all: lower max_num_seqs, "
                "num_state_slots or checkpoint_pool_size, or raise gpu_memory_utilization")
    num_blocks = config.num_kv_blocks or max(1, min(kv_bytes // per_block,
                                                    request_slots * -(-max_model_len // config.block_size)))
    return PoolSizes(num_blocks, request_slots, checkpoint_slots)


def _request_slots(config: EngineConfig, budget: int, per_slot: int) -> int:
    """Request rows: num_state_slots, else a row per sequence (max_num_seqs) and, with speculative
    decoding, k spare rows per sequence for its verifications (engine/speculative.py: one row per
    verified draft), within REQUEST_STATE_MAX_SHARE of `budget` (fewer: a verification that finds no
    spare rows decodes plainly)."""
    if config.num_state_slots is not None:
        return config.num_state_slots
    spares = config.speculative_config.num_speculative_tokens if config.speculative_config is not None else 0
    return max(1, min(config.max_num_seqs * (1 + spares), int(budget * REQUEST_STATE_MAX_SHARE) // per_slot))


def _checkpoint_slots(config: EngineConfig, left: int, per_slot: int, request_slots: int) -> int:
    """Checkpoint rows: 0 without checkpoints, checkpoint_pool_size when given, else CHECKPOINT_SHARE
    of the `left` bytes (at least one row, at most MAX_CHECKPOINTS_PER_REQUEST_ROW per request row)."""
    if not config.enable_checkpoints:
        return 0
    if config.checkpoint_pool_size is not None:
        return config.checkpoint_pool_size
    share = int(max(left, 0) * CHECKPOINT_SHARE) // per_slot
    return max(1, min(share, MAX_CHECKPOINTS_PER_REQUEST_ROW * request_slots))


def pools_of_sizes(sizes: PoolSizes, block_size: int) -> tuple[BlockPool, StatePool]:
    """The bookkeeping of the two pools with the given sizes."""
    return BlockPool(sizes.num_kv_blocks, block_size), StatePool(sizes.num_request_slots, sizes.num_checkpoint_slots)


def default_host_tier_bytes(ram_bytes: int, on_cuda: bool, tensor_parallel_size: int = 1) -> int:
    """The host tier of one rank when the user gives no `checkpoint_host_bytes` (module constants):
    HOST_TIER_RAM_SHARE of `ram_bytes`, at most HOST_TIER_MAX_BYTES, over `tensor_parallel_size`
    ranks (each rank keeps a tier for its shards). 0 on the CPU: the device pools are host memory
    there, so a tier would copy rows within the same memory (a larger `checkpoint_pool_size` keeps
    more for free), and CPU engines (the tests) stay deterministic and small. 0 under
    HOST_TIER_MIN_RAM_BYTES: a small machine needs its memory for loading weights."""
    if not on_cuda or ram_bytes < HOST_TIER_MIN_RAM_BYTES:
        return 0
    return min(int(ram_bytes * HOST_TIER_RAM_SHARE), HOST_TIER_MAX_BYTES) // tensor_parallel_size


def default_disk_tier_bytes(root: Path) -> int:
    """The disk tier's bound when the user gives no `checkpoint_dir_bytes`: DISK_TIER_SPACE_SHARE of
    the file system's free space plus the bytes of the files already under `root`. Those are the
    tier's own from earlier runs: counted as free, a restart would shrink the bound by what the tier
    wrote and evict its oldest files, the most shared prefixes (a system prompt's checkpoint is
    written first). `root` need not exist yet (its nearest existing parent's file system counts)."""
    held = 0
    if root.is_dir():
        for path in root.rglob("*"):
            try:
                if path.is_file():
                    held += path.stat().st_size
            except OSError:  # a file removed while we walk
                continue
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return int((shutil.disk_usage(probe).free + held) * DISK_TIER_SPACE_SHARE)


def physical_memory_bytes(cgroup_root: Path = Path("/sys/fs/cgroup")) -> int:
    """This machine's memory: the physical pages, or less where a cgroup (v2 `memory.max`, v1
    `memory/memory.limit_in_bytes`) limits this process's container."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for limit_file in (cgroup_root / "memory.max", cgroup_root / "memory" / "memory.limit_in_bytes"):
        try:
            text = limit_file.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            physical = min(physical, int(text))
    return physical
