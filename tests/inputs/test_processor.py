"""`InputProcessor.process` from the server's tokenizer threads at once: one hasher-cache build at a time
(its LRU update is several steps another thread's eviction could cut), and every prompt hashed as alone."""

from __future__ import annotations

import random
import threading
import time

from forkpoint.cache.hashing import HasherCache, PrefixHasher
from forkpoint.inputs.multimodal import ImagePromptProcessor
from forkpoint.inputs.processor import InputProcessor, PromptLimits

BLOCK = 16


class OverlapProbe(HasherCache):
    """A hasher cache that records how many threads are inside `build` at once (and sleeps there, so
    that unsynchronised callers would overlap)."""

    def __init__(self) -> None:
        super().__init__(BLOCK, capacity=2)
        self.inside = 0
        self.most = 0
        self.count = threading.Lock()

    def build(self, *args, **kwargs) -> PrefixHasher:
        with self.count:
            self.inside += 1
            self.most = max(self.most, self.inside)
        time.sleep(0.002)
        try:
            return super().build(*args, **kwargs)
        finally:
            with self.count:
                self.inside -= 1


def test_concurrent_prompts_build_hashers_one_at_a_time():
    processor = InputProcessor(None, None, ImagePromptProcessor(None, None, 0),
                               PromptLimits(vocab_size=1000, max_model_len=4096, block_size=BLOCK, max_kv_blocks=4096,
                                            max_checkpoints=4))
    probe = OverlapProbe()
    processor.hashers = probe
    rng = random.Random(0)
    # several distinct first blocks over a capacity of 2: the threads evict each other's entries
    prompts = [[rng.randrange(4)] * BLOCK + [rng.randrange(1000) for _ in range(rng.randrange(200))] for _ in range(48)]
    results: dict[int, list[bytes]] = {}

    def work(indices: list[int]) -> None:
        for index in indices:
            results[index] = processor.process({"prompt_token_ids": prompts[index]}).hasher.block_hashes

    threads = [threading.Thread(target=work, args=(list(range(k, len(prompts), 6)),)) for k in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert probe.most == 1
    for index, tokens in enumerate(prompts):
        assert results[index] == PrefixHasher(tokens, BLOCK).block_hashes
