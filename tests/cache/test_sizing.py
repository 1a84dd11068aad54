"""One memory budget: request rows, checkpoint rows and KV blocks sized together (cache/sizing.py), and
the host tier's default from the machine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forkpoint.cache.sizing import (
    HOST_TIER_MAX_BYTES,
    MAX_CHECKPOINTS_PER_REQUEST_ROW,
    PoolShapes,
    default_host_tier_bytes,
    physical_memory_bytes,
    plan_pools,
)
from forkpoint.cache.state_pool import RecurrentStateSpec
from forkpoint.config import EngineConfig

# Qwen3.5-35B-A3B (bench/e2e_gpu.py full_config): 30 Gated DeltaNet layers (conv [8192, 3] bf16, SSM
# [32, 128, 128] fp32), 10 attention layers of 2 KV heads x 256
SHAPES_35B = PoolShapes(10, 2, 256, torch.bfloat16, 30,
                        RecurrentStateSpec((8192, 3), torch.bfloat16, (32, 128, 128), torch.float32))
# the H200's free memory after the 35B weights: what the pools measured in issue 26 took (139,099 KV
# blocks next to 256 + 64 state rows) at gpu_memory_utilization 0.85
FREE_35B = int((139_099 * SHAPES_35B.block_bytes(16) + 320 * SHAPES_35B.slot_bytes) / 0.85) + 1
GiB = 1 << 30


def test_35b_on_an_h200_gets_hundreds_of_checkpoint_rows_from_the_budget():
    sizes = plan_pools(EngineConfig(), SHAPES_35B, 262_144, FREE_35B)
    assert SHAPES_35B.slot_bytes == 64_389_120 and SHAPES_35B.block_bytes(16) == 327_680
    assert sizes.num_request_slots == 256
    assert sizes.num_checkpoint_slots == 385  # half of what the request rows leave
    assert sizes.num_kv_blocks == 76_022  # 1.2M tokens: the 32-session chat used 4,939 blocks
    used = ((sizes.num_request_slots + sizes.num_checkpoint_slots) * SHAPES_35B.slot_bytes
            + sizes.num_kv_blocks * SHAPES_35B.block_bytes(16))
    usable = int(FREE_35B * 0.85)
    assert usable - SHAPES_35B.block_bytes(16) < used <= usable  # one budget, all of it handed out


def test_the_explicit_pool_size_overrides_and_kv_takes_the_rest():
    sizes = plan_pools(EngineConfig(checkpoint_pool_size=64), SHAPES_35B, 262_144, FREE_35B)
    assert (sizes.num_checkpoint_slots, sizes.num_kv_blocks) == (64, 139_099)  # the measured pools
    off = plan_pools(EngineConfig(enable_checkpoints=False), SHAPES_35B, 262_144, FREE_35B)
    assert off.num_checkpoint_slots == 0 and off.num_kv_blocks > sizes.num_kv_blocks


def test_more_memory_more_checkpoint_rows():
    small, large = (plan_pools(EngineConfig(), SHAPES_35B, 262_144, free) for free in (40 * GiB, 120 * GiB))
    assert 0 < small.num_checkpoint_slots < large.num_checkpoint_slots
    assert small.num_kv_blocks < large.num_kv_blocks


def test_a_budget_too_small_for_kv_names_the_knobs():
    with pytest.raises(ValueError, match="no GPU memory left for KV blocks.*checkpoint_pool_size"):
        plan_pools(EngineConfig(checkpoint_pool_size=400), SHAPES_35B, 262_144, 40 * GiB)
    with pytest.raises(ValueError, match="no GPU memory left for the KV and state pools"):
        plan_pools(EngineConfig(), SHAPES_35B, 262_144, 1 << 20, reserved_bytes=1 << 30)


def test_small_models_are_bounded_per_request_row():
    tiny = PoolShapes(1, 2, 8, torch.float32, 3, RecurrentStateSpec((16, 3), torch.float32, (4, 8, 8), torch.float32))
    gpu = plan_pools(EngineConfig(max_num_seqs=4), tiny, 512, 80 * GiB)
    assert gpu.num_checkpoint_slots == MAX_CHECKPOINTS_PER_REQUEST_ROW * 4
    cpu = plan_pools(EngineConfig(max_num_seqs=4), tiny, 512, None)
    assert cpu.num_checkpoint_slots == MAX_CHECKPOINTS_PER_REQUEST_ROW * 4
    # a CPU state budget of a few rows: the request rows first, the checkpoints get what is left
    few = plan_pools(EngineConfig(max_num_seqs=4, state_cache_bytes=10 * tiny.slot_bytes), tiny, 512, None)
    assert (few.num_request_slots, few.num_checkpoint_slots) == (4, 3)


def test_host_tier_default_from_the_machine():
    assert default_host_tier_bytes(128 * GiB, on_cuda=True) == 32 * GiB  # a quarter of the memory
    assert default_host_tier_bytes(2048 * GiB, on_cuda=True) == HOST_TIER_MAX_BYTES
    assert default_host_tier_bytes(512 * GiB, on_cuda=True, tensor_parallel_size=4) == HOST_TIER_MAX_BYTES // 4
    assert default_host_tier_bytes(128 * GiB, on_cuda=False) == 0  # CPU pools are host memory already
    assert default_host_tier_bytes(8 * GiB, on_cuda=True) == 0  # a small machine keeps its memory


def test_physical_memory_reads_the_cgroup_limit(tmp_path: Path):
    unlimited = physical_memory_bytes(tmp_path)  # no limit files: the physical pages
    assert unlimited > 0
    (tmp_path / "memory.max").write_text("max\n")  # cgroup v2, no limit
    assert physical_memory_bytes(tmp_path) == unlimited
    (tmp_path / "memory.max").write_text(f"{4 * GiB}\n")
    assert physical_memory_bytes(tmp_path) == min(unlimited, 4 * GiB)
    (tmp_path / "memory.max").unlink()
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "memory.limit_in_bytes").write_text(f"{2 * GiB}\n")  # cgroup v1
    assert physical_memory_bytes(tmp_path) == min(unlimited, 2 * GiB)


def test_checkpoint_host_bytes_none_means_from_the_machine():
    assert EngineConfig().checkpoint_host_bytes is None
    assert EngineConfig(checkpoint_host_bytes=0).checkpoint_host_bytes == 0
    with pytest.raises(ValueError, match="checkpoint_host_bytes must be >= 0"):
        EngineConfig(checkpoint_host_bytes=-1)


def test_default_disk_tier_bytes_counts_the_directorys_own_files_as_space_it_may_use(tmp_path, monkeypatch):
    """A restart finds the files it wrote: they must not shrink its bound (counted as used space they
    would, and the bound's LRU would evict the oldest files, the most shared prefixes)."""
    from collections import namedtuple

    from forkpoint.cache.sizing import DISK_TIER_SPACE_SHARE, default_disk_tier_bytes

    usage = namedtuple("usage", "total used free")
    free = {"bytes": 4_000_000}
    monkeypatch.setattr("forkpoint.cache.sizing.shutil.disk_usage", lambda path: usage(10**9, 0, free["bytes"]))
    root = tmp_path / "checkpoints"
    assert default_disk_tier_bytes(root / "not" / "yet") == int(4_000_000 * DISK_TIER_SPACE_SHARE)  # no dir yet
    (root / "model-a").mkdir(parents=True)
    (root / "model-a" / "x.ckpt").write_bytes(b"\0" * 600_000)
    (root / "model-a" / "y.ckpt").write_bytes(b"\0" * 400_000)
    free["bytes"] -= 1_000_000  # the files took that space
    assert default_disk_tier_bytes(root) == int(4_000_000 * DISK_TIER_SPACE_SHARE)
