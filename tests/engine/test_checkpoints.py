"""Application-directed checkpoints: zero accuracy loss, exact reuse, and the producer/consumer
state machine (float32, CPU, tiny transformers-built model)."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.step.plan import SegmentKind
from tests.helpers import assert_same_outputs
from tests.tiny_models import words

MARK = "<|mamba_checkpoint|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=3)


def make_llm(directory, **kwargs) -> LLM:
    defaults = dict(num_kv_blocks=128, max_num_seqs=16, max_num_batched_tokens=512, auto_checkpoints=False)
    defaults.update(kwargs)
    return LLM(str(directory), **defaults)


def anchor_and_suffixes(anchor_len: int, suffix_lens: list[int], seed: int = 0) -> tuple[str, list[str]]:
    generator = torch.Generator().manual_seed(seed)
    anchor = words(*torch.randint(0, 150, (anchor_len,), generator=generator).tolist())
    suffixes = [words(*torch.randint(0, 150, (n,), generator=generator).tolist()) for n in suffix_lens]
    return anchor, suffixes


def finish_clean(llm: LLM) -> None:
    llm.engine.check_integrity()
    metrics = llm.metrics()
    registry = llm.engine.registry
    held = set() if registry is None else {b for c in registry for b in c.blocks}
    assert metrics["kv_blocks_used"] == len(held)  # only checkpoints hold blocks once idle
    assert metrics["state_slots_used"] == 0


def test_one_to_n_equals_no_checkpoint_run(model_dir, moe_model):
    anchor, suffixes = anchor_and_suffixes(37, [5, 9, 3, 12, 7, 1])  # 37: not a multiple of block_size 16
    prompts = [f"{anchor} {MARK} {s}" for s in suffixes]
    llm = make_llm(model_dir)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    plain = make_llm(model_dir, enable_checkpoints=False)
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs], GREEDY, use_tqdm=False)
    assert_same_outputs(outs, refs)
    assert all(llm.checkpoint_token_id not in o.prompt_token_ids for o in outs)
    # exact reuse: every consumer skipped exactly the anchor
    anchor_len = len(llm.get_tokenizer().encode(anchor, add_special_tokens=False))
    assert anchor_len == 37
    assert outs[0].checkpoint_positions == [37]
    assert sorted(o.num_cached_tokens for o in outs) == [0] + [37] * (len(prompts) - 1)
    metrics = llm.metrics()
    suffix_total = sum(len(o.prompt_token_ids) - 37 for o in outs)
    assert metrics["prompt_tokens_computed"] == 37 + suffix_total
    assert metrics["checkpoints_created"] == 1 and metrics["checkpoint_hits"] == len(prompts) - 1
    finish_clean(llm)
    # transformers agrees on the first consumer
    hf = moe_model[1]
    ids = list(outs[1].prompt_token_ids)
    for _ in range(4):
        with torch.no_grad():
            ids.append(int(hf(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    assert outs[1].outputs[0].token_ids == ids[len(outs[1].prompt_token_ids):]


def test_checkpoint_lengths_not_multiple_of_block_and_later_requests_reuse(model_dir):
    llm = make_llm(model_dir, block_size=8)
    plain = make_llm(model_dir, enable_checkpoints=False, block_size=8)  # reuses nothing: one serves every anchor
    for anchor_len in (1, 7, 8, 9, 23):
        anchor, suffixes = anchor_and_suffixes(anchor_len, [4, 6], seed=anchor_len)
        first = llm.generate(f"{anchor} {MARK} {suffixes[0]}", GREEDY, use_tqdm=False)[0]
        assert first.num_cached_tokens == 0
        # a later request without any marker reuses the ready checkpoint: marker or not
        second = llm.generate(f"{anchor} {suffixes[1]}", GREEDY, use_tqdm=False)[0]
        assert second.num_cached_tokens == anchor_len
        assert_same_outputs([second], plain.generate({"prompt_token_ids": second.prompt_token_ids}, GREEDY,
                                                     use_tqdm=False))
    finish_clean(llm)


def test_nested_markers_token_ids_positions_and_chat(model_dir):
    llm = make_llm(model_dir)
    tokenizer = llm.get_tokenizer()
    system, document = anchor_and_suffixes(11, [20], seed=3)
    document = document[0]
    _, questions = anchor_and_suffixes(1, [3, 4, 5], seed=4)
    prompts = [f"{system} {MARK} {document} {MARK} {q}" for q in questions]
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert outs[0].checkpoint_positions == [11, 31]
    assert [o.num_cached_tokens for o in outs] == [0, 31, 31]
    # token-id prompt carrying the marker id, and explicit checkpoint_positions: same reuse
    ids = tokenizer.encode(f"{system} {document}", add_special_tokens=False)
    marked = ids[:11] + [llm.checkpoint_token_id] + ids[11:] + tokenizer.encode(" w1 w2", add_special_tokens=False)
    out = llm.generate({"prompt_token_ids": marked}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 31 and llm.checkpoint_token_id not in out.prompt_token_ids
    other_system, _ = anchor_and_suffixes(13, [1], seed=9)
    by_position = llm.generate([{"prompt": f"{other_system} {q}", "checkpoint_positions": [13]} for q in questions],
                               GREEDY, use_tqdm=False)
    assert [o.num_cached_tokens for o in by_position] == [0, 13, 13]
    # markers inside chat messages survive the template
    chats = [[{"role": "user", "content": f"{document} {MARK} {q}"}] for q in questions]
    chat_outs = llm.chat(chats, GREEDY, use_tqdm=False)
    cached = [o.num_cached_tokens for o in chat_outs]
    assert cached[0] == 0 and cached[1] == cached[2] > 20
    plain = make_llm(model_dir, enable_checkpoints=False)
    assert_same_outputs(chat_outs, plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in chat_outs],
                                                  GREEDY, use_tqdm=False))
    finish_clean(llm)


@pytest.mark.parametrize("bad,match", [
    (f"{MARK} w1 w2", "position 0"),
    (f"w1 {MARK} {MARK} w2", "position 1"),
    (f"w1 {MARK} w2 {MARK} w3 {MARK} w4 {MARK} w5 {MARK} w6", "checkpoints"),
    ({"prompt": "w1 w2 w3", "checkpoint_positions": [9]}, "entry 9 is beyond"),
])
def test_bad_markers_raise_and_engine_still_serves(model_dir, bad, match):
    llm = make_llm(model_dir)
    with pytest.raises(ValueError, match=match):
        llm.generate(["w1 w2 w3", bad], GREEDY, use_tqdm=False)
    finish_clean(llm)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate(f"w1 w2 {MARK} w3", GREEDY, use_tqdm=False)[0]
    assert out.checkpoint_positions == [2]


def test_marker_at_end_and_disabled_checkpoints(model_dir):
    llm = make_llm(model_dir)
    anchor, suffixes = anchor_and_suffixes(9, [3], seed=5)
    out = llm.generate(f"{anchor} {MARK}", GREEDY, use_tqdm=False)[0]
    assert out.checkpoint_positions == [9]
    follow = llm.generate(f"{anchor} {suffixes[0]}", GREEDY, use_tqdm=False)[0]
    assert follow.num_cached_tokens == 9
    off = make_llm(model_dir, enable_checkpoints=False)
    assert off.checkpoint_token_id is None
    out = off.generate(f"{anchor} {suffixes[0]}", GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and off.metrics()["checkpoints_created"] == 0
    finish_clean(llm)


def run_until_idle(llm: LLM, limit: int = 500) -> dict:
    finished = {}
    for _ in range(limit):
        for output in llm.engine.step():
            if output.finished:
                finished[output.request_id] = output
        if not llm.engine.has_unfinished_requests():
            return finished
    raise AssertionError("engine did not drain")


def test_deferral_does_not_block_unrelated_and_consumers_wake_together(model_dir):
    # at most 16 prefill tokens per request and step: the 40-token anchor takes three steps to produce
    llm = make_llm(model_dir, long_prefill_token_threshold=16)
    engine = llm.engine
    anchor, suffixes = anchor_and_suffixes(40, [3, 3, 3], seed=6)
    _, unrelated = anchor_and_suffixes(1, [4], seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("producer", f"{anchor} {MARK} {suffixes[0]}", params)
    engine.add_request("c1", f"{anchor} {MARK} {suffixes[1]}", params)
    engine.add_request("c2", f"{anchor} {MARK} {suffixes[2]}", params)
    engine.add_request("unrelated", unrelated[0], params)
    first_tokens: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests():
        step += 1
        for output in engine.step():
            if output.outputs[0].token_ids and output.request_id not in first_tokens:
                first_tokens[output.request_id] = step
        assert step < 100
    assert first_tokens["unrelated"] < first_tokens["producer"], "unrelated request was blocked behind deferral"
    assert first_tokens["c1"] == first_tokens["c2"], "consumers did not wake together"
    metrics = llm.metrics()
    assert metrics["requests_deferred"] == 2 and metrics["checkpoint_hits"] == 2
    assert metrics["deferral_wait_s_total"] > 0
    assert metrics["prompt_tokens_computed"] == 40 + 3 * 3 + 4
    finish_clean(llm)


def test_same_step_pairing(model_dir):
    llm = make_llm(model_dir, max_num_batched_tokens=512)
    engine = llm.engine
    anchor, suffixes = anchor_and_suffixes(21, [5, 6, 7], seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=2)
    for i, s in enumerate(suffixes):
        engine.add_request(f"r{i}", f"{anchor} {MARK} {s}", params)
    outputs = engine.step()  # one forward: producer prefix (phase 0), its tail and both consumers (phase 1)
    assert len(outputs) == 3 and all(o.finished for o in outputs)
    assert sorted(o.num_cached_tokens for o in outputs) == [0, 21, 21]
    assert llm.metrics()["requests_deferred"] == 0
    plain = make_llm(model_dir, enable_checkpoints=False)
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outputs], params, use_tqdm=False)
    assert_same_outputs(outputs, refs)
    finish_clean(llm)


def test_producer_abort_promotes_a_consumer(model_dir):
    llm = make_llm(model_dir, long_prefill_token_threshold=16)
    engine = llm.engine
    anchor, suffixes = anchor_and_suffixes(40, [3, 4], seed=10)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.add_request("producer", f"{anchor} {MARK} {suffixes[0]}", params)
    engine.add_request("consumer", f"{anchor} {suffixes[1]}", params)  # no marker: waits on the registry entry
    engine.step()
    assert llm.metrics()["checkpoints_pending"] == 1 and llm.metrics()["requests_deferred"] == 1
    engine.abort_request("producer")
    engine.check_integrity()
    finished = run_until_idle(llm)
    metrics = llm.metrics()
    assert metrics["producer_promotions"] == 1 and metrics["checkpoints_created"] == 1
    plain = make_llm(model_dir, enable_checkpoints=False)
    ref = plain.generate({"prompt_token_ids": finished["consumer"].prompt_token_ids}, params, use_tqdm=False)[0]
    assert finished["consumer"].outputs[0].token_ids == ref.outputs[0].token_ids
    finish_clean(llm)


def test_wait_bound_makes_consumer_compute_the_prefix(model_dir):
    llm = make_llm(model_dir, long_prefill_token_threshold=16, checkpoint_wait_s=1e-9)
    anchor, suffixes = anchor_and_suffixes(40, [3, 4], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate([f"{anchor} {MARK} {s}" for s in suffixes], params, use_tqdm=False)
    assert llm.metrics()["checkpoint_wait_timeouts"] == 1
    assert outs[1].num_cached_tokens == 0
    finish_clean(llm)


def test_preemption_of_producer_keeps_outputs_exact(model_dir):
    # 9 blocks of 4 tokens: the producer gets preempted while the others grow
    llm = make_llm(model_dir, num_kv_blocks=9, block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    anchor, suffixes = anchor_and_suffixes(10, [2, 3, 2], seed=12)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [f"{anchor} {MARK} {s}" for s in suffixes]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.metrics()["preemptions"] > 0
    plain = make_llm(model_dir, enable_checkpoints=False)
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs], params, use_tqdm=False)
    for out, ref in zip(outs, refs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    finish_clean(llm)


def test_eviction_under_tiny_checkpoint_pool_gives_misses_not_wrong_data(model_dir):
    llm = make_llm(model_dir, checkpoint_pool_size=1)
    anchors = [anchor_and_suffixes(12 + i, [3], seed=20 + i) for i in range(3)]
    outs = []
    for anchor, suffixes in anchors:
        outs += llm.generate(f"{anchor} {MARK} {suffixes[0]}", GREEDY, use_tqdm=False)
    again = llm.generate(f"{anchors[0][0]} {anchors[0][1][0]} w3", GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0  # evicted: a miss
    assert llm.metrics()["checkpoints_evicted"] == 2
    plain = make_llm(model_dir, enable_checkpoints=False)
    refs = plain.generate([{"prompt_token_ids": o.prompt_token_ids} for o in outs + [again]], GREEDY, use_tqdm=False)
    assert_same_outputs(outs + [again], refs)
    finish_clean(llm)


def test_n_greater_than_one_shares_the_prompt(model_dir):
    llm = make_llm(model_dir)
    anchor, _ = anchor_and_suffixes(30, [1], seed=13)
    out = llm.generate(anchor, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs) == 3 and [c.index for c in out.outputs] == [0, 1, 2]
    assert llm.metrics()["prompt_tokens_computed"] == 30 + 2  # siblings recompute only the last token
    again = llm.generate(anchor, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=5, ignore_eos=True),
                         use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]  # seeded: reproducible
    finish_clean(llm)


def test_exact_checkpoints_keep_states_on_scan_chunk_boundaries(model_dir):
    """checkpoint_exact: the state lives at the 64-token boundary at or before the marker, consumers
    compute from there, chunked prefill ends chunks on boundaries; outputs equal the plain run."""
    anchor, suffixes = anchor_and_suffixes(150, [5, 9, 70], seed=3)
    prompts = [f"{anchor} {MARK} {s}" for s in suffixes]
    llm = make_llm(model_dir, checkpoint_exact=True, max_num_batched_tokens=100, auto_checkpoints=True)
    plans = []
    schedule = llm.engine.scheduler.schedule

    def recording(*args, **kwargs):
        step = schedule(*args, **kwargs)
        plans.append(step.plan)
        return step

    llm.engine.scheduler.schedule = recording
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    refs = make_llm(model_dir, enable_checkpoints=False).generate(
        [{"prompt_token_ids": o.prompt_token_ids} for o in outs], GREEDY, use_tqdm=False)
    assert_same_outputs(outs, refs)
    assert [o.num_cached_tokens for o in outs] == [0, 128, 128]  # 150 -> the boundary at 128
    prefills = [s for plan in plans for s in plan.segments if s.kind is SegmentKind.PREFILL]
    assert len(prefills) > len(prompts)  # chunked and split at the checkpoint
    for segment in prefills:  # every scan starts on a chunk boundary and ends on one or at the prompt's end
        assert segment.start % 64 == 0 and (segment.end % 64 == 0 or segment.samples), segment
    registry = llm.engine.registry
    assert all(c.state_tokens % 64 == 0 for c in registry)
    finish_clean(llm)
