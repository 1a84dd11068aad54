"""Checkpoints across images: zero accuracy loss, exact reuse of the expanded anchor, image content
in the checkpoint identity, the vision tower skipped for images inside a checkpoint, and the input
errors of the offline API (float32, CPU, tiny transformers-built Qwen3.5-MoE with a vision tower)."""

from __future__ import annotations

import base64
import io

import pytest

from forkpoint import LLM, SamplingParams
from tests.helpers import assert_same_outputs
from tests.tiny_models import IMAGE, random_image, words

MARK = "<|mamba_checkpoint|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, logprobs=3)
ANCHOR_IMAGE = random_image(10, 40, 24)  # 5 x 3 merged tokens: a grid no suffix image has
SUFFIX_IMAGES = [random_image(20 + i, 16, 16 + 8 * (i % 3)) for i in range(5)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("qwen3_5_moe")[0]


def make_llm(directory, **kwargs) -> LLM:
    defaults = dict(num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=512, auto_checkpoints=False)
    defaults.update(kwargs)
    return LLM(str(directory), **defaults)


def data_url(image, fmt: str = "PNG") -> str:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return f"data:image/{fmt.lower()};base64," + base64.b64encode(buffer.getvalue()).decode()


def anchor_text() -> str:
    return f"{words(*range(30, 67))} {IMAGE} {words(3, 4, 5, 6, 7)}"


def suffix_prompt(index: int, anchor_image=ANCHOR_IMAGE, marker: str = MARK) -> dict:
    text = f"{anchor_text()}{marker} {words(index, 80, 81)} {IMAGE} {words(90 + index, 91)}"
    return {"prompt": text, "multi_modal_data": {"image": [anchor_image, SUFFIX_IMAGES[index]]}}


def reference(directory, prompts):
    plain = make_llm(directory, enable_checkpoints=False)
    return plain.generate([{**p, "prompt": p["prompt"].replace(MARK, "")} for p in prompts], GREEDY, use_tqdm=False)


def count_anchor_encodes(llm: LLM) -> list[int]:
    """Spy on the vision tower: the returned list grows by the number of anchor images in each call."""
    vision = llm.engine.runner.multimodal
    encoder, calls = vision.encoder, []

    def spy(pixels, grids):
        calls.append(sum(1 for grid in grids if list(grid) == [1, 6, 10]))  # the anchor's patch grid
        return encoder(pixels, grids)

    vision.encoder = spy
    return calls


def test_one_to_n_with_images_equals_no_checkpoint_run(model_dir):
    prompts = [suffix_prompt(i) for i in range(5)]
    llm = make_llm(model_dir, image_embedding_cache_bytes=0)  # no embedding cache: every encode is visible
    anchor_encodes = count_anchor_encodes(llm)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert_same_outputs(outs, reference(model_dir, prompts))
    # marker position counts the expanded anchor: 37 words + <|vision_start|> + 15 pads + <|vision_end|> + 5 words
    anchor_len = 37 + 1 + 15 + 1 + 5
    assert outs[0].checkpoint_positions == [anchor_len]
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [anchor_len] * 4
    metrics = llm.metrics()
    assert metrics["prompt_tokens_computed"] == anchor_len + sum(len(o.prompt_token_ids) - anchor_len for o in outs)
    assert sum(anchor_encodes) == 1  # consumers start past the anchor image: the tower never sees it again
    assert metrics["images_encoded"] == 1 + len(prompts)  # the anchor once, each suffix image once
    llm.engine.check_integrity()
    assert metrics["state_slots_used"] == 0


def test_consumers_in_later_steps_skip_the_anchor_image(model_dir):
    """Consumers arriving after the checkpoint is ready (separate generate calls, no embedding cache)."""
    llm = make_llm(model_dir, image_embedding_cache_bytes=0)
    anchor_encodes = count_anchor_encodes(llm)
    outs = [llm.generate(suffix_prompt(i), GREEDY, use_tqdm=False)[0] for i in range(3)]
    assert [o.num_cached_tokens for o in outs] == [0, 59, 59]
    assert sum(anchor_encodes) == 1
    assert_same_outputs(outs, reference(model_dir, [suffix_prompt(i) for i in range(3)]))


def test_anchors_differing_only_in_the_image_do_not_share_a_checkpoint(model_dir):
    llm = make_llm(model_dir)
    first = llm.generate(suffix_prompt(0), GREEDY, use_tqdm=False)[0]
    other = llm.generate(suffix_prompt(1, anchor_image=random_image(11, 40, 24)), GREEDY, use_tqdm=False)[0]
    assert first.prompt_token_ids[:59] == other.prompt_token_ids[:59]  # same tokens, different pixels
    assert other.num_cached_tokens == 0
    assert llm.metrics()["checkpoints_created"] == 2
    # the same pixels, sent as a PNG data URL instead of a PIL image, do share it
    same = llm.generate(suffix_prompt(2, anchor_image=data_url(ANCHOR_IMAGE)), GREEDY, use_tqdm=False)[0]
    assert same.num_cached_tokens == 59
    assert llm.metrics()["checkpoints_created"] == 2
    refs = reference(model_dir, [suffix_prompt(0), suffix_prompt(1, anchor_image=random_image(11, 40, 24)),
                                 suffix_prompt(2)])
    assert_same_outputs([first, other, same], refs)


def test_checkpoint_before_an_image_and_explicit_positions(model_dir):
    """A marker before an image: the image (after the checkpoint) is computed by every consumer;
    checkpoint_positions count expanded tokens."""
    llm = make_llm(model_dir)
    prompts = [{"prompt": f"{words(1, 2, 3, 4)}{MARK} {IMAGE} {words(i, 5)}",
                "multi_modal_data": {"image": [SUFFIX_IMAGES[i]]}} for i in range(3)]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 4, 4]
    assert_same_outputs(outs, reference(model_dir, prompts))
    # an explicit position after the image, in expanded coordinates (4 words, VS, 4 pads, VE)
    ids, image = outs[0].prompt_token_ids, {"image": [SUFFIX_IMAGES[0]]}
    explicit = [{"prompt_token_ids": ids, "checkpoint_positions": [10], "multi_modal_data": image},
                {"prompt_token_ids": ids[:10] + [70, 71], "multi_modal_data": image}]
    again = llm.generate(explicit, GREEDY, use_tqdm=False)
    assert again[0].checkpoint_positions == [10] and again[1].num_cached_tokens == 10
    llm.engine.check_integrity()


def test_chat_with_image_url_parts_and_a_marker(model_dir):
    llm = make_llm(model_dir)

    def conversation(i):
        return [{"role": "user", "content": [
            {"type": "text", "text": words(*range(30, 50))},
            {"type": "image_url", "image_url": {"url": data_url(ANCHOR_IMAGE)}},
            {"type": "text", "text": words(7, 8) + MARK},
            {"type": "image_url", "image_url": {"url": data_url(SUFFIX_IMAGES[i], "JPEG")}},
            {"type": "text", "text": words(i, 9)}]}]

    outs = llm.chat([conversation(i) for i in range(3)], GREEDY, use_tqdm=False)
    cached = outs[0].checkpoint_positions[0]
    assert [o.num_cached_tokens for o in outs] == [0, cached, cached]
    rendered = [llm.get_tokenizer().decode(o.prompt_token_ids) for o in outs]
    assert all(r.count("<|image_pad|>") == 15 + 4 for r in rendered[:1])
    llm.engine.check_integrity()


def png_bytes_truncated() -> bytes:
    buffer = io.BytesIO()
    random_image(5, 32, 32).save(buffer, format="PNG")
    return buffer.getvalue()[:60]


@pytest.fixture(scope="module")
def error_llm(model_dir):
    return make_llm(model_dir, max_images_per_prompt=2)


def one_image(image, text: str = f"{words(1)} {IMAGE} {words(2)}") -> dict:
    return {"prompt": text, "multi_modal_data": {"image": [image]}}


@pytest.mark.parametrize(("prompt", "message"), [
    (one_image("data:image/png;base64," + base64.b64encode(b"not an image").decode()),
     "image 0: the data is not an image"),
    (one_image(png_bytes_truncated()), "image 0: the image data cannot be decoded"),
    (one_image("data:image/png;base64,@@@"), "base64 payload is invalid"),
    (one_image("data:image/svg+xml;base64,PHN2Zz48L3N2Zz4="), "unsupported image type 'image/svg\\+xml'"),
    (one_image("https://example.com/cat.png"), "does not fetch images over the network"),
    (one_image("/nonexistent/cat.png"), "no image file at"),
    (one_image(12), "image 0 is a int"),
    (one_image(random_image(6, 500, 2)), "aspect ratio above 200"),
    ({"prompt": f"{IMAGE} {IMAGE} {IMAGE} {words(1)}", "multi_modal_data": {"image": [ANCHOR_IMAGE] * 3}},
     "prompt has 3 images but at most 2 are allowed per prompt"),
    ({"prompt": f"{IMAGE} {IMAGE} {words(1)}", "multi_modal_data": {"image": [ANCHOR_IMAGE]}},
     r"prompt has 2 image placeholder\(s\) but 1 image\(s\)"),
    ({"prompt": f"{words(1)} {words(2)}", "multi_modal_data": {"image": [ANCHOR_IMAGE]}},
     r"prompt has 0 image placeholder\(s\) but 1 image\(s\)"),
    (one_image(ANCHOR_IMAGE, f"{words(1)} <|image_pad|> {words(2)}"), "is not wrapped in <\\|vision_start\\|>"),
    (one_image(ANCHOR_IMAGE, f"{words(1)} <|vision_start|>{MARK}<|image_pad|><|vision_end|> {words(2)}"),
     "checkpoint at position 2 falls inside image 0's placeholder"),
    (one_image(ANCHOR_IMAGE, f"{words(1)} <|vision_start|><|image_pad|>{MARK}<|vision_end|> {words(2)}"),
     "checkpoint at position 17 falls inside image 0's placeholder"),
    ({**one_image(ANCHOR_IMAGE), "checkpoint_positions": [9]}, "checkpoint at position 9 falls inside image 0"),
    ({"prompt": words(1), "multi_modal_data": {"video": [b"x"]}}, r"unsupported multi_modal_data modality \['video'\]"),
    ({"prompt": words(1), "multi_modal_data": [ANCHOR_IMAGE]}, "'multi_modal_data' must be a dict"),
])
def test_invalid_image_inputs(error_llm, prompt, message):
    with pytest.raises(ValueError, match=message):
        error_llm.generate(prompt, GREEDY, use_tqdm=False)
    assert not error_llm.engine.has_unfinished_requests()
    error_llm.engine.check_integrity()


def test_unsupported_format_file(error_llm, tmp_path):
    path = tmp_path / "cat.ppm"
    random_image(7, 16, 16).save(path, format="PPM")
    with pytest.raises(ValueError, match="image 0: unsupported image format 'PPM'"):
        error_llm.generate(one_image(str(path)), GREEDY, use_tqdm=False)


def test_chat_image_url_must_be_a_data_url(error_llm):
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/cat.png"}}]}]
    with pytest.raises(ValueError, match=r"messages\[0\]\['content'\]\[0\]: image URL .* is not fetched"):
        error_llm.chat(messages, GREEDY, use_tqdm=False)


def test_image_for_a_text_only_checkpoint(moe_model):
    llm = make_llm(moe_model[0])
    with pytest.raises(ValueError, match="this model is text-only"):
        llm.generate(one_image(ANCHOR_IMAGE), GREEDY, use_tqdm=False)


def test_images_disabled(model_dir):
    llm = make_llm(model_dir, max_images_per_prompt=0)
    with pytest.raises(ValueError, match=r"images are disabled \(max_images_per_prompt=0"):
        llm.generate(one_image(ANCHOR_IMAGE), GREEDY, use_tqdm=False)
    assert llm.generate(words(1, 2), GREEDY, use_tqdm=False)[0].outputs[0].token_ids  # text still runs


def test_pixel_limits_are_engine_settings(model_dir):
    """image_max_pixels / image_min_pixels (LLM kwargs) override preprocessor_config.json."""
    image = random_image(12, 64, 48)  # one token per 8x8 pixels after resizing into the pixel limits
    counts = {}
    for kwargs in ({}, {"image_max_pixels": 256}, {"image_min_pixels": 2048, "image_max_pixels": 4096}):
        llm = make_llm(model_dir, **kwargs)
        out = llm.generate(one_image(image), GREEDY, use_tqdm=False)[0]
        counts[tuple(kwargs)] = out.prompt_token_ids.count(llm.engine.model_config.vision.image_token_id)
    # preprocessor_config.json: at most 1024 px -> 32x24; 256 px -> 16x8; 2048..4096 px -> 64x48 as given
    assert counts == {(): 12, ("image_max_pixels",): 2, ("image_min_pixels", "image_max_pixels"): 48}
    with pytest.raises(ValueError, match="image_min_pixels 4096 exceeds image_max_pixels 1024"):
        make_llm(model_dir, image_min_pixels=4096, image_max_pixels=1024)


def test_async_scheduling_decodes_image_prompts_as_synchronous_steps(model_dir):
    """Image prompts decode through steps run ahead (rotary positions of their text after the images)
    with the outputs of synchronous steps."""
    prompts = [suffix_prompt(i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=3)
    expected = make_llm(model_dir).generate(prompts, params, use_tqdm=False)
    llm = make_llm(model_dir, async_scheduling=True)
    fed = []
    execute = llm.engine.runner.execute

    def counting(plan, **kwargs):
        fed.append(kwargs.get("feed") is not None)
        return execute(plan, **kwargs)

    llm.engine.runner.execute = counting
    assert_same_outputs(llm.generate(prompts, params, use_tqdm=False), expected)
    assert sum(fed) >= 4
    llm.engine.check_integrity()
    assert llm.metrics()["state_slots_used"] == 0
