"""Per-step image inputs: rotary positions of requests with images, and the vision-tower rows of
the image tokens a step computes.

Only images whose `<|image_pad|>` tokens fall inside a segment of this step are encoded: a consumer
that starts from a checkpoint past an image never runs the vision tower for it. Each distinct
image (by content hash) is encoded at most once per step, all missing images in one tower call,
and the outputs stay in a byte-bounded LRU, so a prefill chunked across steps, a preempted
request or another prompt with the same image reuses them.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from forkpoint.inputs.images import ImageInput, ImageProcessorConfig, batch_pixel_values
from forkpoint.step.batch import ForwardBatch
from forkpoint.step.plan import Segment

# (pixel_values [N, D] fp32, grids) -> embeddings [N / merge**2, hidden]
Encoder = Callable[[torch.Tensor, Sequence[Sequence[int]]], torch.Tensor]


class ImageEmbeddingCache:
    """Least-recently-used map content hash -> embeddings [num_tokens, hidden], at most
    `capacity_bytes` in total (an entry larger than that is not kept)."""

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> torch.Tensor | None:
        value = self._entries.get(key)
        if value is not None:
            self._entries.move_to_end(key)
        return value

    def put(self, key: bytes, value: torch.Tensor) -> None:
        size = value.numel() * value.element_size()
        if size > self.capacity_bytes or key in self._entries:
            return
        while self.num_bytes + size > self.capacity_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()
        self._entries[key] = value
        self.num_bytes += size


@dataclass
class VisionStats:
    encoder_calls: int = 0  # vision-tower forwards (one per step at most)
    images_encoded: int = 0
    image_cache_hits: int = 0


class MultimodalInputs:
    """Adds `mrope_positions` and `embedding_overrides` to a step's `ForwardBatch`."""

    def __init__(self, encoder: Encoder, processor: ImageProcessorConfig, cache_bytes: int,
                 device: torch.device) -> None:
        self.encoder = encoder
        self.processor = processor
        self.device = device
        self.cache = ImageEmbeddingCache(cache_bytes)
        self.stats = VisionStats()

    def attach(self, segments: Sequence[Segment], batch: ForwardBatch) -> ForwardBatch:
        """`segments` in packed order (as `build_forward_batch` ordered them). Returns `batch`
        itself when no request in it has images."""
        if all(s.multimodal is None for s in segments):
            return batch
        positions = np.empty((3, batch.num_tokens), dtype=np.int64)
        pieces: list[tuple[int, int, int, ImageInput]] = []  # (batch index, image row, count, image)
        lo = 0
        for segment in segments:
            start, end = segment.start, segment.end
            hi = lo + end - start
            _segment_positions(segment, positions[:, lo:hi])
            multimodal = segment.multimodal
            for placed in multimodal.images if multimodal is not None else ():
                first, last = max(start, placed.offset), min(end, placed.end)
                if first < last:
                    pieces.append((lo + first - start, first - placed.offset, last - first, placed.image))
            lo = hi
        overrides = mrope = None
        if pieces:
            embeddings = self._embeddings([image for *_, image in pieces])
            index = np.concatenate([np.arange(at, at + count) for at, _, count, _ in pieces])
            rows = torch.cat([embeddings[image.content_hash][row: row + count] for _, row, count, image in pieces])
            overrides = (torch.from_numpy(index).to(self.device), rows)
            mrope = torch.from_numpy(positions).to(self.device)
        # without image tokens all three axes agree: the 1-D path gives the same rotary
        return dataclasses.replace(batch, positions=torch.from_numpy(positions[0].copy()).to(self.device),
                                   mrope_positions=mrope, embedding_overrides=overrides)

    def metrics(self) -> dict[str, int]:
        """Vision-tower calls, images encoded, embedding-cache hits and bytes."""
        return dict(vision_encoder_calls=self.stats.encoder_calls, images_encoded=self.stats.images_encoded,
                    image_cache_hits=self.stats.image_cache_hits, image_cache_bytes=self.cache.num_bytes)

    def _embeddings(self, images: Sequence[ImageInput]) -> dict[bytes, torch.Tensor]:
        """Embeddings [num_tokens, hidden] of each distinct image, encoding the uncached ones in one call."""
        found: dict[bytes, torch.Tensor] = {}
        missing: dict[bytes, ImageInput] = {}
        for image in images:
            key = image.content_hash
            if key in found or key in missing:
                continue
            cached = self.cache.get(key)
            if cached is not None:
                found[key] = cached
                self.stats.image_cache_hits += 1
            else:
                missing[key] = image
        if missing:
            todo = list(missing.values())
            pixels, grids = batch_pixel_values(todo, self.processor)
            encoded = self.encoder(torch.from_numpy(pixels), grids.tolist())
            self.stats.encoder_calls += 1
            self.stats.images_encoded += len(todo)
            for image, rows in zip(todo, encoded.split([image.num_tokens for image in todo])):
                # a view would pin the whole call's output while the cache counts only its rows
                rows = rows.clone()
                found[image.content_hash] = rows
                self.cache.put(image.content_hash, rows)
        return found


def _segment_positions(segment: Segment, out: np.ndarray) -> None:
    """Write the rotary positions [3, end - start] of a segment's tokens into `out`."""
    start, end, multimodal = segment.start, segment.end, segment.multimodal
    if multimodal is None:
        out[:] = np.arange(start, end, dtype=np.int64)
        return
    prompt_len = multimodal.mrope_positions.shape[1]
    split = min(max(start, prompt_len), end)
    out[:, : split - start] = multimodal.mrope_positions[:, start:split]
    out[:, split - start:] = np.arange(split, end, dtype=np.int64) + multimodal.position_delta
