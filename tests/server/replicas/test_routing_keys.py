"""The router's checkpoint keys equal the engine's registry keys (`LLM.checkpoint_keys()`)."""

from __future__ import annotations

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.inputs.markers import strip_checkpoint_markers
from forkpoint.server.replicas.routing_keys import RequestKeys
from tests.tiny_models import words

MARKER = "<|mamba_checkpoint|>"


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen3_5_text")
    return LLM(model=str(directory), device="cpu", block_size=4, max_model_len=256, num_kv_blocks=128,
               checkpoint_pool_size=8)


def _keys_of(llm: LLM, prompt: dict | str) -> RequestKeys:
    """Keys as the router computes them from the ingress's prompt (markers stripped by the ingress)."""
    if isinstance(prompt, str):
        ids = llm.get_tokenizer().encode(prompt, add_special_tokens=False)
        positions = []
    else:
        ids, positions = prompt["prompt_token_ids"], prompt["checkpoint_positions"]
    parsed = strip_checkpoint_markers(ids, llm.checkpoint_token_id, positions, 4)
    return RequestKeys.from_prompt({"prompt_token_ids": parsed.token_ids,
                                    "checkpoint_positions": list(parsed.checkpoint_positions)}, block_size=4)


def test_keys_equal_the_engines_registry_keys(llm):
    # markers at 9 (two full blocks and a partial one) and 12 (block-aligned), and a structured position at 3
    nested = words(*range(9)) + MARKER + " " + words(20, 21, 22) + MARKER + " " + words(30, 31)
    structured = {"prompt_token_ids": llm.get_tokenizer().encode(words(*range(40, 50)), add_special_tokens=False),
                  "checkpoint_positions": [3]}
    before = llm.checkpoint_keys()
    llm.generate([nested, structured], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    created = llm.checkpoint_keys() - before
    routed = {own.key for prompt in (nested, structured) for own in _keys_of(llm, prompt).own}
    assert [own.length for own in _keys_of(llm, nested).own] == [9, 12]
    assert routed == created and len(created) == 3


def test_lookup_key_names_the_prefix_a_consumer_reuses(llm):
    anchor = words(*range(60, 71))  # 11 tokens
    llm.generate(anchor + MARKER + " " + words(90), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    consumer = _keys_of(llm, anchor + " " + words(91, 92))  # no marker: found by the lookup at length 11
    assert consumer.own == ()
    assert consumer.at(11) in llm.checkpoint_keys()
    out = llm.generate(anchor + " " + words(91, 92), SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert out[0].num_cached_tokens == 11
    assert consumer.at(13) is None and consumer.at(0) is None  # the whole prompt is never its own source


def test_image_prompts_have_no_router_keys():
    prompt = {"prompt_token_ids": [1, 2, 3], "checkpoint_positions": [2], "multi_modal_data": {"image": ["x"]}}
    assert RequestKeys.from_prompt(prompt, block_size=16) is None
    with pytest.raises(ValueError, match="at least one token"):
        RequestKeys([], [], 16)


def test_a_chats_turn_boundaries_are_keys_of_its_own(llm):
    """A chat prompt's turn boundaries (the engine checkpoints them as CHAT_TURN) name the same keys as the
    engine's, beside its marked positions; a boundary outside the prompt is ignored."""
    ids = llm.get_tokenizer().encode(words(*range(100, 140)), add_special_tokens=False)
    prompt = {"prompt_token_ids": ids, "checkpoint_positions": [3]}
    keys = RequestKeys.from_prompt(prompt, block_size=4, turn_positions=(37, 3, len(ids)))  # 37 >= the minimum
    assert [own.length for own in keys.own] == [3, 37]
    before = llm.checkpoint_keys()
    processed = llm.engine.inputs.process(prompt, turn_positions=[37])
    llm.generate([processed], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    assert {own.key for own in keys.own} <= llm.checkpoint_keys() - before
