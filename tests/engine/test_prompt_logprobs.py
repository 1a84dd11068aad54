"""Prompt logprobs: teacher-forced log-probabilities of every prompt token, equal to transformers'
(float32 CPU) and the same with or without checkpoints, chunked prefill and preemption."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams
from tests.tiny_models import words

MARK = "<|mamba_checkpoint|>"
PARAMS = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=3)


@pytest.fixture(scope="module")
def model(moe_model):
    return moe_model


def reference(hf, token_ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(input_ids=torch.tensor([token_ids])).logits[0].float(), dim=-1)


def assert_matches(entries, token_ids: list[int], ref: torch.Tensor, k: int, tol: float = 1e-4) -> None:
    assert entries[0] is None and len(entries) == len(token_ids)
    for position in range(1, len(token_ids)):
        entry, row, token = entries[position], ref[position - 1], token_ids[position]
        assert token in entry and abs(entry[token] - float(row[token])) <= tol
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        top = torch.topk(row, k).indices.tolist()
        assert set(top) <= set(entry) and len(entry) in (k, k + 1)


def test_prompt_logprobs_equal_transformers_teacher_forced(model):
    directory, hf = model
    prompt = words(*range(3, 40))
    llm = LLM(str(directory), max_num_batched_tokens=16)  # three chunks
    out = llm.generate(prompt, PARAMS, use_tqdm=False)[0]
    assert_matches(out.prompt_logprobs, out.prompt_token_ids, reference(hf, out.prompt_token_ids), 3)
    assert llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_logprobs is None


def test_prompt_logprobs_through_checkpoints_equal_the_plain_run(model):
    directory, hf = model
    anchor = words(*range(10, 40))
    prompts = [f"{anchor} {MARK} {words(50 + i, 60 + i)}" for i in range(3)]
    llm = LLM(str(directory))
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    plain = LLM(str(directory), enable_checkpoints=False).generate(
        [{"prompt_token_ids": o.prompt_token_ids} for o in outs], PARAMS, use_tqdm=False)
    for out, ref in zip(outs, plain):
        assert len(out.prompt_logprobs) == len(ref.prompt_logprobs)
        for ours, theirs in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
            assert ours.keys() == theirs.keys() and all(abs(ours[t] - theirs[t]) <= 1e-5 for t in ours)
    assert_matches(outs[2].prompt_logprobs, outs[2].prompt_token_ids, reference(hf, outs[2].prompt_token_ids), 3)
    # the producer leaves the prefix's scores with the checkpoint: consumers reuse the prefix
    anchor_len = outs[0].checkpoint_positions[0]
    assert [o.num_cached_tokens for o in outs] == [0, anchor_len, anchor_len]
    # a later consumer asking for fewer top logprobs reads them too; one asking for more computes all
    fewer = llm.generate(f"{anchor} {MARK} {words(70, 71)}", SamplingParams(max_tokens=1, prompt_logprobs=1),
                         use_tqdm=False)[0]
    more = llm.generate(f"{anchor} {MARK} {words(72, 73)}", SamplingParams(max_tokens=1, prompt_logprobs=5),
                        use_tqdm=False)[0]
    assert (fewer.num_cached_tokens, more.num_cached_tokens) == (anchor_len, 0)
    for out, k in ((fewer, 1), (more, 5)):
        assert_matches(out.prompt_logprobs, out.prompt_token_ids, reference(hf, out.prompt_token_ids), k)
    llm.engine.check_integrity()


def test_prompt_logprobs_with_exact_checkpoints_and_chunking(model):
    directory, hf = model
    anchor = words(*range(5, 75))  # 70 tokens: the state is kept at 64
    prompts = [f"{anchor} {MARK} {words(80 + i, 90 + i)}" for i in range(3)]
    llm = LLM(str(directory), checkpoint_exact=True, max_num_batched_tokens=64)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64]
    for out in outs:
        assert_matches(out.prompt_logprobs, out.prompt_token_ids, reference(hf, out.prompt_token_ids), 3)
    llm.engine.check_integrity()


def test_zero_prompt_logprobs_return_the_actual_token_only(model):
    directory, _ = model
    out = LLM(str(directory)).generate(words(1, 2, 3, 4), SamplingParams(max_tokens=1, prompt_logprobs=0),
                                       use_tqdm=False)[0]
    assert [list(e) for e in out.prompt_logprobs[1:]] == [[t] for t in out.prompt_token_ids[1:]]
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_scored_prompts_run_in_bounded_chunks_with_the_one_chunk_numbers(model):
    """Prompt scoring keeps O(chunk x vocab) logits per step (EngineConfig.prompt_score_bytes), all
    scored requests of a step together, and the chunked scores equal the whole-prompt ones."""
    directory, _ = model
    prompts = [{"prompt_token_ids": [(7 * i + j) % 150 + 2 for i in range(150)]} for j in range(2)]
    llm = LLM(str(directory), prompt_score_bytes=1, enable_checkpoints=False)  # the least: one scan chunk
    cap = llm.engine.scheduler.score_rows
    assert cap == 64
    execute, rows = llm.engine.runner.execute, []

    def spy(plan, *args):
        rows.append(sum(s.prompt_logit_rows for s in plan.segments))
        return execute(plan, *args)

    llm.engine.runner.execute = spy
    chunked = llm.generate(prompts + ["no scores here"], [PARAMS, PARAMS, SamplingParams(max_tokens=4)],
                           use_tqdm=False)
    assert max(rows) == cap and sum(rows) == 2 * 149
    whole = LLM(str(directory), enable_checkpoints=False).generate(prompts, PARAMS, use_tqdm=False)
    for ours, theirs in zip(chunked, whole):
        for a, b in zip(ours.prompt_logprobs[1:], theirs.prompt_logprobs[1:]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)


def test_prompt_score_rows_per_device_and_budget():
    from forkpoint.config import EngineConfig

    vocab = 248320  # Qwen3.5's
    assert EngineConfig(device="cpu").prompt_score_rows(vocab) == 64
    assert EngineConfig(device="cuda").prompt_score_rows(vocab) == 1024
    assert EngineConfig(device="cpu", prompt_score_bytes=300 << 20).prompt_score_rows(vocab) == 256  # 316 rows
    assert EngineConfig(device="cpu", prompt_score_bytes=1).prompt_score_rows(vocab) == 64  # one scan chunk
    with pytest.raises(ValueError, match="prompt_score_bytes"):
        EngineConfig(prompt_score_bytes=0)
