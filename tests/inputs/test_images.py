"""Image loading and preprocessing against transformers' Qwen2-VL image processor (PIL backend),
placeholder expansion, multi-axis rotary positions against transformers' `get_rope_index`, and
chat image parts."""

from __future__ import annotations

import base64
import io
import types

import numpy as np
import pytest
import torch
from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as hf_smart_resize
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model

from forkpoint.inputs.chat import IMAGE_PLACEHOLDER, render_chat_with_images
from forkpoint.inputs.images import (
    ImageProcessorConfig,
    batch_pixel_values,
    load_image,
    pixel_values,
    prepare_image,
    smart_resize,
)
from forkpoint.inputs.multimodal import ImagePromptProcessor, mrope_positions
from forkpoint.vision_config import VisionConfig
from tests.tiny_models import random_image

VISION = VisionConfig.from_dict({"patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
                                 "out_hidden_size": 64}, {"image_token_id": 9, "video_token_id": 8,
                                                          "vision_start_token_id": 7, "vision_end_token_id": 6})
PAD, VS, VE = 9, 7, 6
MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]


def config(min_pixels=56 * 56, max_pixels=28 * 28 * 64) -> ImageProcessorConfig:
    return ImageProcessorConfig(patch_size=14, temporal_patch_size=2, merge_size=2, min_pixels=min_pixels,
                                max_pixels=max_pixels, image_mean=tuple(MEAN), image_std=tuple(STD))


def oracle(min_pixels=56 * 56, max_pixels=28 * 28 * 64) -> Qwen2VLImageProcessorPil:
    return Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=min_pixels,
                                    max_pixels=max_pixels, image_mean=MEAN, image_std=STD)


def palette_with_transparency() -> Image.Image:
    image = random_image(4, 33, 61).convert("P")
    image.info["transparency"] = 3
    return image


@pytest.mark.parametrize("image", [
    random_image(0, 100, 60), random_image(1, 37, 211, "RGBA"), random_image(2, 90, 90, "L"),
    random_image(3, 700, 500),  # shrunk to max_pixels
    random_image(5, 20, 30),  # grown to min_pixels
    palette_with_transparency(),
], ids=["rgb", "rgba", "gray", "large", "small", "palette"])
def test_pixel_values_equal_transformers(image):
    ours = prepare_image(image, config())
    pixels, grids = batch_pixel_values([ours], config())
    ref = oracle()(images=[image], return_tensors="np")
    assert np.array_equal(grids, ref["image_grid_thw"])
    assert pixels.dtype == np.float32 and np.array_equal(pixels, ref["pixel_values"])  # bit for bit
    assert ours.num_tokens == int(np.prod(grids[0])) // 4


def test_pixel_limits_come_from_the_config():
    image = random_image(0, 640, 480)
    for max_pixels in (28 * 28 * 4, 28 * 28 * 64, 28 * 28 * 256):
        ours = prepare_image(image, config(max_pixels=max_pixels))
        ref = oracle(max_pixels=max_pixels)(images=[image], return_tensors="np")
        assert list(ours.grid_thw) == ref["image_grid_thw"][0].tolist()
        assert ours.num_tokens * 28 * 28 <= max_pixels


@pytest.mark.parametrize("size", [(28, 28), (1, 199), (500, 3), (1000, 999), (57, 113), (4000, 21)])
def test_smart_resize_equals_transformers(size):
    assert smart_resize(*size, 28, 56 * 56, 28 * 28 * 1280) == hf_smart_resize(*size, 28, 56 * 56, 28 * 28 * 1280)


def encoded(image: Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    return buffer.getvalue()


def test_sources_decode_to_the_same_pixels_and_hash(tmp_path):
    image = random_image(8, 31, 17)
    path = tmp_path / "a.png"
    path.write_bytes(encoded(image, "PNG"))
    url = "data:image/png;base64," + base64.b64encode(encoded(image, "PNG")).decode()
    inputs = [prepare_image(source, config()) for source in (image, str(path), path, encoded(image, "PNG"), url)]
    assert len({i.content_hash for i in inputs}) == 1
    assert all(np.array_equal(np.asarray(i.image), np.asarray(image)) for i in inputs)
    assert prepare_image(random_image(9, 31, 17), config()).content_hash != inputs[0].content_hash
    jpeg = load_image(encoded(image, "JPEG"))
    assert jpeg.mode == "RGB" and jpeg.size == image.size


def test_pixel_values_are_computed_lazily_from_the_decoded_image():
    image = prepare_image(random_image(1, 56, 84), config())
    assert pixel_values(image, config()).shape == (image.grid_thw[1] * image.grid_thw[2], 3 * 2 * 14 * 14)


@pytest.mark.parametrize(("source", "message"), [
    (b"garbage", "not an image that can be decoded"),
    ("data:image/png,abc", "not base64-encoded"),
    ("data:image/png;base64", "malformed data URL"),
    ("data:text/plain;base64,aGk=", "unsupported image type 'text/plain'"),
    ("http://example.com/a.png", "does not fetch images"),
    ("file:///etc/passwd", "does not fetch images"),
    (3.5, "is a float"),
])
def test_load_errors(source, message):
    with pytest.raises(ValueError, match=message):
        load_image(source)


def test_unsupported_container_format():
    with pytest.raises(ValueError, match="unsupported image format 'ICO'"):
        load_image(encoded(random_image(0, 16, 16), "ICO"))


# ---------------------------------------------------------------- placeholders and positions
def image_of(tokens_h: int, tokens_w: int):
    return types.SimpleNamespace(grid_thw=(1, 2 * tokens_h, 2 * tokens_w), num_tokens=tokens_h * tokens_w,
                                 content_hash=bytes([tokens_h, tokens_w]) * 8)


def processor(max_images=4) -> ImagePromptProcessor:
    return ImagePromptProcessor(VISION, config(), max_images)


def test_expand_then_place():
    images = [image_of(2, 3), image_of(4, 1)]
    raw = [1, 2, VS, PAD, VE, 3, VS, PAD, VE, 4]
    ids = processor().expand(raw, images)
    assert ids == [1, 2, VS] + [PAD] * 6 + [VE, 3, VS] + [PAD] * 4 + [VE, 4]
    assert processor().expand(ids, images) == ids  # already expanded runs are kept
    placed = processor().place(ids, [2, 10], images)
    assert [p.offset for p in placed.images] == [3, 12]
    assert placed.hash_keys() == [(3, images[0].content_hash), (12, images[1].content_hash)]
    with pytest.raises(ValueError, match="image 1's placeholder has 2 <\\|image_pad\\|> tokens; the image needs 4"):
        processor().expand([VS, PAD, VE, VS, PAD, PAD, VE], images)


def test_mrope_positions_equal_transformers_get_rope_index():
    images = [image_of(2, 3), image_of(1, 1), image_of(4, 2)]
    ids = processor().expand([5, VS, PAD, VE, 5, 5, VS, PAD, VE, VS, PAD, VE, 5, 5, 5], images)
    placed = processor().place(ids, [], images)
    vision_config = types.SimpleNamespace(spatial_merge_size=2)
    fake = types.SimpleNamespace(config=types.SimpleNamespace(vision_config=vision_config),
                                 get_vision_position_ids=lambda *a, **k: Qwen3_5Model.get_vision_position_ids(
                                     None, *a, **k))
    input_ids = torch.tensor([ids])
    ref, delta = Qwen3_5Model.get_rope_index(fake, input_ids, (input_ids == PAD).int(),
                                             image_grid_thw=torch.tensor([i.grid_thw for i in images]))
    assert np.array_equal(placed.mrope_positions, ref[:, 0].numpy())
    assert placed.position_delta == int(delta)
    text_only, zero = mrope_positions(7, [], 2)
    assert zero == 0 and np.array_equal(text_only, np.tile(np.arange(7), (3, 1)))


# ---------------------------------------------------------------- chat
class _Tokenizer:
    chat_template = "x"

    def apply_chat_template(self, conversation, **kwargs):
        return "|".join(m["content"] for m in conversation)


def test_chat_image_parts_become_placeholders():
    url = "data:image/png;base64,AAAA"
    pil = random_image(0, 8, 8)
    text, images = render_chat_with_images(_Tokenizer(), [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "image", "image": pil}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c"}])
    assert text == f"a\n{IMAGE_PLACEHOLDER}\n{IMAGE_PLACEHOLDER}\nb|c"
    assert images[0] == url and images[1] is pil
