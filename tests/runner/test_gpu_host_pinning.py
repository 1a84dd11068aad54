"""The host tier pinned ahead on several threads while it serves, on CUDA (runner/host_arena.py `ahead`,
runner/host_pinning.py), skipped without a GPU:

- every chunk is pinned once (PyTorch's pinned allocator on 4 threads), and pages handed out before the
  pinning ends take device copies;
- spill / restore / drop sequences decided within the pages pinned so far (the tier's page limit, as
  the engine sets it before each step) hold the plain path's bytes, bit for bit, while the rest of the
  tier is still held back;
- an engine that spills and restores while its tier is still being pinned gives the outputs of the
  same engine without a tier, bit for bit (checkpoint_exact).
Measured values are printed (`pytest -s`, lines starting with GPU_PIN)."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.runner.host_arena import HostArena, host_chunk
from forkpoint.runner.host_copies import ArenaHostCopies
from forkpoint.step.plan import HostDrop
from tests.models.test_gpu_model import ENGINE, max_logprob_diff, random_ids
from tests.runner.test_gpu_async_tier import SHAPES, SIZES, _storage
from tests.runner.test_gpu_cuda_graphs import model_dir  # noqa: F401 (fixture)
from tests.runner.test_host_copies import host_tier, random_writes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")


def test_four_threads_pin_every_chunk_and_early_pages_take_device_copies():
    arena = HostArena(num_pages=512, page_bytes=1 << 20, pinned=True, chunk_bytes=64 << 20, ahead=True,
                      pin_threads=4)  # 8 chunks of 64 MiB
    deadline = time.monotonic() + 30
    while arena.usable_pages() < 64:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    span = arena.allocate(40 << 20)  # in the first chunk, perhaps while later ones are pinned
    source = torch.randint(0, 255, (40 << 20,), dtype=torch.uint8, device=CUDA)
    for at, piece in arena.pieces(span, 0, span.num_bytes):
        piece.copy_(source[at: at + piece.numel()], non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(arena.read(span), source.cpu())
    assert arena.settle() == set(range(8)) and arena.usable_pages() == 512
    assert all(chunk is not None and chunk.is_pinned() for chunk in arena._chunks)
    assert arena.allocated_bytes == 512 << 20
    print(f"GPU_PIN 512 MiB on 4 threads in {arena.ahead_seconds:.3f} s "
          f"({0.5 * 2**30 / 1e9 / arena.ahead_seconds:.2f} GB/s)")
    arena.check_integrity([span])
    arena.close()


@pytest.mark.parametrize("seed", range(3))
def test_spills_within_the_pinned_pages_hold_the_plain_paths_bytes(seed):
    rng = random.Random(seed)
    capacity = 8 << 20
    tier = host_tier(capacity, SHAPES, 16)
    plain, arena = _storage(0, seed), _storage(capacity, seed)
    host = arena.host
    assert isinstance(host, ArenaHostCopies)
    permits = threading.Semaphore(0)

    def gated(num_bytes: int, pinned: bool) -> torch.Tensor:
        permits.acquire()
        return host_chunk(num_bytes, pinned)

    chunk_pages = max(1, host.arena.num_pages // 6)
    host.arena = HostArena(host.arena.num_pages, host.arena.page_bytes, pinned=True,
                           chunk_bytes=chunk_pages * host.arena.page_bytes, ahead=True, pin_threads=4,
                           allocate_chunk=gated)
    first = 0
    for phase in range(len(host.arena._chunks) + 1):
        tier.limit_pages(host.arena.page_bytes, host.arena.usable_pages())
        writes = random_writes(rng, tier, 30, SIZES)
        for storage in (plain, arena):
            storage.apply(writes, first=first)
            storage.check_integrity()
        first += len(writes)
        torch.cuda.synchronize()
        assert sorted(arena.host) == sorted(plain.host) == sorted(tier.entry_ids())
        expected, got = plain.tensors(), arena.tensors()
        assert all(torch.equal(got[name], tensor) for name, tensor in expected.items()), phase
        assert host.arena.num_pages - host.arena.pages.num_free == tier.num_pages <= tier.page_limit.pages
        clear = [HostDrop(e) for e in tier.clear()]
        for storage in (plain, arena):
            storage.apply(clear, first=first)
        first += len(clear)
        permits.release()
        pinned = min(host.arena.num_pages, (phase + 1) * chunk_pages)
        deadline = time.monotonic() + 30
        while host.arena.usable_pages() < pinned:
            assert time.monotonic() < deadline
            time.sleep(0.001)
    for _ in range(8):
        permits.release()
    host.arena.close()


def test_engine_spilling_while_its_tier_is_pinned_gives_the_outputs_without_it(model_dir):  # noqa: F811
    """A 3 GiB tier (three 1 GiB chunks and a bit, on the default threads): the workload starts at once,
    so its first spills are decided while chunks are still being pinned."""
    engine_args = {**ENGINE, "checkpoint_pool_size": 2, "checkpoint_exact": True}
    plain = LLM(str(model_dir), device="cuda", dtype="bfloat16", checkpoint_host_bytes=0, **engine_args)
    tiered = LLM(str(model_dir), device="cuda", dtype="bfloat16", checkpoint_host_bytes=3 << 30, **engine_args)
    arena = tiered.engine.runner.storage.host.arena
    pinned_at_start = arena.usable_pages() * arena.page_bytes
    generator = torch.Generator().manual_seed(7)
    marker = tiered.checkpoint_token_id
    anchors = [random_ids(generator, 140 + 30 * i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    first = [{"prompt_token_ids": a + [marker] + random_ids(generator, 9)} for a in anchors]
    second = [{"prompt_token_ids": a + [marker] + random_ids(generator, 20 + i)} for i, a in enumerate(anchors)]
    outs = {}
    for name, llm in (("tiered", tiered), ("plain", plain)):
        outs[name] = [llm.generate(p, params, use_tqdm=False)[0] for p in first]  # one at a time: evictions
        outs[name] += llm.generate(second, params, use_tqdm=False)
        llm.engine.check_integrity()
    metrics = tiered.engine.metrics()
    diff = max(max_logprob_diff(a, b) for a, b in zip(outs["tiered"], outs["plain"]))
    print(f"GPU_PIN engine: {pinned_at_start / 2**30:.2f} GiB pinned at the first step, spilled "
          f"{metrics['checkpoints_spilled']}, dropped {metrics['checkpoints_dropped_from_host']}, restored "
          f"{metrics['checkpoints_restored']}, max |logprob diff| {diff:.3e}")
    assert all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(outs["tiered"], outs["plain"]))
    assert diff == 0.0
    tiered.engine.wait_for_host_tier()  # (also sets the tier's limit to the whole arena)
    assert arena.usable_pages() == arena.num_pages == tiered.engine.registry.host.page_limit.pages
    assert all(chunk.is_pinned() for chunk in arena._chunks)
    tiered.engine.check_integrity()
