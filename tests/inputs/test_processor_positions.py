"""`InputProcessor.process` with chat turn boundaries and cache breakpoints given in the rendered text's
token positions: mapped past markers and image expansion, boundaries outside the marker limit."""

from __future__ import annotations

import pytest

from forkpoint import LLM
from tests.tiny_models import IMAGE, random_image, words


@pytest.fixture(scope="module")
def text_llm(moe_model):
    return LLM(str(moe_model[0]), num_kv_blocks=64, max_checkpoints_per_request=1)


def test_positions_skip_markers_and_stay_outside_the_limit(text_llm):
    marker = text_llm.checkpoint_token_id
    ids = [5, 6, marker, 7, 8, 9, 10]  # stripped: 5 6 7 8 9 10, a marker at 2
    processed = text_llm.engine.inputs.process({"prompt_token_ids": ids}, turn_positions=[5, 3, 7])
    assert processed.token_ids == [5, 6, 7, 8, 9, 10]
    assert processed.checkpoint_positions == (2,)
    assert processed.turn_positions == (4,)  # raw 3 -> 2 is marked (dropped), raw 7 -> 6 is the whole prompt
    with pytest.raises(ValueError, match="at most 1"):  # a breakpoint is a marked checkpoint: it counts
        text_llm.engine.inputs.process({"prompt_token_ids": ids}, breakpoints=[5])
    two = text_llm.engine.inputs.process({"prompt_token_ids": [5, 6, 7, 8, 9]}, breakpoints=[3])
    assert two.checkpoint_positions == (3,) and two.turn_positions == ()


def test_positions_after_an_image_count_its_tokens(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen3_5_moe")
    llm = LLM(str(directory), num_kv_blocks=64, max_num_seqs=4)
    tokenizer = llm.get_tokenizer()
    text = words(*range(10, 20)) + IMAGE + words(3, 4, 5, 6)
    raw = tokenizer.encode(text, add_special_tokens=False)
    image = random_image(1, 40, 24)
    processed = llm.engine.inputs.process({"prompt_token_ids": raw, "multi_modal_data": {"image": [image]}},
                                          turn_positions=[len(raw) - 2, 3])
    extra = len(processed.token_ids) - len(raw)  # the image's tokens beyond its one placeholder
    assert extra > 0
    assert processed.turn_positions == (3, len(raw) - 2 + extra)


def test_positions_without_markers_are_the_raw_ones_and_with_markers_count_them(text_llm):
    """Seeded random prompts, markers or none: each turn position p maps to p minus the markers before it (the
    marker-free case skips the walk over the prompt; both must agree with the count)."""
    import random

    marker = text_llm.checkpoint_token_id
    rng = random.Random(3)
    for _ in range(40):
        ids = [rng.randrange(5, 100) for _ in range(rng.randint(2, 60))]
        if rng.random() < 0.5:
            ids.insert(rng.randrange(1, len(ids)), marker)
        positions = sorted(rng.sample(range(1, len(ids)), min(3, len(ids) - 1)))
        processed = text_llm.engine.inputs.process({"prompt_token_ids": ids}, turn_positions=positions)
        marked = set(processed.checkpoint_positions)
        want = {p - ids[:p].count(marker) for p in positions}
        assert processed.turn_positions == tuple(sorted(p for p in want if 0 < p < len(processed.token_ids)
                                                        and p not in marked))
