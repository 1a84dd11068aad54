"""Marker stripping, checkpoint positions and prompt-input shapes (DESIGN.md section 3)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint.cache.hashing import pack_tokens
from forkpoint.inputs import (
    LoadedTokenizer,
    ParsedPrompt,
    RawPrompt,
    prompt_to_token_ids,
    strip_checkpoint_markers,
    validate_token_ids,
)

MARKER = "<|mamba_checkpoint|>"  # the default checkpoint_token

M = 99  # marker id in the synthetic-id tests


def strip(ids, extra=None, max_checkpoints=4, marker_id=M):
    return strip_checkpoint_markers(ids, marker_id, extra, max_checkpoints)


# ---- strip_checkpoint_markers -----------------------------------------------------------------

def test_single_marker_counts_real_tokens_before_it():
    assert strip([1, 2, M, 3]) == ParsedPrompt([1, 2, 3], (2,))


def test_nested_markers_and_marker_at_end():
    # system prompt | document | question, and the whole prompt
    assert strip([1, M, 2, 3, M, 4, 5, M]) == ParsedPrompt([1, 2, 3, 4, 5], (1, 3, 5))


def test_positions_are_exact_not_block_rounded():
    ids = list(range(40))
    raw = ids[:17] + [M] + ids[17:33] + [M] + ids[33:]
    assert strip(raw).checkpoint_positions == (17, 33)


def test_no_marker_gives_no_positions():
    assert strip([5, 6, 7]) == ParsedPrompt([5, 6, 7], ())


def test_marker_at_position_zero():
    with pytest.raises(ValueError, match="checkpoint marker at position 0: a checkpoint needs at "
                                         "least one token before it"):
        strip([M, 1, 2])


def test_two_markers_at_one_position():
    with pytest.raises(ValueError, match="two checkpoint markers at position 2"):
        strip([1, 2, M, M, 3])


def test_more_markers_than_allowed_names_first_excess_position():
    with pytest.raises(ValueError, match=r"prompt has 5 checkpoints but at most 4 .* at position 5"
                                         r".*max_checkpoints_per_request"):
        strip([1, M, 2, M, 3, M, 4, M, 5, M])


def test_any_checkpoint_with_zero_allowed():
    with pytest.raises(ValueError, match="prompt has 1 checkpoints but at most 0 .* position 1"):
        strip([1, M, 2], max_checkpoints=0)


def test_empty_prompt():
    with pytest.raises(ValueError, match="prompt is empty: a prompt needs at least one token"):
        strip([])


def test_prompt_of_only_markers():
    with pytest.raises(ValueError, match="prompt is empty after removing checkpoint markers"):
        strip([M, M])


def test_extra_positions_are_merged_and_sorted():
    assert strip([1, 2, M, 3, 4, 5], extra=[4, 1]) == ParsedPrompt([1, 2, 3, 4, 5], (1, 2, 4))


def test_extra_position_at_prompt_end_is_allowed():
    assert strip([1, 2, 3], extra=[3]).checkpoint_positions == (3,)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([-1], r"checkpoint_positions entry -1 is negative.* 1\.\.3"),
        ([0], r"checkpoint at position 0 \(in checkpoint_positions\): a checkpoint needs at least "
              r"one token before it"),
        ([4], r"checkpoint_positions entry 4 is beyond the prompt length 3"),
        ([2, 2], r"two checkpoints at position 2"),
        ([1], r"two checkpoints at position 1 \(markers and checkpoint_positions"),
    ],
)
def test_bad_extra_positions(extra, message):
    with pytest.raises(ValueError, match=message):
        strip([1, M, 2, 3], extra=extra)


def test_extra_positions_count_towards_the_limit():
    with pytest.raises(ValueError, match="prompt has 3 checkpoints but at most 2 .* position 3"):
        strip([1, M, 2, 3, 4], extra=[2, 3], max_checkpoints=2)


def test_checkpoints_disabled_keeps_ids_and_ignores_positions():
    parsed = strip([1, M, 2], extra=[1, 7], marker_id=None)
    assert parsed == ParsedPrompt([1, M, 2], ())


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 1000).filter(lambda i: i != M), min_size=1, max_size=60),
    data=st.data(),
)
def test_inserting_then_stripping_markers_round_trips(ids, data):
    positions = data.draw(st.lists(st.integers(1, len(ids)), unique=True, max_size=6))
    as_markers = set(data.draw(st.lists(st.sampled_from(positions), unique=True))) if positions else set()
    raw: list[int] = []
    for index, token in enumerate(ids):
        if index in as_markers:
            raw.append(M)
        raw.append(token)
    if len(ids) in as_markers:
        raw.append(M)
    extra = [p for p in positions if p not in as_markers]

    parsed = strip_checkpoint_markers(raw, M, extra, max_checkpoints=6)

    assert parsed.token_ids == ids
    assert parsed.checkpoint_positions == tuple(sorted(positions))


def _outcome(function, *args):
    """(result, None) or (None, the ValueError's message)."""
    try:
        return function(*args), None
    except ValueError as err:
        return None, str(err)


@settings(max_examples=200, deadline=None)
@given(raw=st.lists(st.sampled_from([0, 1, 7, M, 2**40]), min_size=1, max_size=40),
       extra=st.lists(st.integers(-1, 45), max_size=3))
def test_packed_marker_scan_equals_the_list_scan(raw, extra):
    # the processor hands the ids packed: same stripped ids, positions and errors, and the result packed
    plain, plain_error = _outcome(strip_checkpoint_markers, raw, M, extra, 4)
    packed, packed_error = _outcome(strip_checkpoint_markers, raw, M, extra, 4, pack_tokens(raw))
    assert packed_error == plain_error
    if plain is not None:
        assert packed == plain and packed.packed == pack_tokens(plain.token_ids)


@settings(max_examples=300, deadline=None)
@given(items=st.lists(st.one_of(st.integers(-3, 300), st.integers(-2**70, 2**70), st.booleans(),
                                st.integers(0, 9).map(np.int64), st.floats(0, 2), st.none()),
                      min_size=1, max_size=30))
def test_token_id_prompts_type_check_as_the_item_by_item_path(items):
    # prompt_token_ids are packed and type-checked in one C pass; the answer (ids or message) must be
    # the item-by-item one: bools and floats rejected at their index, numpy ints taken as ints
    fast, fast_error = _outcome(prompt_to_token_ids, {"prompt_token_ids": items}, None)
    reference, reference_error = _outcome(_reference_int_list, items)
    assert fast_error == reference_error
    if reference is not None:
        assert fast.token_ids == reference and {type(i) for i in fast.token_ids} == {int}
        in_int64 = all(-2**63 <= i < 2**63 for i in reference)
        assert fast.packed == (pack_tokens(reference) if in_int64 else None)


def _reference_int_list(items):
    ids = []
    for index, item in enumerate(items):
        if isinstance(item, bool):
            raise ValueError(f"'prompt_token_ids'[{index}] is a bool ({item}), not an int")
        if not isinstance(item, (int, np.integer)):
            raise ValueError(f"'prompt_token_ids'[{index}] must be an int, not {type(item).__name__} ({item!r})")
        ids.append(int(item))
    return ids


# ---- validate_token_ids -----------------------------------------------------------------------

@pytest.mark.parametrize("packed", [False, True])
def test_validate_token_ids_names_first_bad_index_and_value(packed):
    def validate(ids, vocab_size):  # with the ids packed, the range check is a numpy pass
        validate_token_ids(ids, vocab_size, pack_tokens(ids) if packed else None)

    validate([0, 5, 99], 100)
    with pytest.raises(ValueError, match=r"prompt token id 300 at index 2 is out of range.* 0\.\.99"):
        validate([1, 2, 300, -1], 100)
    with pytest.raises(ValueError, match="prompt token id -1 at index 0"):
        validate([-1], 100)
    with pytest.raises(ValueError, match="prompt token id 100 at index 1"):
        validate([99, 100], 100)


# ---- prompt_to_token_ids ----------------------------------------------------------------------

def test_text_prompt_with_marker(qwen: LoadedTokenizer):
    tok = qwen.tokenizer
    raw = prompt_to_token_ids(f"Hello world{MARKER} and more", tok)
    assert raw.text == f"Hello world{MARKER} and more"
    assert raw.token_ids.count(qwen.checkpoint_token_id) == 1
    parsed = strip_checkpoint_markers(raw.token_ids, qwen.checkpoint_token_id, raw.checkpoint_positions, 4)
    head = tok.encode("Hello world", add_special_tokens=False)
    assert parsed.checkpoint_positions == (len(head),)
    assert parsed.token_ids == head + tok.encode(" and more", add_special_tokens=False)


def test_prompt_dict_with_positions(qwen: LoadedTokenizer):
    raw = prompt_to_token_ids({"prompt": "abc def ghi", "checkpoint_positions": [1]}, qwen.tokenizer)
    assert raw == RawPrompt("abc def ghi", qwen.tokenizer.encode("abc def ghi", add_special_tokens=False), [1])


def test_token_id_prompt_with_marker_id(qwen: LoadedTokenizer):
    marker = qwen.checkpoint_token_id
    raw = prompt_to_token_ids(
        {"prompt_token_ids": [10, 11, marker, 12, np.int64(13)], "checkpoint_positions": (4,)},
        qwen.tokenizer,
    )
    assert raw == RawPrompt(None, [10, 11, marker, 12, 13], [4], None, pack_tokens([10, 11, marker, 12, 13]))
    assert {type(token_id) for token_id in raw.token_ids} == {int}
    parsed = strip_checkpoint_markers(raw.token_ids, marker, raw.checkpoint_positions, 4)
    assert parsed == ParsedPrompt([10, 11, 12, 13], (2, 4))
    packed = strip_checkpoint_markers(raw.token_ids, marker, raw.checkpoint_positions, 4, raw.packed)
    assert packed == parsed and packed.packed == pack_tokens([10, 11, 12, 13])


def test_text_prompt_adds_no_bos(qwen: LoadedTokenizer):
    ids = prompt_to_token_ids("hi there", qwen.tokenizer).token_ids
    assert ids == qwen.tokenizer.encode("hi there", add_special_tokens=True)
    assert len(ids) == 2


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (42, "a prompt must be a str, .* not int"),
        (["a"], "a prompt must be a str, .* not list"),
        ("", "'prompt' is an empty string"),
        ({}, "a prompt dict needs 'prompt' .* or 'prompt_token_ids'"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "both 'prompt' and 'prompt_token_ids'"),
        ({"prompt": "x", "salt": "s"}, r"unknown prompt field\(s\) \['salt'\]"),  # cache_salt is a field (vLLM's)
        ({"prompt": 3}, "'prompt' must be a str, not int"),
        ({"prompt": ""}, "'prompt' is an empty string"),
        ({"prompt_token_ids": []}, "'prompt_token_ids' is empty"),
        ({"prompt_token_ids": "1 2"}, "'prompt_token_ids' must be a list of ints, not str"),
        ({"prompt_token_ids": [1, 2.5]}, r"'prompt_token_ids'\[1\] must be an int, not float"),
        ({"prompt_token_ids": [True]}, r"'prompt_token_ids'\[0\] is a bool"),
        ({"prompt": "x", "checkpoint_positions": 3}, "'checkpoint_positions' must be a list of ints"),
        ({"prompt": "x", "checkpoint_positions": ["1"]}, r"'checkpoint_positions'\[0\] must be an int"),
    ],
)
def test_bad_prompt_shapes(qwen: LoadedTokenizer, prompt, message):
    with pytest.raises(ValueError, match=message):
        prompt_to_token_ids(prompt, qwen.tokenizer)
