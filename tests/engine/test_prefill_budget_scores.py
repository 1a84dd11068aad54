"""A scored prompt beside decodes (engine/prefill_budget.py, SCORE_ROW_TOKENS): a step that decodes
computes at most B / SCORE_ROW_TOKENS prompt-logit rows (a row of vocabulary logits costs several
plain prefill tokens), a step with no decode the full `prompt_score_bytes` rows, and the scores do
not change."""

from __future__ import annotations

from forkpoint import SamplingParams
from forkpoint.cache.hashing import PrefixHasher
from forkpoint.engine.prefill_budget import SCORE_ROW_TOKENS, score_rows_with_decodes
from forkpoint.engine.request import Request
from tests.engine.test_prefill_budget import _config, _request, _Run
from tests.engine.test_prefill_budget_short import engine_with_streams
from tests.helpers import finish

B = 32  # _config's max_prefill_tokens_with_decodes


def _scored(request_id: str, prompt_len: int) -> Request:
    prompt = [(5 * i + 3) % 100 + 1 for i in range(prompt_len)]
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, prompt_logprobs=2)
    return Request(request_id, request_id, 0, prompt, (), params, 0.0, PrefixHasher(prompt, 4), None)


def test_the_rows_beside_decodes():
    assert score_rows_with_decodes(64, None) == 64 // SCORE_ROW_TOKENS
    assert score_rows_with_decodes(4, None) == 1
    assert score_rows_with_decodes(64, 64) == 64  # exact mode: one scan chunk


def test_a_scored_prompt_beside_decodes_takes_few_rows_a_step():
    run = _Run(_config())
    for i in range(4):
        run.add(_request(f"s{i}", 3, max_tokens=40))
    run.step()
    scored = _scored("scored", 100)
    run.add(scored)
    for _ in range(5):
        run.step()
        assert run.steps[-1]["decodes"] >= 4 and run.steps[-1]["tokens"]["scored"] == B // SCORE_ROW_TOKENS
    run.drain()
    run.check_outputs()


def test_outputs_and_scores_equal_steps_without_the_budget(model_dir):
    """CPU float32, tiny model: a 60-token scored prompt (prompt_logprobs=3) beside two streams in
    steps of B / SCORE_ROW_TOKENS scored rows (B = 16) gives the prompt logprobs, tokens and logprobs of steps with no
    budget."""
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    scored = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)

    def run(budget: int | None) -> list:
        engine = engine_with_streams(model_dir, budget, 256, params)
        engine.add_request("scored", {"prompt_token_ids": [(13 * j) % 150 + 5 for j in range(60)]}, scored,
                           stream=False)
        engine.step()
        computed = engine.sequences("scored")[0].num_computed_tokens
        return finish(engine), computed

    capped, computed = run(16)
    assert computed == 16 // SCORE_ROW_TOKENS
    whole, computed = run(None)
    assert computed == 60
    for ours, theirs in zip(capped, whole, strict=True):
        assert ours.outputs[0].token_ids == theirs.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs or [], theirs.outputs[0].logprobs or []):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)
        assert (ours.prompt_logprobs is None) == (theirs.prompt_logprobs is None)
        assert ours.request_id != "scored" or len(ours.prompt_logprobs) == 60
        for a, b in zip((ours.prompt_logprobs or [])[1:], (theirs.prompt_logprobs or [])[1:]):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) <= 1e-5 for t in a)
