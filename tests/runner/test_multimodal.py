"""Per-step image inputs (runner/multimodal.py): the embedding cache counts the memory it holds."""

from __future__ import annotations

from forkpoint import LLM, SamplingParams
from tests.tiny_models import IMAGE, random_image, words


def test_embedding_cache_counts_the_storage_it_holds(tiny_model_factory):
    """Images encoded in one vision-tower call are cached as their own tensors, not as views of the
    call's output: a view would pin every image's rows while the cache counts only its own."""
    llm = LLM(str(tiny_model_factory("qwen3_5_moe")[0]), num_kv_blocks=64, max_num_batched_tokens=256)
    images = [random_image(60 + i, 16 + 8 * i, 24) for i in range(3)]
    prompt = {"prompt": f"{words(1, 2)} {IMAGE} {words(3)} {IMAGE} {IMAGE} {words(4)}",
              "multi_modal_data": {"image": images}}
    llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)

    vision = llm.engine.runner.multimodal
    assert vision.stats.encoder_calls == 1 and vision.stats.images_encoded == 3
    cache = vision.cache
    entries = [cache.get(image_hash) for image_hash in list(cache._entries)]
    assert len(entries) == 3
    held = {tensor.untyped_storage().data_ptr(): tensor.untyped_storage().nbytes() for tensor in entries}
    assert len(held) == 3  # one storage per image
    assert cache.num_bytes == sum(held.values()) == sum(t.numel() * t.element_size() for t in entries)
