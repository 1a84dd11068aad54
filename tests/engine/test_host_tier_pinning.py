"""The engine serves while its host tier is still being pinned ahead (engine/engine.py
`_follow_host_pinning`): before each step the host tier's directory is limited to the pages pinned so
far, so a spill beyond them is handled as in a full tier (dropped: a recompute later, never wrong data)
and no step waits for pinning; once pinned, spills and restores work as before (float32 CPU, tiny
model, the arena's copies run on the CPU with a gated allocator in place of cudaHostAlloc)."""

from __future__ import annotations

import threading

import torch

from forkpoint import LLM, SamplingParams
from forkpoint.runner.host_arena import HostArena
from forkpoint.runner.host_copies import ArenaHostCopies
from tests.helpers import assert_same_outputs
from tests.tiny_models import words

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
MARK = "<|mamba_checkpoint|>"


class Gate:
    """A chunk allocator that pins nothing until `open` (and fails after 60 s: a test that waited for
    pinning would fail, not hang)."""

    def __init__(self) -> None:
        self.opened = threading.Event()

    def __call__(self, num_bytes: int, pinned: bool) -> torch.Tensor:
        if not self.opened.wait(timeout=60):
            raise RuntimeError("the gate was never opened")
        return torch.empty(num_bytes, dtype=torch.uint8)


def test_spills_before_the_tier_is_pinned_are_dropped_and_after_it_kept(model_dir, plain):
    generator = torch.Generator().manual_seed(8)
    anchors = [words(*torch.randint(0, 150, (37,), generator=generator).tolist()) for _ in range(3)]
    llm = LLM(str(model_dir), num_kv_blocks=256, checkpoint_pool_size=1, auto_checkpoints=False,
              checkpoint_host_bytes=64 << 20)
    storage, gate = llm.engine.runner.storage, Gate()
    host = ArenaHostCopies(storage.host.pools, 64 << 20)
    host.arena = HostArena(host.arena.num_pages, host.arena.page_bytes, pinned=False,
                           chunk_bytes=host.arena.num_pages * host.arena.page_bytes // 4, ahead=True,
                           pin_threads=2, allocate_chunk=gate)
    storage.host = host
    prompts = [f"{anchor} {MARK} {words(i)}" for anchor in anchors for i in (1, 2)]

    outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]  # nothing pinned yet
    metrics = llm.metrics()
    assert llm.engine.registry.host.page_limit.pages == 0 and host.arena.usable_pages() == 0
    assert metrics["checkpoints_spilled"] == 0 and metrics["checkpoints_dropped_from_host"] == 2
    assert metrics["host_tier_pinned_bytes"] == 0
    llm.engine.check_integrity()

    gate.opened.set()
    llm.engine.wait_for_host_tier()
    again = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    # the first two anchors' checkpoints were dropped (recomputed now), the last one's spills and comes back
    assert [o.num_cached_tokens for o in again] == [0, 37, 0, 37, 37, 37]
    again += [llm.generate(f"{anchor} {MARK} {words(3)}", GREEDY, use_tqdm=False)[0] for anchor in anchors]
    assert [o.num_cached_tokens for o in again[6:]] == [37] * 3  # every anchor from the host tier or the device
    assert llm.metrics()["checkpoints_spilled"] >= 3 and llm.metrics()["checkpoints_restored"] >= 3
    assert llm.metrics()["host_tier_pinned_bytes"] == 64 << 20
    llm.engine.check_integrity()
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs + again], GREEDY, use_tqdm=False)
    assert_same_outputs(outs + again, refs)
