"""The input processor: one prompt in any accepted form -> a validated `ProcessedPrompt`.

It tokenizes (or takes token ids), loads and places images, strips checkpoint markers (positions
count real tokens, images expanded), validates ids and lengths, and builds the prompt's chained
prefix hasher. It allocates nothing: a ValueError leaves nothing behind. Thread-safe: the server's
tokenizer threads call `process` concurrently.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from forkpoint.cache.hashing import HasherCache, PrefixHasher, pack_tokens
from forkpoint.inputs.markers import prompt_to_token_ids, strip_checkpoint_markers, validate_token_ids
from forkpoint.inputs.multimodal import ImagePromptProcessor, MultimodalPrompt


@dataclass(frozen=True)
class ProcessedPrompt:
    """text: the prompt text (None for token-id prompts); token_ids: without markers;
    checkpoint_positions: marked positions (sorted, exact; cache breakpoints included); multimodal: image
    placement or None; hasher: chained hashes of token_ids' prefixes (plus image content keys);
    turn_positions: a chat's turn boundaries (inputs/turns.py), sorted, in 1..len(token_ids)-1, none of
    them marked: automatic checkpoints of their own kind, outside max_checkpoints; turn_end_reusable: whether
    the state after this prompt and its reply can start the next prompt (False for a chat whose template
    re-renders the reply, `turns.reply_continues`: the engine keeps no turn-end checkpoint for it).

    The engine takes a `ProcessedPrompt` as it is (the server builds them: prompts are processed once)."""

    text: str | None
    token_ids: list[int]
    checkpoint_positions: tuple[int, ...]
    multimodal: MultimodalPrompt | None
    hasher: PrefixHasher
    turn_positions: tuple[int, ...] = ()
    turn_end_reusable: bool = True


class PromptTooLongError(ValueError):
    """The prompt has max_model_len tokens or more (the server answers code context_length_exceeded)."""


@dataclass(frozen=True)
class PromptLimits:
    """vocab_size: ids must lie below it; max_model_len: prompts must be shorter; max_kv_blocks: the
    KV pool's size in blocks of `block_size` (a prompt plus one token must fit it);
    max_checkpoints: markers allowed per prompt."""

    vocab_size: int
    max_model_len: int
    block_size: int
    max_kv_blocks: int
    max_checkpoints: int


class InputProcessor:
    def __init__(self, tokenizer, checkpoint_token_id: int | None, images: ImagePromptProcessor,
                 limits: PromptLimits) -> None:
        self.tokenizer = tokenizer
        self.checkpoint_token_id = checkpoint_token_id
        self.images = images
        self.limits = limits
        self.hashers = HasherCache(limits.block_size)  # a burst behind one anchor hashes it once
        # the server's tokenizer threads process prompts concurrently; the hasher cache's LRU update is several
        # steps (another thread's eviction could remove a key between them): one build at a time (hashing
        # 16-token blocks holds the GIL anyway, so the lock costs no parallelism)
        self._hashing = threading.Lock()

    def process(self, prompt, *, turn_positions: Sequence[int] = (), breakpoints: Sequence[int] = (),
                turn_end_reusable: bool = True) -> ProcessedPrompt:
        """`prompt`: a str, {"prompt": str} or {"prompt_token_ids": [...]} (optionally with
        "checkpoint_positions", "multi_modal_data" and "cache_salt", as in vLLM). `turn_positions` (chat turn
        boundaries) and `breakpoints` (cache breakpoints, checkpoints like markers) count the prompt's own tokens as
        given, markers and one `<|image_pad|>` per image included (inputs/turns.py computes them so).
        Raises ValueError naming the problem."""
        limits = self.limits
        raw = prompt_to_token_ids(prompt, self.tokenizer)
        images = self.images.load(raw.multi_modal_data)
        raw_ids = self.images.expand(raw.token_ids, images)  # markers count expanded image tokens
        # packed once (or on the way in): the marker scan, the range check and every block hash read it
        packed = raw.packed if raw.packed is not None and not images else _packed(raw_ids)
        if turn_positions or breakpoints:
            to_final = self._position_map(raw.token_ids, images)
            turn_positions = [to_final[p] for p in turn_positions if to_final[p] is not None]
            extra = {to_final[p] for p in breakpoints if to_final[p] is not None}
            positions = list(raw.checkpoint_positions) + sorted(extra - set(raw.checkpoint_positions))
        else:
            positions = raw.checkpoint_positions
        parsed = strip_checkpoint_markers(raw_ids, self.checkpoint_token_id, positions, limits.max_checkpoints,
                                          packed)
        token_ids, packed = parsed.token_ids, parsed.packed  # a fresh list; None beyond int64
        validate_token_ids(token_ids, limits.vocab_size, packed)
        if len(token_ids) >= limits.max_model_len:
            raise PromptTooLongError(f"prompt has {len(token_ids)} tokens, max_model_len is {limits.max_model_len}: "
                             "shorten the prompt or raise max_model_len")
        needed = -(-(len(token_ids) + 1) // limits.block_size)
        if needed > limits.max_kv_blocks:
            raise ValueError(f"prompt needs {needed} KV blocks but the pool has {limits.max_kv_blocks}: "
                             "raise kv_cache_bytes / num_kv_blocks")
        multimodal = self.images.place(token_ids, parsed.checkpoint_positions, images)
        salt = cache_salt_key(prompt)
        with self._hashing:
            hasher = self.hashers.build(token_ids, salt, extra_keys=multimodal.hash_keys() if multimodal is not None
                                        else (), packed=packed)
        marked = set(parsed.checkpoint_positions)
        turns = tuple(sorted({p for p in turn_positions if 0 < p < len(token_ids) and p not in marked}))
        return ProcessedPrompt(raw.text, token_ids, tuple(sorted(marked)), multimodal, hasher, turns,
                               turn_end_reusable)

    def _position_map(self, raw_ids: list[int], images: list) -> Sequence[int | None]:
        """For each raw position p (0..len(raw_ids)): the number of processed tokens before it (markers
        removed, each image's `<|image_pad|>` run expanded), None inside an image's run. Without images or
        markers (a chat prompt as a rule) that is p itself: a range, not a walk over the prompt."""
        if not images and (self.checkpoint_token_id is None or self.checkpoint_token_id not in raw_ids):
            return range(len(raw_ids) + 1)
        ids = np.asarray(raw_ids, dtype=object if _packed(raw_ids) is None else np.int64)
        weights = np.ones(len(raw_ids), np.int64)
        if self.checkpoint_token_id is not None:
            weights[ids == self.checkpoint_token_id] = 0
        inside: list[tuple[int, int]] = []
        if images:
            pads = np.flatnonzero(ids == self.images.vision.image_token_id).tolist()
            runs = [[pads[0], pads[0] + 1]] if pads else []
            for index in pads[1:]:
                if index == runs[-1][1]:
                    runs[-1][1] += 1
                else:
                    runs.append([index, index + 1])
            for (start, end), image in zip(runs, images):
                weights[start:end] = 0
                weights[start] = image.num_tokens
                inside.append((start, end))
        counts: list[int | None] = [0] + np.cumsum(weights).tolist()
        for start, end in inside:
            counts[start + 1: end] = [None] * (end - start - 1)
        return counts


def cache_salt_key(prompt) -> bytes:
    """The hash root's extra bytes for a prompt's `cache_salt` (b"" without one). Prompts with different
    salts share no checkpoint and no KV block: the salt is part of every block's chained hash, so no
    lookup, junction or reuse count crosses salts. Raises ValueError for a salt that is not a non-empty str."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is None:
        return b""
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt must be a non-empty string, got {salt!r}")
    try:
        return b"cache_salt\x00" + salt.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"cache_salt is not valid UTF-8 text ({err.reason} at {err.start})") from err


def _packed(token_ids: list[int]) -> bytes | None:
    """`pack_tokens(token_ids)`, or None for an id beyond int64 (`validate_token_ids` names it)."""
    try:
        return pack_tokens(token_ids)
    except OverflowError:
        return None
