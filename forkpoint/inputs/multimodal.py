"""Images inside prompts: placeholder expansion, checkpoint rules and multi-axis rotary positions.

A prompt names each image with `<|vision_start|><|image_pad|><|vision_end|>` (one per image, in
order), as vLLM's offline API does. forkpoint expands each single `<|image_pad|>` to the image's
token count *before* removing checkpoint markers, so checkpoint positions count expanded tokens,
exactly like `RequestOutput.prompt_token_ids`::

    raw:       a  b  M  VS  P        VE  c          (M = marker, P = one <|image_pad|>)
    expanded:  a  b  M  VS  P P P P  VE  c
    stripped:  a  b     VS  P P P P  VE  c          checkpoint at 2; image offset 3
                        |<- span ->|                a checkpoint at 4..8 would cut the image: ValueError

Positions (transformers' `get_rope_index` for Qwen3.5): text tokens advance one position on all
three axes (temporal, height, width); the tokens of an image with a merged grid h x w all sit at
temporal position p, at height p + row and width p + col, and the text after it resumes at
p + max(h, w). A token at index t past the prompt gets position t + `position_delta` on every axis.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from forkpoint.inputs.images import ImageInput, ImageProcessorConfig, prepare_image
from forkpoint.vision_config import VisionConfig


@dataclass(frozen=True, eq=False)
class PlacedImage:
    """An image and the index of its first `<|image_pad|>` in the marker-free, expanded prompt."""

    image: ImageInput
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.image.num_tokens


@dataclass(frozen=True, eq=False)
class MultimodalPrompt:
    """The images of one prompt and its rotary positions.

    images: in prompt order, non-overlapping. mrope_positions: [3, prompt_len] int64 (T, H, W).
    position_delta: the position of token t >= prompt_len is t + position_delta on all axes.
    """

    images: tuple[PlacedImage, ...]
    mrope_positions: np.ndarray
    position_delta: int

    def hash_keys(self) -> list[tuple[int, bytes]]:
        """(position, content hash) of every image, for `PrefixHasher`'s extra keys."""
        return [(placed.offset, placed.image.content_hash) for placed in self.images]


class ImagePromptProcessor:
    """The engine's image front end: validates `multi_modal_data`, expands placeholders and places
    images (see the module docstring). `vision` is None for a text-only checkpoint."""

    def __init__(self, vision: VisionConfig | None, processor: ImageProcessorConfig | None, max_images: int) -> None:
        self.vision = vision
        self.processor = processor
        self.max_images = max_images

    def load(self, multi_modal_data) -> list[ImageInput]:
        """Decode the images of `{"image": img or [img, ...]}`; [] for None. Raises ValueError for
        unknown modalities, too many images, a text-only model and undecodable data."""
        if multi_modal_data is None:
            return []
        if not isinstance(multi_modal_data, Mapping):
            raise ValueError(f"'multi_modal_data' must be a dict like {{'image': [...]}}, not "
                             f"{type(multi_modal_data).__name__}")
        unknown = sorted(str(key) for key in multi_modal_data if key != "image")
        if unknown:
            raise ValueError(f"unsupported multi_modal_data modality {unknown}: forkpoint takes 'image' only")
        sources = multi_modal_data.get("image")
        if sources is None:
            return []
        if not isinstance(sources, (list, tuple)):
            sources = [sources]
        if not sources:
            return []
        if self.vision is None:
            raise ValueError("this model is text-only (its config.json has no vision_config), so it cannot take "
                             "images: remove multi_modal_data or load a multimodal Qwen3.5 checkpoint")
        if len(sources) > self.max_images or self.processor is None:
            hint = ("images are disabled (max_images_per_prompt=0, the vision tower is not loaded)"
                    if self.max_images == 0 else f"at most {self.max_images} are allowed per prompt")
            raise ValueError(f"prompt has {len(sources)} images but {hint}: send fewer images or raise "
                             "max_images_per_prompt")
        # an ImageInput was prepared by this processor already (e.g. by the server while checking a request)
        return [source if isinstance(source, ImageInput) else prepare_image(source, self.processor,
                                                                             where=f"image {index}")
                for index, source in enumerate(sources)]

    def expand(self, token_ids: Sequence[int], images: Sequence[ImageInput]) -> list[int]:
        """Replace each image's single `<|image_pad|>` by `num_tokens` of them (a run that already
        has `num_tokens` pads, as a processor writes it, is kept). Markers may still be present."""
        if self.vision is None:
            return list(token_ids)
        pad = self.vision.image_token_id
        runs = _runs(token_ids, pad)
        if len(runs) != len(images):
            raise ValueError(
                f"prompt has {len(runs)} image placeholder(s) but {len(images)} image(s): write "
                "'<|vision_start|><|image_pad|><|vision_end|>' once per image, in the order of multi_modal_data")
        if not images:
            return list(token_ids)
        expanded: list[int] = []
        previous = 0
        for index, ((start, end), image) in enumerate(zip(runs, images)):
            if end - start not in (1, image.num_tokens):
                raise ValueError(f"image {index}'s placeholder has {end - start} <|image_pad|> tokens; the image "
                                 f"needs {image.num_tokens}: write one <|image_pad|> and forkpoint expands it")
            expanded.extend(token_ids[previous:start])
            expanded.extend([pad] * image.num_tokens)
            previous = end
        expanded.extend(token_ids[previous:])
        return expanded

    def place(self, token_ids: Sequence[int], checkpoint_positions: Sequence[int],
              images: Sequence[ImageInput]) -> MultimodalPrompt | None:
        """Locate the images in the marker-free prompt, check that each sits inside
        `<|vision_start|>...<|vision_end|>` and that no checkpoint cuts through one, and compute the
        rotary positions. None for a prompt without images."""
        if not images:
            return None
        vision = self.vision
        runs = _runs(token_ids, vision.image_token_id)
        placed = []
        for index, ((start, end), image) in enumerate(zip(runs, images)):
            if start == 0 or token_ids[start - 1] != vision.vision_start_token_id or end == len(token_ids) or (
                    token_ids[end] != vision.vision_end_token_id):
                raise ValueError(f"image {index}'s <|image_pad|> at token {start} is not wrapped in "
                                 "<|vision_start|>...<|vision_end|>: "
                                 "write '<|vision_start|><|image_pad|><|vision_end|>'")
            for position in checkpoint_positions:
                if start - 1 < position <= end:
                    raise ValueError(
                        f"checkpoint at position {position} falls inside image {index}'s placeholder (tokens "
                        f"{start - 1}..{end}, <|vision_start|> to <|vision_end|>): put the marker before "
                        "<|vision_start|> or after <|vision_end|>")
            placed.append(PlacedImage(image, start))
        positions, delta = mrope_positions(len(token_ids), placed, vision.spatial_merge_size)
        return MultimodalPrompt(tuple(placed), positions, delta)


def mrope_positions(length: int, images: Sequence[PlacedImage], merge_size: int) -> tuple[np.ndarray, int]:
    """Rotary positions [3, length] int64 of a prompt with `images`, and the delta of later tokens."""
    positions = np.empty((3, length), dtype=np.int64)
    current = previous = 0
    for placed in images:
        text = placed.offset - previous
        positions[:, previous:placed.offset] = current + np.arange(text, dtype=np.int64)
        current += text
        _, grid_h, grid_w = placed.image.grid_thw
        rows, cols = grid_h // merge_size, grid_w // merge_size
        span = slice(placed.offset, placed.end)
        positions[0, span] = current
        positions[1, span] = current + np.repeat(np.arange(rows, dtype=np.int64), cols)
        positions[2, span] = current + np.tile(np.arange(cols, dtype=np.int64), rows)
        current += max(rows, cols)
        previous = placed.end
    positions[:, previous:] = current + np.arange(length - previous, dtype=np.int64)
    current += length - previous
    return positions, current - length


def _runs(token_ids: Sequence[int], token: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of `token`."""
    array = np.asarray(token_ids, dtype=np.int64)
    hits = np.flatnonzero(array == token)
    if hits.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(hits) != 1)
    starts = np.concatenate(([hits[0]], hits[breaks + 1]))
    ends = np.concatenate((hits[breaks] + 1, [hits[-1] + 1]))
    return [(int(s), int(e)) for s, e in zip(starts, ends)]


def image_prompt_processor(vision: VisionConfig | None, model_dir: str | os.PathLike | None, *, max_images: int,
                           min_pixels: int | None, max_pixels: int | None) -> ImagePromptProcessor:
    """The processor for a model: with preprocessing settings when it has a vision tower and images are enabled."""
    processor = None
    if vision is not None and max_images > 0:
        processor = ImageProcessorConfig.from_model_dir(model_dir, vision, min_pixels=min_pixels,
                                                        max_pixels=max_pixels)
    return ImagePromptProcessor(vision, processor, max_images)
