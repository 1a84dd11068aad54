"""Images: forkpoint's vision tower, placeholder expansion, multi-axis rotary and logits against
transformers' Qwen3.5 / Qwen3.5-MoE ForConditionalGeneration on tiny random checkpoints (float32, CPU),
fed by transformers' own processor."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.models.layers import RotaryEmbedding
from tests.tiny_models import IMAGE, image_processor_oracle, random_image, words

MULTIMODAL = ["qwen3_5_moe", "qwen3_5"]
IMAGES = [random_image(1, 45, 27), random_image(2, 19, 40, "RGBA"), random_image(3, 16, 16)]


@pytest.fixture(scope="module", params=MULTIMODAL)
def multimodal(request, tiny_model_factory):
    directory, hf_model = tiny_model_factory(request.param)
    llm = LLM(str(directory), num_kv_blocks=96, max_num_seqs=8, auto_checkpoints=False)
    return directory, hf_model, llm, image_processor_oracle(directory)


def prompt_text(num_images: int) -> str:
    parts = [words(1, 2, 3)]
    for index in range(num_images):
        parts += [IMAGE, words(4 + index, 9, 11 + index)]
    return " ".join(parts)


def hf_inputs(processor, text: str, images) -> dict:
    return dict(processor(text=[text], images=list(images) or None, return_tensors="pt"))


def hf_logits(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits[0].float()


def forkpoint_logits(llm: LLM, prompt: dict) -> tuple[torch.Tensor, list[int]]:
    """Logits at every prompt position from one forward (prefill in one chunk), through the runner."""
    engine = llm.engine
    engine.add_request("full-logits", prompt, SamplingParams(max_tokens=1))
    request = engine.scheduler.waiting[0]
    step = engine.scheduler.schedule()
    plan = step.plan
    batch, _ = engine.runner.prepare(plan)
    batch = dataclasses.replace(batch, logits_indices=torch.arange(len(request.prompt_token_ids)))
    logits = engine.runner.model(batch, engine.runner.caches)
    engine.scheduler.commit(step)
    engine.abort_request("full-logits")
    engine.check_integrity()
    return logits, list(request.prompt_token_ids)


@pytest.mark.parametrize("num_images", [1, 2])
def test_logits_match_transformers(multimodal, num_images):
    _, hf_model, llm, processor = multimodal
    text, images = prompt_text(num_images), IMAGES[:num_images]
    inputs = hf_inputs(processor, text, images)
    ours, token_ids = forkpoint_logits(llm, {"prompt": text, "multi_modal_data": {"image": images}})
    assert token_ids == inputs["input_ids"][0].tolist()  # the same expansion as the processor
    ref = hf_logits(hf_model, inputs)
    rel = (ours - ref).norm() / ref.norm()
    assert rel <= 1e-4, f"relative error {rel:.2e}"


def test_expanded_token_ids_are_accepted_and_match(multimodal):
    """prompt_token_ids with processor-expanded placeholders give the same logits as the text prompt."""
    _, hf_model, llm, processor = multimodal
    inputs = hf_inputs(processor, prompt_text(2), IMAGES[:2])
    ids = inputs["input_ids"][0].tolist()
    ours, token_ids = forkpoint_logits(llm, {"prompt_token_ids": ids, "multi_modal_data": {"image": IMAGES[:2]}})
    assert token_ids == ids
    ref = hf_logits(hf_model, inputs)
    assert (ours - ref).norm() / ref.norm() <= 1e-4


def hf_greedy(model, processor, text: str, images, max_tokens: int) -> list[int]:
    inputs = hf_inputs(processor, text, images)
    generated: list[int] = []
    for _ in range(max_tokens):
        token = int(hf_logits(model, inputs)[-1].argmax())
        generated.append(token)
        extra = torch.tensor([[token]])
        inputs["input_ids"] = torch.cat([inputs["input_ids"], extra], dim=1)
        inputs["attention_mask"] = torch.cat([inputs["attention_mask"], torch.ones_like(extra)], dim=1)
        inputs["mm_token_type_ids"] = torch.cat([inputs["mm_token_type_ids"], torch.zeros_like(extra)], dim=1)
    return generated


def test_greedy_generation_matches_transformers_under_chunking_and_batching(tiny_model_factory):
    """Decode positions after images (t + delta), prefill chunks that split an image, and image
    prompts batched with text prompts."""
    directory, hf_model = tiny_model_factory("qwen3_5_moe")
    processor = image_processor_oracle(directory)
    llm = LLM(str(directory), max_num_batched_tokens=20, num_kv_blocks=96, max_num_seqs=4, auto_checkpoints=False)
    cases = [(prompt_text(2), IMAGES[:2]), (words(7, 8, 9), []), (prompt_text(1), IMAGES[2:3])]
    prompts = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text for text, images in cases]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for (text, images), out in zip(cases, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, processor, text, images, 5)
    llm.engine.check_integrity()
    assert llm.metrics()["kv_blocks_used"] == 0


def test_vision_tower_matches_transformers(multimodal):
    _, hf_model, llm, processor = multimodal
    inputs = hf_inputs(processor, prompt_text(3), IMAGES)
    with torch.no_grad():
        ref = hf_model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output
    ours = llm.engine.runner.model.visual(inputs["pixel_values"], inputs["image_grid_thw"].tolist())
    assert ours.shape == ref.shape
    assert (ours - ref).norm() / ref.norm() <= 1e-5


def test_text_only_use_skips_the_vision_tower(tiny_model_factory):
    directory, hf_model = tiny_model_factory("qwen3_5_moe")
    llm = LLM(str(directory), num_kv_blocks=32, max_num_seqs=4, max_images_per_prompt=0)
    assert llm.engine.runner.model.visual is None and llm.engine.runner.multimodal is None
    ids = torch.randint(5, 150, (21,), generator=torch.Generator().manual_seed(4)).tolist()
    ours, _ = forkpoint_logits(llm, {"prompt_token_ids": ids})
    ref = hf_logits(hf_model, {"input_ids": torch.tensor([ids])})
    assert (ours - ref).norm() / ref.norm() <= 1e-4


def test_mrope_with_equal_axes_is_the_1d_rotary():
    rotary = RotaryEmbedding(16, 10000.0, (3, 3, 2))
    positions = torch.tensor([0, 1, 5, 17, 300, 4095])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    cos3, sin3 = rotary.cos_sin(positions.expand(3, -1), torch.float32)
    assert torch.equal(cos, cos3) and torch.equal(sin, sin3)
    # distinct axes rotate the interleaved frequencies: T at 0, 3, 6; H at 1, 4, 7; W at 2, 5
    axes = torch.stack([positions, positions + 1, positions + 2])
    cos_axes, _ = rotary.cos_sin(axes, torch.float32)
    for i, axis in enumerate([0, 1, 2, 0, 1, 2, 0, 1]):
        assert torch.allclose(cos_axes[:, i], torch.cos(axes[axis].float() * rotary.inv_freq[i]))


def test_image_tokens_use_their_own_positions(multimodal):
    """The mrope path is live: image tokens have distinct axes, and 1-D positions change the logits."""
    _, _, llm, _ = multimodal
    engine = llm.engine
    engine.add_request("p", {"prompt": prompt_text(1), "multi_modal_data": {"image": IMAGES[:1]}},
                       SamplingParams(max_tokens=1))
    step = engine.scheduler.schedule()
    plan = step.plan
    batch, _ = engine.runner.prepare(plan)
    assert batch.embedding_overrides is not None
    assert not torch.equal(batch.mrope_positions[1], batch.mrope_positions[0])
    with_mrope = engine.runner.model(batch, engine.runner.caches)
    without = engine.runner.model(dataclasses.replace(batch, mrope_positions=None), engine.runner.caches)
    assert (with_mrope - without).abs().max() > 1e-3
    engine.scheduler.commit(step)
    engine.abort_request("p")
    engine.check_integrity()


def test_multimodal_checkpoint_with_a_text_only_tokenizer_serves_text(tiny_model_factory, tmp_path):
    """A tokenizer without the vision tokens: the checkpoint's text part still serves; images are refused."""
    import shutil

    from tests.tiny_models import save_tokenizer

    directory = tmp_path / "text_tokenizer"
    shutil.copytree(tiny_model_factory("qwen3_5_moe")[0], directory)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (directory / name).unlink(missing_ok=True)
    save_tokenizer(directory)
    llm = LLM(str(directory), num_kv_blocks=32)
    out = llm.generate(words(1, 2, 3), SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError):
        llm.generate({"prompt": f"{words(1)} {IMAGE}", "multi_modal_data": {"image": IMAGES[:1]}}, use_tqdm=False)
    llm.engine.check_integrity()
