"""Chat turn boundaries in the engine (tiny model, its ChatML-like template): a turn whose reply comes
back as different text still reuses the whole history, outside the marker limit, with outputs equal to
the run without checkpoints; and the reasons a request says its reuse stopped short."""

from __future__ import annotations

import pytest

from forkpoint import LLM, SamplingParams
from forkpoint.inputs.chat import chat_encoder, render_chat_with_images
from forkpoint.inputs.turns import common_prefix_length, reply_continues, turn_boundaries
from tests.helpers import assert_same_outputs
from tests.tiny_models import token_words, words

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
MARK = "<|mamba_checkpoint|>"


def test_a_reply_sent_back_as_other_text_still_reuses_the_history(model_dir, plain):
    """The client rewrites each reply (as a client that re-tokenises or edits it): the turn end does not
    match, the chat-turn boundary does. A marker in the system prompt with max_checkpoints_per_request=1
    still works: boundaries do not count against it."""
    llm = LLM(str(model_dir), num_kv_blocks=256, max_checkpoints_per_request=1)
    encode = chat_encoder(llm.get_tokenizer())
    messages = [{"role": "system", "content": words(*range(30)) + MARK},
                {"role": "user", "content": token_words(1, 20)}]
    previous = None
    for turn in range(4):
        outs = llm.chat(messages, GREEDY, use_tqdm=False)
        ids = encode(messages, True)
        ids = [t for t in ids if t != llm.checkpoint_token_id]
        assert outs[0].prompt_token_ids == ids
        if previous is not None:
            shared = common_prefix_length(previous, ids)
            assert shared - 2 <= outs[0].num_cached_tokens <= shared, turn
        unmarked = [{**m, "content": m["content"].replace(MARK, "")} for m in messages]
        assert_same_outputs(outs, plain.chat(unmarked, GREEDY, use_tqdm=False))
        previous = ids
        reply = token_words(100 + turn, 3)  # not the generated text: another reply of the client's
        messages = messages + [{"role": "assistant", "content": reply},
                               {"role": "user", "content": token_words(turn, 9)}]
    metrics = llm.metrics()
    assert metrics["checkpoint_hits_chat_turn"] == 3 and metrics["checkpoints_created_chat_turn"] == 4
    assert metrics["checkpoints_created_marker"] == 1
    llm.engine.check_integrity()


def test_miss_reasons(model_dir):
    system = {"role": "system", "content": words(*range(40))}
    first = [system, {"role": "user", "content": token_words(7, 12)}]
    second = first + [{"role": "assistant", "content": token_words(8, 3)}, {"role": "user", "content": "w1"}]

    off = LLM(str(model_dir), enable_checkpoints=False, num_kv_blocks=256)
    assert off.chat(first, GREEDY, use_tqdm=False)[0].cache_miss_reason == "disabled"

    llm = LLM(str(model_dir), num_kv_blocks=256)
    assert llm.chat(first, GREEDY, use_tqdm=False)[0].cache_miss_reason is None  # nothing seen before
    out = llm.chat(second, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens > 0 and out.cache_miss_reason == "template_divergence"  # the assistant header

    high = LLM(str(model_dir), num_kv_blocks=256, auto_checkpoint_min_tokens=200)
    high.chat(first, GREEDY, use_tqdm=False)
    out = high.chat(second, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.cache_miss_reason == "below_minimum"
    assert high.metrics()["cache_misses_below_minimum"] == 1

    small = LLM(str(model_dir), num_kv_blocks=256, checkpoint_pool_size=2, checkpoint_host_bytes=0)
    small.chat(first, GREEDY, use_tqdm=False)
    small.generate([token_words(50 + i, 60) for i in range(3)], GREEDY, use_tqdm=False)  # evicts the chat's
    out = small.chat(second, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.cache_miss_reason == "evicted_device"
    assert small.metrics()["cache_misses_evicted_device"] == 1
    small.engine.check_integrity()


# the tiny template, but the generation prompt opens an empty "thought" (w151) that the next turn does not
# render, as Qwen3.5's <think></think> with enable_thinking set
RERENDERING = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant w151 {% endif %}")


@pytest.mark.parametrize("template,turn_ends", [(None, 3), (RERENDERING, 0)], ids=["continues", "re-renders"])
def test_a_chat_session_keeps_one_checkpoint_per_turn(model_dir, plain, template, turn_ends):
    """A chat gets its turn boundary and no prompt-end checkpoint (sent again, it reads the boundary), no junction
    inside the previous turn's generation prompt, and a turn-end checkpoint only when its template renders the
    reply right after the generation prompt: with a re-rendering template one checkpoint per turn, not four."""
    llm = LLM(str(model_dir), num_kv_blocks=256)
    encode = chat_encoder(llm.get_tokenizer(), chat_template=template)
    messages = [{"role": "system", "content": words(*range(40))}, {"role": "user", "content": token_words(3, 12)}]
    previous = None
    for turn in range(3):
        out = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=template)[0]
        assert_same_outputs([out], plain.chat(messages, GREEDY, use_tqdm=False, chat_template=template))
        ids = encode(messages, True)
        if previous is not None:
            shared = common_prefix_length(previous, ids)  # the turn end reaches past it, into the reply
            assert shared - 2 <= out.num_cached_tokens and (turn_ends or out.num_cached_tokens <= shared), turn
        previous = ids
        messages = messages + [{"role": "assistant", "content": out.outputs[0].text},
                               {"role": "user", "content": token_words(20 + turn, 6)}]
    again = llm.chat(messages[:2], GREEDY, use_tqdm=False, chat_template=template)[0]  # the first turn, sent again
    boundary = common_prefix_length(encode(messages[:2], False), encode(messages[:2], True))
    assert again.num_cached_tokens == boundary
    metrics = llm.metrics()
    assert metrics["checkpoints_created_chat_turn"] == 3
    assert metrics["checkpoints_created_turn_end"] == turn_ends
    assert metrics["checkpoints_created_prompt_end"] == 0 and metrics["checkpoints_created_junction"] == 0
    llm.engine.check_integrity()


def _chat_prompt(llm: LLM, messages: list[dict]):
    """The engine prompt `LLM.chat` makes of `messages`: rendered, with its turn boundaries."""
    engine, tokenizer = llm.engine, llm.get_tokenizer()
    text, _ = render_chat_with_images(tokenizer, messages, add_generation_prompt=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    encode = chat_encoder(tokenizer)
    return engine.inputs.process(text, turn_positions=turn_boundaries(encode, messages, ids),
                                 turn_end_reusable=reply_continues(encode, messages, ids))


@pytest.mark.parametrize("cap,exact", [(None, False), (64, False), (64, True)], ids=["no-cap", "cap64", "cap64-exact"])
def test_a_reused_turn_samples_in_the_step_that_first_schedules_it(model_dir, plain, cap, exact):
    """Issue 26's TTFT: a chat turn arriving while other sessions decode reads its previous turn's boundary
    and computes its new tokens (here ~95, more than a prefill budget of 64 beside decodes: a short prefill
    runs whole) in the one step that first schedules it, beside the others' decodes, and samples its first
    token there; outputs equal the run without checkpoints, integrity holds after every step."""
    llm = LLM(str(model_dir), num_kv_blocks=512, max_prefill_tokens_with_decodes=cap, checkpoint_exact=exact)
    engine, scheduler = llm.engine, llm.engine.scheduler
    sessions = [[{"role": "system", "content": words(*range(70))}, {"role": "user", "content": token_words(s, 30)}]
                for s in range(4)]
    for messages in sessions:  # turn 0 of every session: their boundaries are checkpointed
        llm.generate([_chat_prompt(llm, messages)], GREEDY, use_tqdm=False)
    sessions = [m + [{"role": "assistant", "content": token_words(100 + s, 5)},
                     {"role": "user", "content": token_words(200 + s, 80)}] for s, m in enumerate(sessions)]
    decoding = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for s in range(1, 4):
        engine.add_request(f"bystander{s}", _chat_prompt(llm, sessions[s]), decoding)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in scheduler.running) or scheduler.waiting:
        engine.step()
        engine.check_integrity()
    hits = llm.metrics()["checkpoint_hits_chat_turn"]
    engine.add_request("turn", _chat_prompt(llm, sessions[0]), GREEDY)
    outs = engine.step()
    engine.check_integrity()
    turn = next(o for o in outs if o.request_id == "turn")
    step = [o for o in outs if o.request_id.startswith("bystander")]
    assert len(step) == 3 and all(len(o.outputs[0].token_ids) > 1 for o in step)  # they decoded in that step too
    assert len(turn.outputs[0].token_ids) == 1, "the reused turn's first token took more than its first step"
    assert turn.metrics.queued_steps == 0 and turn.metrics.prefill_steps == 1
    assert llm.metrics()["checkpoint_hits_chat_turn"] == hits + 1
    shared = common_prefix_length(_chat_prompt(llm, sessions[0][:2]).token_ids, turn.prompt_token_ids)
    assert 64 < len(turn.prompt_token_ids) - turn.num_cached_tokens and shared - 64 < turn.num_cached_tokens <= shared
    while engine.has_unfinished_requests():
        outs += engine.step()
        engine.check_integrity()
    final = [o for o in outs if o.request_id == "turn" and o.finished]
    assert_same_outputs(final, plain.chat(sessions[0], GREEDY, use_tqdm=False))
