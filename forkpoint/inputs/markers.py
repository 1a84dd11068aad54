"""Prompt inputs of the public API and checkpoint-marker parsing (DESIGN.md section 3).

A prompt's checkpoint positions count real (non-marker) tokens: a marker after the first ``p``
real tokens checkpoints the prefix ``token_ids[:p]`` of the stripped prompt.

    raw ids:      a  b  M  c  d  M  e        (M = marker id)
    stripped:     a  b  c  d  e
    positions:    (2, 4)                      prefixes [a b] and [a b c d]

Positions are exact, never rounded, strictly increasing, and in ``1..len(stripped)``; position
``len(stripped)`` (a marker at the very end) checkpoints the whole prompt.
"""

from __future__ import annotations

import dataclasses
import operator
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
from transformers import PreTrainedTokenizerBase

# "cache_salt" is read by inputs/processor.py (the hash root), not here
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "checkpoint_positions", "multi_modal_data", "cache_salt"})


class RawPrompt(NamedTuple):
    """One prompt input as given, before marker stripping.

    text: the prompt string, or None for a ``{"prompt_token_ids": ...}`` input.
    token_ids: the token ids, markers included.
    checkpoint_positions: the user's ``checkpoint_positions`` (stripped-token coordinates, after
        image placeholder expansion), unvalidated, in the order given; empty when none were given.
    multi_modal_data: the prompt's ``multi_modal_data`` (e.g. ``{"image": [...]}``), unvalidated,
        or None (see inputs/multimodal.py).
    packed: ``token_ids`` as int64 bytes (``cache/hashing.pack_tokens``) when they were packed on
        the way (a ``prompt_token_ids`` input within int64), else None.
    """

    text: str | None
    token_ids: list[int]
    checkpoint_positions: list[int]
    multi_modal_data: Any = None
    packed: bytes | None = None


@dataclass(frozen=True)
class ParsedPrompt:
    """A prompt with its markers removed.

    token_ids: the prompt without any marker id (never empty); treat as read-only.
    checkpoint_positions: strictly increasing positions in ``1..len(token_ids)``.
    packed: ``token_ids`` as int64 bytes when the raw ids came packed, else None (not compared:
        it is the same ids in another form).
    """

    token_ids: list[int]
    checkpoint_positions: tuple[int, ...]
    packed: bytes | None = dataclasses.field(default=None, compare=False, repr=False)


def prompt_to_token_ids(prompt: Any, tokenizer: PreTrainedTokenizerBase) -> RawPrompt:
    """Turn one prompt input of the public API into token ids.

    ``prompt`` is a ``str``, a ``{"prompt": str}`` or a ``{"prompt_token_ids": list[int]}``
    mapping; either mapping may add ``"checkpoint_positions": list[int]`` and
    ``"multi_modal_data": {"image": [...]}``. Text is encoded with
    ``add_special_tokens=False`` (Qwen tokenizers add no BOS), so marker text in it becomes the
    marker id and chat control tokens such as ``<|im_start|>`` become their ids.

    Raises ValueError naming the field on a wrong type, an unknown key, both or neither of
    ``prompt`` and ``prompt_token_ids``, or an empty prompt. Token id ranges are not checked
    here (see ``validate_token_ids``).
    """
    if isinstance(prompt, str):
        return RawPrompt(prompt, _encode(prompt, tokenizer, "prompt"), [])
    if not isinstance(prompt, Mapping):
        raise ValueError(
            f"a prompt must be a str, a {{'prompt': str}} or a {{'prompt_token_ids': list[int]}} "
            f"dict, not {type(prompt).__name__}"
        )
    unknown = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
    if unknown:
        raise ValueError(
            f"unknown prompt field(s) {unknown}: a prompt dict may only have "
            f"{sorted(PROMPT_KEYS)}"
        )
    positions = _int_list(prompt["checkpoint_positions"], "checkpoint_positions") if (
        "checkpoint_positions" in prompt
    ) else []
    images = prompt.get("multi_modal_data")
    if "prompt" in prompt and "prompt_token_ids" in prompt:
        raise ValueError("a prompt dict has both 'prompt' and 'prompt_token_ids': give only one")
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise ValueError(f"'prompt' must be a str, not {type(text).__name__}")
        return RawPrompt(text, _encode(text, tokenizer, "prompt"), positions, images)
    if "prompt_token_ids" in prompt:
        token_ids, packed = _token_id_list(prompt["prompt_token_ids"], "prompt_token_ids")
        if not token_ids:
            raise ValueError("'prompt_token_ids' is empty: a prompt needs at least one token")
        return RawPrompt(None, token_ids, positions, images, packed)
    raise ValueError("a prompt dict needs 'prompt' (a str) or 'prompt_token_ids' (a list of ints)")


def strip_checkpoint_markers(
    token_ids: Sequence[int],
    marker_id: int | None,
    extra_positions: Sequence[int] | None,
    max_checkpoints: int,
    packed: bytes | None = None,
) -> ParsedPrompt:
    """Remove every ``marker_id`` from ``token_ids`` and return the stripped ids with the
    checkpoint positions: one per marker (the count of real tokens before it), merged with
    ``extra_positions`` (the user's ``checkpoint_positions``, in stripped coordinates).

    ``marker_id=None`` means checkpoints are disabled: the ids are returned unchanged and
    ``extra_positions`` is ignored, since nothing is cached.

    ``packed``: ``token_ids`` as int64 bytes (``cache/hashing.pack_tokens``), when the caller has
    them: the markers are then found by one numpy pass, and the result carries the stripped ids
    packed too (``ParsedPrompt.packed``).

    Raises ValueError naming the position and the fix for: an empty prompt (after stripping),
    a checkpoint at position 0, a negative position, a position beyond the prompt length, two
    checkpoints at one position, or more than ``max_checkpoints`` checkpoints.
    """
    if not token_ids:
        raise ValueError("prompt is empty: a prompt needs at least one token")
    if marker_id is None:
        return ParsedPrompt(list(token_ids), (), packed)
    if packed is not None:
        stripped, marker_positions, packed = _split_packed_markers(token_ids, packed, marker_id)
    else:
        stripped, marker_positions = _split_markers(list(token_ids), marker_id)
    if not stripped:
        raise ValueError(
            "prompt is empty after removing checkpoint markers: a prompt needs at least one "
            "token besides its markers"
        )

    seen: set[int] = set()
    for position in marker_positions:
        if position == 0:
            raise ValueError(
                "checkpoint marker at position 0: a checkpoint needs at least one token before "
                "it; remove the marker at the start of the prompt"
            )
        if position in seen:
            raise ValueError(
                f"two checkpoint markers at position {position}: one marker per position; "
                "remove the duplicate"
            )
        seen.add(position)
    for position in extra_positions or ():
        _check_extra_position(position, len(stripped), seen)
        seen.add(position)

    positions = tuple(sorted(seen))
    if len(positions) > max_checkpoints:
        raise ValueError(
            f"prompt has {len(positions)} checkpoints but at most {max_checkpoints} are allowed "
            f"per request; the first one over the limit is at position "
            f"{positions[max_checkpoints]}: remove markers or checkpoint_positions, or raise "
            "max_checkpoints_per_request"
        )
    return ParsedPrompt(stripped, positions, packed)


def _split_markers(token_ids: list[int], marker_id: int) -> tuple[list[int], list[int]]:
    """(the ids without the markers, each marker's position: the count of real tokens before it).
    The markers are found by list.index (a C scan), so a long prompt costs little."""
    stripped: list[int] = []
    marker_positions: list[int] = []
    start = 0
    while True:
        try:
            found = token_ids.index(marker_id, start)
        except ValueError:
            break
        stripped += token_ids[start:found]
        marker_positions.append(len(stripped))
        start = found + 1
    stripped += token_ids[start:]
    return stripped, marker_positions


def _split_packed_markers(token_ids: Sequence[int], packed: bytes,
                          marker_id: int) -> tuple[list[int], list[int], bytes]:
    """`_split_markers` for ids that come packed (int64 bytes, the same ids): the markers are found
    by a numpy comparison; returns the stripped ids packed as well."""
    found = np.flatnonzero(np.frombuffer(packed, np.int64) == marker_id).tolist()
    if not found:
        return list(token_ids), [], packed
    stripped: list[int] = []
    pieces: list[bytes] = []
    start = 0
    for index in found + [len(token_ids)]:
        stripped += token_ids[start:index]
        pieces.append(packed[8 * start: 8 * index])
        start = index + 1
    return stripped, [index - number for number, index in enumerate(found)], b"".join(pieces)


def validate_token_ids(token_ids: Sequence[int], vocab_size: int, packed: bytes | None = None) -> None:
    """Raise ValueError naming the first index whose id is outside ``0..vocab_size-1``.

    ``packed``: the same ids as int64 bytes (``cache/hashing.pack_tokens``), when the caller has
    them: the range check is then one numpy pass instead of Python-level min and max."""
    if packed is not None:
        ids = np.frombuffer(packed, np.int64)
        if len(ids) == len(token_ids) and (not len(ids) or (ids.min() >= 0 and ids.max() < vocab_size)):
            return
    elif not token_ids or (min(token_ids) >= 0 and max(token_ids) < vocab_size):
        return
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < vocab_size:
            raise ValueError(
                f"prompt token id {token_id} at index {index} is out of range: the model's "
                f"vocabulary has ids 0..{vocab_size - 1}"
            )


def _check_extra_position(position: int, prompt_len: int, seen: set[int]) -> None:
    if position < 0:
        raise ValueError(
            f"checkpoint_positions entry {position} is negative: positions count prompt tokens "
            f"(markers excluded) and must lie in 1..{prompt_len}"
        )
    if position == 0:
        raise ValueError(
            "checkpoint at position 0 (in checkpoint_positions): a checkpoint needs at least one "
            f"token before it; use a position in 1..{prompt_len}"
        )
    if position > prompt_len:
        raise ValueError(
            f"checkpoint_positions entry {position} is beyond the prompt length {prompt_len} "
            f"(markers excluded): use a position in 1..{prompt_len}"
        )
    if position in seen:
        raise ValueError(
            f"two checkpoints at position {position} (markers and checkpoint_positions "
            "together): give each position once"
        )


def _encode(text: str, tokenizer: PreTrainedTokenizerBase, field: str) -> list[int]:
    if not text:
        raise ValueError(f"'{field}' is an empty string: a prompt needs at least one token")
    return list(tokenizer.encode(text, add_special_tokens=False))


def _int_list(value: Any, field: str) -> list[int]:
    """``value`` as a list of ints; accepts any non-string sequence of integers (numpy ints
    included), rejects bools and floats."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise ValueError(f"'{field}' must be a list of ints, not {type(value).__name__}")
    if set(map(type, value)) <= {int}:  # plain ints (the common case): one C pass, no per-item checks
        return list(value)
    result = []
    for index, item in enumerate(value):
        if isinstance(item, bool):
            raise ValueError(f"'{field}'[{index}] is a bool ({item}), not an int")
        try:
            result.append(operator.index(item))
        except TypeError:
            raise ValueError(
                f"'{field}'[{index}] must be an int, not {type(item).__name__} ({item!r})"
            ) from None
    return result


def _token_id_list(value: Any, field: str) -> tuple[list[int], bytes | None]:
    """(``_int_list(value, field)``, the same ids as int64 bytes, or None when one lies outside
    int64). ``array("q")`` type-checks and packs every item in one C pass (it takes ints and
    ``__index__`` objects, as ``_int_list`` does); only bools, which it takes as 0 and 1, are looked
    for item by item, among the 0s and 1s. Any other case takes ``_int_list``'s path and message."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        return _int_list(value, field), None
    try:
        ids = array("q", value)
    except (TypeError, OverflowError):
        return _int_list(value, field), None
    low = np.flatnonzero(np.frombuffer(ids, np.int64) >> 1 == 0).tolist()  # the 0s and 1s
    if any(type(value[index]) is bool for index in low):
        return _int_list(value, field), None  # raises, naming the first bool
    return ids.tolist(), ids.tobytes()
