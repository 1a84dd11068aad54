"""Images for Qwen3.5 prompts: loading, content hashes and preprocessing (PIL and numpy only).

Preprocessing equals transformers' Qwen2-VL image processor (PIL backend, the one Qwen3-VL and
Qwen3.5 use) step for step, so `pixel_values` match it exactly for the same PIL image:

    PIL image --RGB (alpha composited on white)--> smart_resize to multiples of patch*merge
      within [min_pixels, max_pixels] (bicubic) --> x / 255 --> (x - mean) / std
      --> patchify: [grid_h * grid_w, C * temporal_patch * patch * patch] float32

Patch rows are ordered by 2x2 merge block (block row, block col, row in block, col in block), so
every `merge**2` consecutive rows become one `<|image_pad|>` token. A still image fills the
temporal patch by repetition.

Images arrive as PIL images, file paths, raw encoded bytes or `data:image/...;base64,` URLs.
URLs over the network are never fetched.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from forkpoint.vision_config import VisionConfig

# formats PIL decodes reliably for photographs and screenshots (MPO: multi-picture JPEG)
SUPPORTED_FORMATS = frozenset({"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP", "TIFF"})
_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp",
                         "image/tiff"})
_BICUBIC = 3  # PIL.Image.Resampling.BICUBIC, transformers' default for Qwen2-VL


@dataclass(frozen=True)
class ImageProcessorConfig:
    """Preprocessing settings: the model's `preprocessor_config.json` (or Qwen3.5's defaults),
    with the engine's pixel limits on top. `min_pixels` / `max_pixels` bound the resized area."""

    patch_size: int
    temporal_patch_size: int
    merge_size: int
    min_pixels: int
    max_pixels: int
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    resample: int = _BICUBIC

    @property
    def factor(self) -> int:
        """Resized sides are multiples of this (one merged token covers factor x factor pixels)."""
        return self.patch_size * self.merge_size

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike | None, vision: VisionConfig, *, min_pixels: int | None = None,
                       max_pixels: int | None = None) -> ImageProcessorConfig:
        """Read `preprocessor_config.json` when `path` has one (Qwen3.5's defaults otherwise:
        mean = std = 0.5, 65536 to 16777216 pixels); `min_pixels` / `max_pixels` override it."""
        raw: dict = {}
        file = Path(path) / "preprocessor_config.json" if path is not None else None
        if file is not None and file.is_file():
            try:
                raw = json.loads(file.read_text())
            except (OSError, ValueError) as err:
                raise ValueError(f"cannot read {file}: {err}") from err
        for flag in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if raw.get(flag) is False:
                raise ValueError(f"{file} sets {flag}=false, which forkpoint does not support: remove it")
        size = raw.get("size") or {}
        expected = {"patch_size": vision.patch_size, "temporal_patch_size": vision.temporal_patch_size,
                    "merge_size": vision.spatial_merge_size}
        for key, value in expected.items():
            if key in raw and raw[key] != value:
                raise ValueError(f"{file} has {key}={raw[key]} but the vision tower's config.json says {value}: "
                                 "the model directory is inconsistent")
        config = cls(
            patch_size=vision.patch_size,
            temporal_patch_size=vision.temporal_patch_size,
            merge_size=vision.spatial_merge_size,
            min_pixels=int(min_pixels or size.get("shortest_edge") or raw.get("min_pixels") or 65536),
            max_pixels=int(max_pixels or size.get("longest_edge") or raw.get("max_pixels") or 16777216),
            image_mean=tuple(float(x) for x in raw.get("image_mean", (0.5, 0.5, 0.5))),
            image_std=tuple(float(x) for x in raw.get("image_std", (0.5, 0.5, 0.5))),
            rescale_factor=float(raw.get("rescale_factor", 1 / 255)),
            resample=int(raw.get("resample", _BICUBIC)),
        )
        if config.min_pixels > config.max_pixels:
            raise ValueError(f"image min_pixels {config.min_pixels} exceeds max_pixels {config.max_pixels}: "
                             "fix image_min_pixels / image_max_pixels")
        if config.max_pixels < config.factor**2:
            raise ValueError(f"image max_pixels {config.max_pixels} is below one merged patch "
                             f"({config.factor}x{config.factor} = {config.factor**2} pixels): raise image_max_pixels")
        return config


@dataclass(frozen=True, eq=False)
class ImageInput:
    """One decoded image of a prompt.

    image: RGB PIL image at its original size (preprocessed only when its tokens are computed).
    content_hash: 16 bytes naming the RGB pixels (same pixels, same hash, whatever the file).
    grid_thw: patches of the resized image (1, grid_h, grid_w); num_tokens: its `<|image_pad|>`
    count, grid_h * grid_w // merge**2.
    """

    image: Image.Image
    content_hash: bytes
    grid_thw: tuple[int, int, int]
    num_tokens: int


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize`: sides divisible by `factor`, area within
    [min_pixels, max_pixels], aspect ratio kept as closely as possible."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width}x{height} pixels has an aspect ratio above 200, which the vision "
                         "tower cannot take: crop or pad it")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def load_image(source, *, where: str = "image") -> Image.Image:
    """Decode `source` (a PIL image, a file path, encoded bytes or a `data:image/...;base64,` URL)
    into an RGB PIL image; transparency is composited onto white, as transformers does.
    Raises ValueError naming `where` for undecodable data, unsupported formats and network URLs."""
    if isinstance(source, Image.Image):
        return _to_rgb(source)
    if isinstance(source, (bytes, bytearray, memoryview)):
        return _decode(bytes(source), where)
    if isinstance(source, str) and source.startswith("data:"):
        return _decode(_parse_data_url(source, where), where)
    if isinstance(source, str) and source.split(":", 1)[0].lower() in ("http", "https", "ftp", "file"):
        raise ValueError(f"{where} is a URL ({source[:40]}...): forkpoint does not fetch images over the "
                         "network; pass a data:image/...;base64 URL, a local file path or a PIL image")
    if isinstance(source, (str, os.PathLike)):
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"{where}: no image file at {str(path)!r}")
        try:
            data = path.read_bytes()
        except OSError as err:
            raise ValueError(f"{where}: cannot read {str(path)!r}: {err}") from err
        return _decode(data, where)
    raise ValueError(f"{where} is a {type(source).__name__}: pass a PIL image, a file path, encoded bytes or a "
                     "data:image/...;base64 URL")


def content_hash(image: Image.Image) -> bytes:
    """16-byte digest of an RGB image's size and pixels."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(b"rgb")
    digest.update(image.width.to_bytes(4, "little") + image.height.to_bytes(4, "little"))
    digest.update(image.tobytes())
    return digest.digest()


def prepare_image(source, config: ImageProcessorConfig, *, where: str = "image") -> ImageInput:
    """Decode, hash and size one image; pixel preprocessing waits for `pixel_values`."""
    image = load_image(source, where=where)
    try:
        height, width = smart_resize(image.height, image.width, config.factor, config.min_pixels, config.max_pixels)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    grid_h, grid_w = height // config.patch_size, width // config.patch_size
    return ImageInput(image, content_hash(image), (1, grid_h, grid_w), grid_h * grid_w // config.merge_size**2)


def pixel_values(image: ImageInput, config: ImageProcessorConfig) -> np.ndarray:
    """Preprocessed patches [grid_h * grid_w, C * temporal_patch * patch * patch] float32 (see the
    module docstring)."""
    _, grid_h, grid_w = image.grid_thw
    patch, merge = config.patch_size, config.merge_size
    resized = image.image.resize((grid_w * patch, grid_h * patch), resample=config.resample)
    pixels = np.moveaxis(np.asarray(resized), -1, 0)  # [C, H, W] uint8
    pixels = (pixels.astype(np.float64) * config.rescale_factor).astype(np.float32)
    mean = np.asarray(config.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(config.image_std, dtype=np.float32)[:, None, None]
    pixels = (pixels - mean) / std
    channels = pixels.shape[0]
    patches = pixels.reshape(channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    patches = patches.transpose(1, 4, 2, 5, 0, 3, 6)  # (bh, bw, mh, mw, C, ph, pw)
    temporal = config.temporal_patch_size
    patches = np.broadcast_to(patches[:, :, :, :, :, None], (*patches.shape[:5], temporal, patch, patch))
    return np.ascontiguousarray(patches.reshape(grid_h * grid_w, channels * temporal * patch * patch))


def batch_pixel_values(images: Sequence[ImageInput], config: ImageProcessorConfig) -> tuple[np.ndarray, np.ndarray]:
    """Patches of several images concatenated [sum patches, D] and their grids [n, 3] int64."""
    pixels = np.concatenate([pixel_values(image, config) for image in images], axis=0)
    return pixels, np.asarray([image.grid_thw for image in images], dtype=np.int64)


def _to_rgb(image: Image.Image) -> Image.Image:
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _parse_data_url(url: str, where: str) -> bytes:
    """The payload of a base64 data URL with an image media type (the bytes decide the format)."""
    header, sep, payload = url.partition(",")
    if not sep:
        raise ValueError(f"{where}: malformed data URL (no comma): use data:image/png;base64,<data>")
    params = header[len("data:"):].split(";")
    mime = params[0].strip().lower()
    if mime not in _MIME_TYPES:
        raise ValueError(f"{where}: unsupported image type {mime or '(none)'!r} in the data URL: use one of "
                         f"{sorted(_MIME_TYPES)}")
    if "base64" not in params[1:]:
        raise ValueError(f"{where}: the data URL is not base64-encoded: use data:{mime};base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as err:
        raise ValueError(f"{where}: the data URL's base64 payload is invalid ({err})") from None


def _decode(data: bytes, where: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image_format = image.format
        if image_format in SUPPORTED_FORMATS:
            image.load()
    except UnidentifiedImageError:
        raise ValueError(f"{where}: the data is not an image that can be decoded (unknown or unsupported "
                         f"format; supported: {sorted(SUPPORTED_FORMATS)})") from None
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ValueError(f"{where}: the image data cannot be decoded ({err}): is the file complete?") from None
    if image_format not in SUPPORTED_FORMATS:
        raise ValueError(f"{where}: unsupported image format {image_format!r}: use one of {sorted(SUPPORTED_FORMATS)}")
    return _to_rgb(image)
