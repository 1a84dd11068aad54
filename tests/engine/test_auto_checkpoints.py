"""Automatic checkpoints: reuse without markers, at exact positions, with outputs identical to an
engine without checkpoints (float32 CPU, tiny model)."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.cache.checkpoint_types import CheckpointKind
from tests.helpers import assert_same_outputs
from tests.tiny_models import words

GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
MARK = "<|mamba_checkpoint|>"


def random_ids(generator: torch.Generator, n: int, low: int = 0, high: int = 150) -> list[int]:
    return torch.randint(low, high, (n,), generator=generator).tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def computed(llm: LLM, fn):
    before = llm.metrics()["prompt_tokens_computed"]
    result = fn()
    return result, llm.metrics()["prompt_tokens_computed"] - before


def test_cold_batch_reuses_exactly_the_common_prefix(model_dir, plain):
    generator = torch.Generator().manual_seed(1)
    prefix = random_ids(generator, 133)
    prompts = [prefix + random_ids(generator, 5 + i) for i in range(8)]
    llm = LLM(str(model_dir), num_kv_blocks=256)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    expected = [0] + [max(common_prefix(p, q) for q in prompts[:i]) for i, p in enumerate(prompts) if i]
    assert [o.num_cached_tokens for o in outs] == expected
    assert min(expected[1:]) == 133
    refs = plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_same_outputs(outs, refs)
    metrics = llm.metrics()
    assert metrics["checkpoints_created_shared_prefix"] >= 1 and metrics["checkpoint_hits_shared_prefix"] >= 7
    assert metrics["requests_deferred"] == 0  # the consumers ran in the producer's step
    llm.engine.check_integrity()


def test_a_burst_larger_than_one_step_keeps_its_shared_prefix_with_few_checkpoint_slots(model_dir, plain):
    """40 requests sharing a 100-token prefix, 24 admitted by the first step's budget, 8 checkpoint
    slots: the prompt-end and turn-end checkpoints of the first ones must not evict the shared
    prefix the queued ones will read (they reserve it), so every later request computes only its
    suffix (before the reservations: 2,140 tokens computed instead of 740)."""
    generator = torch.Generator().manual_seed(8)
    prefix = random_ids(generator, 100)
    # suffixes start with distinct ids: the common prefix is exactly the 100 tokens
    prompts = [{"prompt_token_ids": prefix + [100 + i] + random_ids(generator, 15)} for i in range(40)]
    llm = LLM(str(model_dir), num_kv_blocks=1024, checkpoint_pool_size=8, max_num_batched_tokens=512)
    outs, cost = computed(llm, lambda: llm.generate(prompts, SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False))
    assert cost == 100 + 40 * 16
    assert [o.num_cached_tokens for o in outs] == [0] + [100] * 39
    refs = plain.generate(prompts, SamplingParams(max_tokens=1, logprobs=2), use_tqdm=False)
    assert_same_outputs(outs, refs)
    llm.engine.check_integrity()


def test_one_at_a_time_family_reuses_the_shared_prefix_from_the_third_on(model_dir, plain):
    generator = torch.Generator().manual_seed(2)
    prefix = random_ids(generator, 90)
    prompts = [prefix + random_ids(generator, 6, low=100) for _ in range(5)]
    llm = LLM(str(model_dir), num_kv_blocks=256)
    outs = [llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0] for p in prompts]
    shared = [max(common_prefix(p, q) for q in prompts[:i]) for i, p in enumerate(prompts) if i]
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == 0  # nothing was stored there yet
    assert [o.num_cached_tokens for o in outs[2:]] == shared[1:]  # the junction the second one wrote
    assert llm.metrics()["checkpoint_hits_junction"] == 3
    refs = plain.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert_same_outputs(outs, refs)


def test_the_same_prompt_again_computes_one_token(model_dir, plain):
    prompt = random_ids(torch.Generator().manual_seed(3), 225)
    llm = LLM(str(model_dir), num_kv_blocks=256)
    first, cost_first = computed(llm, lambda: llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False))
    again, cost_again = computed(llm, lambda: llm.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False))
    assert (cost_first, cost_again) == (225, 1) and again[0].num_cached_tokens == 224
    assert_same_outputs(again, plain.generate({"prompt_token_ids": prompt}, GREEDY, use_tqdm=False))
    assert_same_outputs(again, first)


def test_turns_by_token_ids_compute_only_their_new_tokens_plus_one(model_dir, plain):
    generator = torch.Generator().manual_seed(4)
    llm = LLM(str(model_dir), num_kv_blocks=256)
    conversation = random_ids(generator, 40)
    for turn in range(8):
        new = len(conversation) if turn == 0 else 7 + 1  # the last output token was never computed
        outs, cost = computed(llm, lambda c=conversation: llm.generate({"prompt_token_ids": c}, GREEDY, use_tqdm=False))
        assert cost == new, f"turn {turn}"
        assert_same_outputs(outs, plain.generate({"prompt_token_ids": conversation}, GREEDY, use_tqdm=False))
        conversation = conversation + outs[0].outputs[0].token_ids + random_ids(generator, 7)
    assert llm.metrics()["checkpoint_hits_turn_end"] == 7
    llm.engine.check_integrity()


def test_chat_turns_reuse_the_previous_turn(model_dir, plain):
    """The chat template renders earlier turns to the tokens they were generated as (here: outputs
    that round-trip through the tokenizer), so each turn computes its new tokens plus one."""
    llm = LLM(str(model_dir), num_kv_blocks=256)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    messages = [{"role": "system", "content": words(*range(30))}, {"role": "user", "content": words(40, 41, 42)}]
    previous = None
    for turn in range(4):
        outs, cost = computed(llm, lambda m=messages: llm.chat(m, params, use_tqdm=False))
        out = outs[0]
        if previous is not None:
            reused = previous.prompt_token_ids + previous.outputs[0].token_ids[:-1]
            assert out.prompt_token_ids[: len(reused)] == reused
            assert out.num_cached_tokens == len(reused) and cost == len(out.prompt_token_ids) - len(reused)
        assert out.outputs[0].token_ids == plain.chat(messages, params, use_tqdm=False)[0].outputs[0].token_ids
        previous = out
        text = llm.get_tokenizer().decode(out.outputs[0].token_ids)
        messages = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": words(50 + turn)}]


def test_auto_checkpoints_off_keeps_reuse_to_markers(model_dir):
    generator = torch.Generator().manual_seed(5)
    prefix = random_ids(generator, 60)
    llm = LLM(str(model_dir), num_kv_blocks=256, auto_checkpoints=False)
    plain_prompts = [{"prompt_token_ids": prefix + random_ids(generator, 4)} for _ in range(3)]
    outs = llm.generate(plain_prompts + plain_prompts[:1], GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0, 0]
    marked = [f"{words(*prefix)} {MARK} {words(i)}" for i in range(3)]
    outs = llm.generate(marked, GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs][1:] == [outs[1].num_cached_tokens] * 2
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens > 0
    assert all(llm.metrics()[f"checkpoints_created_{k.value}"] == 0 for k in CheckpointKind if k.automatic)


def test_automatic_checkpoints_never_evict_a_marked_one(model_dir):
    generator = torch.Generator().manual_seed(6)
    anchor = words(*random_ids(generator, 40))
    llm = LLM(str(model_dir), num_kv_blocks=256, checkpoint_pool_size=1)
    llm.generate(f"{anchor} {MARK} {words(1, 2)}", GREEDY, use_tqdm=False)
    marked = [c for c in llm.engine.registry if c.kind is CheckpointKind.MARKER]
    assert len(marked) == 1 and len(llm.engine.registry) == 1  # the only slot: automatic ones missed
    for seed in range(3):  # unrelated long prompts would place prompt-end and turn-end checkpoints
        llm.generate({"prompt_token_ids": random_ids(torch.Generator().manual_seed(10 + seed), 50)}, GREEDY,
                     use_tqdm=False)
    assert list(llm.engine.registry) == marked
    out = llm.generate(f"{anchor} {MARK} {words(3, 4)}", GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == marked[0].num_tokens
    llm.engine.check_integrity()


def test_marked_checkpoints_evict_automatic_ones_first(model_dir):
    generator = torch.Generator().manual_seed(7)
    llm = LLM(str(model_dir), num_kv_blocks=256, checkpoint_pool_size=2)
    llm.generate({"prompt_token_ids": random_ids(generator, 50)}, GREEDY, use_tqdm=False)
    assert {c.kind for c in llm.engine.registry} == {CheckpointKind.PROMPT_END, CheckpointKind.TURN_END}
    anchor = words(*random_ids(generator, 40))
    llm.generate(f"{anchor} {MARK} {words(1)}", GREEDY, use_tqdm=False)
    kinds = [c.kind for c in llm.engine.registry]
    assert CheckpointKind.MARKER in kinds and llm.metrics()["checkpoints_evicted_marker"] == 0


def test_host_tier_spills_and_restores_exactly(model_dir, plain):
    """A device pool of one checkpoint slot: every anchor's checkpoint is evicted by the next one,
    spills to the host tier and comes back on its next hit (outputs equal the plain run)."""
    generator = torch.Generator().manual_seed(8)
    anchors = [words(*random_ids(generator, 37)) for _ in range(3)]
    llm = LLM(str(model_dir), num_kv_blocks=256, checkpoint_pool_size=1, auto_checkpoints=False,
              checkpoint_host_bytes=64 << 20, checkpoint_restore_rule=False)  # (every hit restored, whatever
    # this shared machine's step times say: tests/engine/test_reuse_rule.py tests the rule)
    prompts = [f"{anchor} {MARK} {words(i)}" for anchor in anchors for i in (1, 2)]
    outs = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in outs] == [0, 37] * 3
    metrics = llm.metrics()
    assert metrics["checkpoints_spilled"] == 2 and metrics["host_tier_checkpoints"] == 2
    again = [llm.generate(f"{anchor} {MARK} {words(3)}", GREEDY, use_tqdm=False)[0] for anchor in anchors]
    assert [o.num_cached_tokens for o in again] == [37] * 3
    assert llm.metrics()["checkpoints_restored"] == 3
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs + again], GREEDY, use_tqdm=False)
    assert_same_outputs(outs + again, refs)
    llm.engine.check_integrity()
    tiny = LLM(str(model_dir), num_kv_blocks=256, checkpoint_pool_size=1, auto_checkpoints=False,
               checkpoint_host_bytes=1024)  # smaller than one checkpoint: a miss, never wrong data
    outs = [tiny.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts[:3] + prompts[:1]]
    assert [o.num_cached_tokens for o in outs] == [0, 37, 0, 0]
    assert tiny.metrics()["checkpoints_dropped_from_host"] >= 1


def test_reset_prefix_cache_forgets_every_checkpoint_and_prompt(model_dir, plain):
    """vLLM's `reset_prefix_cache`: after it, the same prompts compute from scratch exactly as the
    first time (markers, automatic shared prefixes, the host tier); refused while a request runs."""
    generator = torch.Generator().manual_seed(12)
    anchors = [words(*random_ids(generator, 37)) for _ in range(2)]
    prompts = [f"{anchors[0]} {MARK} {words(1)}", f"{anchors[0]} {MARK} {words(2)}",
               f"{anchors[1]} {words(3)}", f"{anchors[1]} {words(4)}", f"{anchors[1]} {words(5)}"]
    llm = LLM(str(model_dir), num_kv_blocks=256, checkpoint_pool_size=2, checkpoint_host_bytes=64 << 20,
              checkpoint_restore_rule=False)  # (every host hit restored, whatever the step times say)
    first = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in first] == [0, 37, 0, 37, 37]
    assert llm.metrics()["host_tier_checkpoints"] >= 1  # a pool of two: spills
    assert llm.metrics()["host_tier_checkpoints"] >= 1
    llm.engine.add_request("running", prompts[0], GREEDY)
    assert not llm.reset_prefix_cache()  # a request is unfinished: nothing changes
    llm.engine.abort_request("running")
    assert llm.reset_prefix_cache()
    assert len(llm.engine.registry) == 0 and llm.metrics()["host_tier_checkpoints"] == 0
    again = [llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.num_cached_tokens for o in again] == [o.num_cached_tokens for o in first]
    assert_same_outputs(again, first)
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in again], GREEDY, use_tqdm=False)
    assert_same_outputs(again, refs)
    llm.engine.check_integrity()


def test_cache_salts_share_nothing_and_reuse_within_a_salt(model_dir, plain):
    """vLLM's `cache_salt`: a prompt reuses only what prompts of its own salt computed (a shared prefix,
    the same prompt again, a turn end, a marker), so `num_cached_tokens` says nothing across tenants."""
    generator = torch.Generator().manual_seed(9)
    llm = LLM(str(model_dir), num_kv_blocks=256)
    marker = llm.checkpoint_token_id
    secret = random_ids(generator, 90)
    victim = {"prompt_token_ids": secret + [marker] + random_ids(generator, 6), "cache_salt": "tenant-a"}
    first = llm.generate(victim, GREEDY, use_tqdm=False)
    turn = secret + random_ids(generator, 6) + first[0].outputs[0].token_ids + random_ids(generator, 3)
    for salt in ("tenant-b", None):  # another tenant, and no salt at all, guess the victim's exact prompt
        guess = {"prompt_token_ids": secret + random_ids(generator, 4)} | ({"cache_salt": salt} if salt else {})
        outs, cost = computed(llm, lambda g=guess: llm.generate(g, GREEDY, use_tqdm=False))
        assert outs[0].num_cached_tokens == 0 and cost == 94, salt
        assert_same_outputs(outs, plain.generate({"prompt_token_ids": guess["prompt_token_ids"]}, GREEDY,
                                                 use_tqdm=False))
        outs = llm.generate({"prompt_token_ids": turn} | ({"cache_salt": salt} if salt else {}), GREEDY,
                            use_tqdm=False)
        assert outs[0].num_cached_tokens == 0, salt
    again = llm.generate({"prompt_token_ids": secret + random_ids(generator, 4), "cache_salt": "tenant-a"}, GREEDY,
                         use_tqdm=False)
    assert again[0].num_cached_tokens == 90  # the victim's own marker checkpoint
    for bad in ("", 7):
        with pytest.raises(ValueError, match="cache_salt must be a non-empty string"):
            llm.generate({"prompt_token_ids": secret, "cache_salt": bad}, GREEDY, use_tqdm=False)
    llm.engine.check_integrity()
