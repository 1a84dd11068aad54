"""The host tier's asynchronous path on CUDA (runner/host_copies.py `ArenaHostCopies`: pinned arena
pages, a copy stream, events), skipped without a GPU:

- random spill / restore / drop / row-copy sequences give, bit for bit, the bytes of the plain
  synchronous path (`PlainHostCopies`), with every restore's destination poisoned with NaN first;
- a spill whose row and blocks are overwritten at once (a row copy in the same plan, the next
  forward's writes) still holds the old bytes, while the compute stream was busy when it was enqueued
  (so the copy ran late); the host returned before the copy completed;
- a restore whose copies run late (the copy stream busy) is read correctly by the next kernel on
  the compute stream; the disk tier's host copies run on the copy stream too, behind their event;
- an engine with a two-row checkpoint pool and a host tier (spills and restores in mixed steps)
  gives the outputs of the same engine without the tier, bit for bit (checkpoint_exact), and reuses
  more.
Measured values are printed (`pytest -s`, lines starting with GPU_TIER)."""

from __future__ import annotations

import random
import time

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.cache.sizing import PoolShapes, PoolSizes
from forkpoint.cache.state_pool import RecurrentStateSpec
from forkpoint.runner.host_copies import ArenaHostCopies, PlainHostCopies
from forkpoint.runner.storage import DeviceStorage
from forkpoint.step.plan import HostDrop, Restore, Segment, SegmentKind, Spill, StateCopy, StepPlan
from tests.models.test_gpu_model import ENGINE, max_logprob_diff, random_ids
from tests.runner.test_gpu_cuda_graphs import model_dir  # noqa: F401 (fixture)
from tests.runner.test_host_copies import host_tier, random_writes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
BLOCK_SIZE = 16
SIZES = PoolSizes(num_kv_blocks=96, num_request_slots=2, num_checkpoint_slots=6)
# Qwen3.5-shaped, smaller: GDN conv [conv_dim, 3] bf16, SSM [HV, K, V] fp32 (256 KiB a layer), 6 GDN
# layers, 2 attention layers of KV [16, 2, 128] bf16 per block
SPEC = RecurrentStateSpec((1024, 3), torch.bfloat16, (16, 64, 64), torch.float32)
SHAPES = PoolShapes(2, 2, 128, torch.bfloat16, 6, SPEC)
SLEEP_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s on an H200's ~2 GHz SM clock


def _storage(host_arena_bytes: int, seed: int = 0) -> DeviceStorage:
    storage = DeviceStorage(SIZES, BLOCK_SIZE, SHAPES, CUDA, host_arena_bytes=host_arena_bytes)
    generator = torch.Generator().manual_seed(seed)
    for tensor in [storage.conv_stack, storage.ssm_stack, *storage.k, *storage.v]:
        tensor.copy_(torch.randn(tensor.shape, generator=generator).to(tensor.dtype))
    storage.conv_stack[:, 0].zero_()
    storage.ssm_stack[:, 0].zero_()
    torch.cuda.synchronize()
    return storage


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bits (NaN compares equal to itself)."""
    return tensor.contiguous().view(torch.uint8)


def _poison(storage: DeviceStorage, slot: int, blocks) -> None:
    """NaN into a row and blocks, as a forward would write them (after waiting for spills reading them)."""
    storage.host.wait_for((slot,), blocks)
    storage.conv_stack[:, slot].fill_(float("nan"))
    storage.ssm_stack[:, slot].fill_(float("nan"))
    if blocks:
        index = torch.tensor(list(blocks), device=CUDA)
        for cache in storage.k + storage.v:
            cache.index_fill_(0, index, float("nan"))


def _snapshot(storage: DeviceStorage, slot: int, blocks) -> list[torch.Tensor]:
    index = torch.tensor(list(blocks), dtype=torch.long, device=CUDA)
    parts = [storage.conv_stack[:, slot], storage.ssm_stack[:, slot]]
    parts += [cache.index_select(0, index) for cache in storage.k + storage.v]
    return [_bytes(part).clone() for part in parts]


def _prefill_plan(slot: int, blocks) -> StepPlan:
    """A forward that writes row `slot` and every position of `blocks`."""
    end = len(blocks) * BLOCK_SIZE
    return StepPlan(segments=(Segment("r", 0, end, [1] * end, tuple(blocks), 0, (slot,), SegmentKind.PREFILL, 0,
                                      True),))


@pytest.mark.parametrize("seed", range(3))
def test_async_restores_equal_the_sync_path_on_nan_poisoned_rows(seed):
    rng = random.Random(seed)
    capacity = rng.choice([SHAPES.slot_bytes * 3, SHAPES.slot_bytes * 6 + 40 * SHAPES.block_bytes(BLOCK_SIZE)])
    tier = host_tier(capacity, SHAPES, BLOCK_SIZE)
    writes = random_writes(rng, tier, 120, SIZES)
    assert sum(isinstance(w, Restore) for w in writes) >= 5
    sync, arena = _storage(0, seed), _storage(capacity, seed)
    assert isinstance(sync.host, PlainHostCopies) and isinstance(arena.host, ArenaHostCopies)
    for number, write in enumerate(writes):
        for storage in (sync, arena):
            if isinstance(write, Restore):
                _poison(storage, write.slot, write.blocks)
            # an empty plan: spills stay in flight across later writes (each write guards itself)
            storage.apply([write], first=number, forward=StepPlan())
    arena.apply([], first=len(writes))  # no plan: wait for every spill
    torch.cuda.synchronize()
    expected, got = sync.tensors(), arena.tensors()
    assert expected.keys() == got.keys() and any(name.startswith("host") for name in got)
    for name, tensor in expected.items():
        assert torch.equal(_bytes(got[name]), _bytes(tensor)), name
    arena.check_integrity()
    arena.apply([HostDrop(e) for e in tier.clear()], first=len(writes))
    assert arena.host.arena.pages.num_free == arena.host.arena.num_pages


def _touch_arena(storage: DeviceStorage) -> int:
    """A spill and a drop, to completion: the arena's pinned chunk exists (its first allocation, a
    pinned one, may synchronise the device). Returns the next write number."""
    storage.apply([Spill(100, 6, (60, 61)), HostDrop(100)])
    torch.cuda.synchronize()
    return 2


def test_a_spilled_row_and_blocks_overwritten_at_once_keep_their_bytes_in_the_host_copy():
    storage = _storage(SHAPES.slot_bytes * 4 + 64 * SHAPES.block_bytes(BLOCK_SIZE))
    first = _touch_arena(storage)
    slot, blocks = 3, (5, 40, 2, 17)
    expected = _snapshot(storage, slot, blocks)
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream is busy: the spill's copies start after it
    started = time.perf_counter()
    # the row is reused by a row copy in the same plan, and row and blocks by the forward after it
    storage.apply([Spill(0, slot, blocks), StateCopy(1, slot)], first=first, forward=_prefill_plan(slot, blocks))
    host_s = time.perf_counter() - started
    in_flight = not storage.host.stream.query()  # the spill's copies are not done
    copied = _bytes(storage.conv_stack[:, slot]).clone()
    _poison(storage, slot, blocks)  # what the forward writes
    storage.apply([Restore(0, 4, (7, 8, 10, 11))], first=first + 2, forward=StepPlan())
    got = _snapshot(storage, 4, (7, 8, 10, 11))
    torch.cuda.synchronize()
    print(f"GPU_TIER spill of {storage.host.entry_bytes(len(blocks)) / 2**20:.1f} MiB: host {1e3 * host_s:.2f} ms, "
          f"returned while the GPU was busy: {in_flight}")
    assert in_flight and host_s < 0.05  # the host enqueued and went on
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    assert torch.equal(copied, _bytes(storage.conv_stack[:, 1]))  # the row copy landed
    storage.check_integrity()


def test_a_restore_whose_copies_run_late_is_read_after_them():
    storage = _storage(SHAPES.slot_bytes * 4 + 64 * SHAPES.block_bytes(BLOCK_SIZE))
    first = _touch_arena(storage)
    slot, blocks = 5, (3, 4, 60)
    expected = _snapshot(storage, slot, blocks)
    storage.apply([Spill(0, slot, blocks)], first=first)
    _poison(storage, 6, (20, 21, 22))
    with torch.cuda.stream(storage.host.stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # the copy stream is busy: the restore's copies run late
    started = time.perf_counter()
    storage.apply([Restore(0, 6, (20, 21, 22))], first=first + 1, forward=StepPlan())
    host_s = time.perf_counter() - started
    late = not storage.host.stream.query()
    got = _snapshot(storage, 6, (20, 21, 22))  # kernels on the compute stream, enqueued at once
    torch.cuda.synchronize()
    print(f"GPU_TIER restore enqueued in {1e3 * host_s:.2f} ms while the copy stream was busy: {late}")
    assert late and host_s < 0.05
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    storage.check_integrity()


def test_disk_save_copies_run_late_and_are_waited_for():
    """The disk tier's host copies (`copy_out`) on the copy stream: the writer's event covers them, and
    a row copy into the saved row right after waits for them."""
    plain, arena = _storage(0, 4), _storage(1 << 24, 4)
    expected, _ = plain.host.copy_out(4, (3, 9, 50))
    arena.host.copy_out(4, (3, 9, 50))  # its pinned blocks, freed, are cached for the next one
    arena.apply([], forward=None)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)  # the copies start after the compute stream's work so far
    got, ready = arena.host.copy_out(4, (3, 9, 50))
    arena.apply([StateCopy(1, 4)], forward=StepPlan())  # overwrites the row: waits for the copies
    assert not ready.query()
    ready.synchronize()
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(got, expected))
    torch.cuda.synchronize()
    assert torch.equal(_bytes(arena.conv_stack[:, 4]), _bytes(arena.conv_stack[:, 1]))


def test_engine_with_the_host_tier_gives_the_outputs_without_it(model_dir):  # noqa: F811
    """Five anchors through a two-row checkpoint pool: the first round's checkpoints evict (spill)
    each other, the second round's consumers restore them two at a time, beside a fresh prompt's
    prefill and decodes (spills of the checkpoints they evict run in the same steps)."""
    # every hit restored, whatever this machine's step times say (the restore rule declined 3 of 5 restores of
    # these tiny anchors on an H100 in session 26: tests/engine/test_reuse_rule.py tests the rule)
    engine_args = {**ENGINE, "checkpoint_pool_size": 2, "checkpoint_exact": True, "checkpoint_restore_rule": False}
    tiered = LLM(str(model_dir), device="cuda", dtype="bfloat16", checkpoint_host_bytes=1 << 28, **engine_args)
    plain = LLM(str(model_dir), device="cuda", dtype="bfloat16", checkpoint_host_bytes=0, **engine_args)
    assert isinstance(tiered.engine.runner.storage.host, ArenaHostCopies)
    arena = tiered.engine.runner.storage.host.arena  # a size given: pinned ahead, in the background
    arena.settle()
    assert arena.pinned and arena.ahead_seconds is not None
    assert arena.allocated_bytes == arena.num_pages * arena.page_bytes >= 1 << 28
    print(f"GPU_TIER pinned {arena.allocated_bytes / 2**20:.0f} MiB ahead in {arena.ahead_seconds:.3f} s")
    generator = torch.Generator().manual_seed(7)
    marker = tiered.checkpoint_token_id
    anchors = [random_ids(generator, 140 + 30 * i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    first = [{"prompt_token_ids": a + [marker] + random_ids(generator, 9)} for a in anchors]
    second = [{"prompt_token_ids": a + [marker] + random_ids(generator, 20 + i)} for i, a in enumerate(anchors)]
    fresh = {"prompt_token_ids": random_ids(generator, 90)}
    outs = {}
    for name, llm in (("tiered", tiered), ("plain", plain)):
        outs[name] = [llm.generate(p, params, use_tqdm=False)[0] for p in first]  # one at a time: evictions
        for pair in (second[0:2], second[2:4], second[4:]):  # with a fresh prompt: restores in mixed steps
            outs[name] += llm.generate(pair + [fresh], params, use_tqdm=False)[:-1]
        llm.engine.check_integrity()
        llm.engine.runner.storage.check_integrity()
    metrics = tiered.engine.metrics()
    tiered_cached = [o.num_cached_tokens for o in outs["tiered"][5:]]
    plain_cached = [o.num_cached_tokens for o in outs["plain"][5:]]
    diff = max(max_logprob_diff(a, b) for a, b in zip(outs["tiered"], outs["plain"]))
    print(f"GPU_TIER engine: restored {metrics['checkpoints_restored']}, cached tokens with the tier "
          f"{tiered_cached}, without {plain_cached}, max |logprob diff| {diff:.3e}")
    assert metrics["checkpoints_restored"] >= 5  # (5 on the CPU's plain path, float32)
    assert sum(tiered_cached) > sum(plain_cached) and all(n > 0 for n in tiered_cached)
    assert all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs["tiered"], outs["plain"]))
    assert diff == 0.0
