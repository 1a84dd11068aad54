"""Speculative decoding with the MTP head (`speculative_config`) against the engine without it.

Float32 CPU, tiny Qwen3.5 dense, Qwen3.5-MoE and Qwen3-Next models with random MTP weights
(tests/tiny_models.add_mtp_weights). Greedy outputs (tokens, and logprobs within 1e-5) equal the
plain engine's with checkpoints from markers, automatic ones and turn ends, on fresh and warm
engines; the engine's integrity holds after every step. Random MTP weights are rarely right, so most
tests also replace the head's drafts by an oracle (the plain run's own continuation, 30% of
its positions corrupted), so that verification accepts, rejects and rolls the recurrent state back at
every draft position. A fault in a verify step (target forward, MTP head) ends its requests and leaves
nothing behind.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.engine.engine import StepFailed
from forkpoint.engine.holdings import check_holdings
from forkpoint.runner.piecewise import PiecewiseForward
from forkpoint.runner.speculative import FinishedStep, MTPDrafter
from tests.helpers import assert_same_outputs
from tests.tiny_models import add_mtp_weights, token_words

MARK = "<|mamba_checkpoint|>"
K = 3
SPEC = {"method": "mtp", "num_speculative_tokens": K}
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
MODEL_TYPES = ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"]

# chi-square quantiles at 1 - 1e-4 by degrees of freedom (scipy.stats.chi2.ppf(1 - 1e-4, df))
CHI2_CRITICAL_1E4 = {2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83, 9: 33.72, 10: 35.56,
                     11: 37.37, 12: 39.13, 13: 40.87, 14: 42.58, 15: 44.26, 16: 45.92, 17: 47.57, 18: 49.19,
                     19: 50.80, 20: 52.39}


@pytest.fixture(scope="module", params=MODEL_TYPES)
def mtp_model(request, tiny_model_factory, tmp_path_factory):
    source, _ = tiny_model_factory(request.param)
    directory = tmp_path_factory.mktemp(f"{request.param}_mtp")
    add_mtp_weights(source, directory)
    return directory


class OracleDrafts:
    """Replaces the MTP head's drafts with `continuations` (prompt ids -> the plain run's output ids),
    corrupting output index i when random.Random(i).random() < 0.3 (none unless `corrupt`), so verification
    sees accepted prefixes of every length. The head itself still runs (its KV)."""

    def __init__(self, llm: LLM, continuations: dict[tuple[int, ...], list[int]], corrupt: bool = True) -> None:
        self.engine = llm.engine
        self.continuations = continuations
        self.corrupt = corrupt
        drafter = llm.engine.runner.drafter
        self._execute = drafter.execute
        drafter.execute = self

    def __call__(self, runner, plan) -> FinishedStep:
        check_holdings(self.engine.scheduler)  # mid-step: the verifications' spare rows are accounted for
        result = self._execute(runner, plan).result()
        emitted = dict(zip(result.request_ids, ([t.token_id] for t in result.tokens)))
        emitted.update({v.request_id: [t.token_id for t in v.tokens] for v in result.verified})
        requests = {r.request_id: r for r in self.engine.scheduler.running}
        drafts = {}
        for request_id in result.drafts:
            request = requests[request_id]
            reference = self.continuations[tuple(request.prompt_token_ids)]
            done = len(request.output_token_ids) + len(emitted.get(request_id, ()))
            drafts[request_id] = tuple(
                (token + 1) % 150 if self.corrupt and random.Random(done + i).random() < 0.3 else token
                for i, token in enumerate(reference[done: done + K]))
        return FinishedStep(dataclasses.replace(result, drafts=drafts))


def continuations(outputs) -> dict[tuple[int, ...], list[int]]:
    return {tuple(out.prompt_token_ids): list(out.outputs[0].token_ids) for out in outputs}


def generate_checked(llm: LLM, prompts, params) -> list:
    """`llm.generate` step by step, checking the engine's integrity after every step. params: one
    SamplingParams for all prompts, or a list of one per prompt."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"p{i}", prompt, params[i] if isinstance(params, list) else params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out
        engine.check_integrity()
    return [outputs[f"p{i}"] for i in range(len(prompts))]


ANCHOR = token_words(1, 40)
WORKLOAD = [
    f"{ANCHOR} {MARK} {token_words(2, 5)}",
    f"{ANCHOR} {MARK} {token_words(3, 9)}",
    token_words(4, 7),
    f"{ANCHOR} {token_words(5, 3)}",  # reuses the marked prefix without a marker
]


def test_greedy_outputs_equal_the_plain_engine_with_checkpoints(mtp_model):
    plain = LLM(str(mtp_model))
    reference = plain.generate(WORKLOAD, GREEDY, use_tqdm=False)
    # the second turn extends the first turn's prompt and output: it reads its turn-end checkpoint
    first_turn = reference[1].prompt_token_ids + list(reference[1].outputs[0].token_ids)
    second_turn = [{"prompt_token_ids": first_turn + [20, 21, 22]}]
    reference_turn = plain.generate(second_turn, GREEDY, use_tqdm=False)
    assert plain.metrics()["checkpoint_hits"] > 0

    llm = LLM(str(mtp_model), speculative_config=SPEC)
    OracleDrafts(llm, {**continuations(reference), **continuations(reference_turn)})
    first = generate_checked(llm, WORKLOAD, GREEDY)
    assert_same_outputs(first, reference)
    assert [o.num_cached_tokens for o in first] == [o.num_cached_tokens for o in reference]
    turn = generate_checked(llm, second_turn, GREEDY)
    assert_same_outputs(turn, reference_turn)
    assert turn[0].num_cached_tokens == reference_turn[0].num_cached_tokens == len(first_turn) - 1
    again = generate_checked(llm, WORKLOAD, GREEDY)  # warm: every prompt resumes at a checkpoint
    assert_same_outputs(again, reference)
    metrics = llm.metrics()
    assert metrics["checkpoint_hits"] > 0
    # the oracle's drafts: accepted and rejected at every position
    assert metrics["spec_verifications"] > 0
    for i in range(1, K + 1):
        assert 0.0 < metrics[f"spec_acceptance_rate_pos_{i}"] < 1.0, {k: v for k, v in metrics.items() if "spec" in k}
    assert 1.0 < metrics["spec_mean_acceptance_length"] < K + 1
    assert metrics["num_running"] == 0 and metrics["num_waiting"] == 0


def test_greedy_outputs_equal_without_checkpoints_and_with_the_heads_own_drafts(tiny_model_factory,
                                                                             tmp_path_factory):
    source, _ = tiny_model_factory("qwen3_next")
    mtp_model = tmp_path_factory.mktemp("own_drafts_mtp")
    add_mtp_weights(source, mtp_model)
    prompts = [token_words(10 + i, 4 + 5 * i) for i in range(2)]
    params = dataclasses.replace(GREEDY, n=2, max_tokens=6)
    reference = LLM(str(mtp_model), enable_checkpoints=False).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(mtp_model), enable_checkpoints=False, speculative_config=SPEC)
    outputs = generate_checked(llm, prompts, params)
    for ours, theirs in zip(outputs, reference):
        assert [c.token_ids for c in ours.outputs] == [c.token_ids for c in theirs.outputs]
    assert llm.metrics()["spec_verifications"] > 0  # the random head's drafts were verified (and rejected)


def test_verify_steps_through_the_piecewise_pieces_give_the_same_outputs(tiny_model_factory, tmp_path_factory):
    """With CUDA graphs the verify step's forward runs through the piecewise pieces (padded to a
    bucket); on the CPU the same pieces run eagerly (capture=False): same tokens, logprobs within 1e-5."""
    source, _ = tiny_model_factory("qwen3_5_moe_text")
    mtp_model = tmp_path_factory.mktemp("piecewise_mtp")
    add_mtp_weights(source, mtp_model)
    reference = LLM(str(mtp_model)).generate(WORKLOAD, GREEDY, use_tqdm=False)
    llm = LLM(str(mtp_model), speculative_config=SPEC)
    runner = llm.engine.runner
    piecewise = PiecewiseForward(runner.model, (1, 8, 32, 128), runner.device, capture=False)
    calls = []
    forward_hidden = piecewise.forward_hidden
    piecewise.forward_hidden = lambda batch, caches: calls.append(batch.num_tokens) or forward_hidden(batch, caches)
    runner.piecewise = piecewise
    OracleDrafts(llm, continuations(reference))
    assert_same_outputs(generate_checked(llm, WORKLOAD, GREEDY), reference)
    assert llm.metrics()["spec_verifications"] > 0
    assert calls and any(piecewise.bucket(n) > n for n in calls)  # padded steps among them


def test_all_drafts_right_emit_k_plus_one_tokens_a_step(tiny_model_factory, tmp_path_factory):
    source, _ = tiny_model_factory("qwen3_5_text")
    directory = tmp_path_factory.mktemp("exact_oracle")
    add_mtp_weights(source, directory)
    prompt = token_words(20, 12)
    params = dataclasses.replace(GREEDY, max_tokens=1 + 4 * (K + 1))
    reference = LLM(str(directory)).generate([prompt], params, use_tqdm=False)
    llm = LLM(str(directory), speculative_config=SPEC)
    OracleDrafts(llm, continuations(reference), corrupt=False)
    outputs = generate_checked(llm, [prompt], params)
    assert_same_outputs(outputs, reference)
    metrics = llm.metrics()
    assert metrics["spec_verifications"] == 4  # the prefill's token, then four steps of k + 1 tokens
    assert metrics["spec_mean_acceptance_length"] == K + 1
    assert all(metrics[f"spec_acceptance_rate_pos_{i}"] == 1.0 for i in range(1, K + 1))
    llm.engine.async_scheduling = True  # switched on a built engine: speculative steps stay synchronous
    assert_same_outputs(generate_checked(llm, [prompt], params), reference)
    assert llm.metrics()["spec_verifications"] == 8


def test_every_running_sequence_verifies_at_max_num_seqs(tiny_model_factory, tmp_path_factory):
    """The pools hold k spare rows per sequence (cache/sizing.py): at max_num_seqs running, each
    still verifies every step instead of decoding plainly for want of rows."""
    source, _ = tiny_model_factory("qwen3_5_text")
    directory = tmp_path_factory.mktemp("full_batch")
    add_mtp_weights(source, directory)
    prompts = [token_words(21, 12), token_words(22, 9)]
    params = dataclasses.replace(GREEDY, max_tokens=1 + 3 * (K + 1))
    reference = LLM(str(directory), max_num_seqs=2).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(directory), speculative_config=SPEC, max_num_seqs=2)
    assert llm.engine.scheduler.states.requests.count == 2 * (1 + K)
    OracleDrafts(llm, continuations(reference), corrupt=False)
    assert_same_outputs(generate_checked(llm, prompts, params), reference)
    metrics = llm.metrics()
    assert metrics["spec_verifications"] == 2 * 3  # per sequence: after the prefill's token, 3 steps of k + 1
    assert metrics["spec_mean_acceptance_length"] == K + 1


def test_stop_inside_the_accepted_tokens_keeps_exactly_the_kept_tokens(tiny_model_factory, tmp_path_factory):
    """A stop token among the accepted drafts ends the request there; its turn-end checkpoint then holds
    the state of the tokens it kept (a later turn that reads it matches the plain engine)."""
    source, _ = tiny_model_factory("qwen3_5_text")
    directory = tmp_path_factory.mktemp("stop_oracle")
    add_mtp_weights(source, directory)
    long = dataclasses.replace(GREEDY, max_tokens=12)
    plain = LLM(str(directory))
    # a continuation whose token at output index j first occurs there, j inside a verification's emitted
    # tokens but not its last (the prefill emits index 0, then each verification k + 1 = 4 tokens)
    for seed in range(21, 60):
        prompt = token_words(seed, 36)
        continuation = plain.generate([prompt], long, use_tqdm=False)[0].outputs[0].token_ids
        j = next((j for j in range(2, 8) if j % (K + 1) in (2, 3) and continuation[j] not in continuation[:j]), None)
        if j is not None:
            break
    assert j is not None
    stop = dataclasses.replace(long, stop_token_ids=[continuation[j]], ignore_eos=True)
    reference = plain.generate([prompt], stop, use_tqdm=False)
    kept = reference[0].prompt_token_ids + list(reference[0].outputs[0].token_ids)
    follow = [{"prompt_token_ids": kept + [30, 31, 32]}]
    reference_follow = plain.generate(follow, long, use_tqdm=False)
    llm = LLM(str(directory), speculative_config=SPEC)
    OracleDrafts(llm, {tuple(reference[0].prompt_token_ids): list(continuation),
                       **continuations(reference_follow)}, corrupt=False)
    outputs = generate_checked(llm, [prompt], stop)
    assert_same_outputs(outputs, reference)
    assert list(outputs[0].outputs[0].token_ids) == list(continuation[: j + 1])
    outputs = generate_checked(llm, follow, long)
    assert_same_outputs(outputs, reference_follow)
    assert outputs[0].num_cached_tokens == reference_follow[0].num_cached_tokens == len(kept) - 1  # its turn end


def test_async_scheduling_with_speculation_is_a_clear_error():
    with pytest.raises(ValueError, match="speculative_config does not run with async_scheduling"):
        LLM(load_format="dummy", async_scheduling=True, speculative_config=SPEC)


def test_a_model_without_mtp_layers_is_a_clear_error(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen3_5_text")
    with pytest.raises(ValueError, match="needs a model with MTP layers"):
        LLM(str(directory), speculative_config=SPEC)


@pytest.mark.parametrize(("where", "after_calls"), [("target", 0), ("target", 2), ("mtp", 1)])
def test_a_fault_in_a_verify_step_leaves_nothing_behind(tiny_model_factory, tmp_path_factory, where, after_calls):
    source, _ = tiny_model_factory("qwen3_5_moe_text")
    mtp_model = tmp_path_factory.mktemp("fault_mtp")
    add_mtp_weights(source, mtp_model)
    prompts = [f"{ANCHOR} {MARK} {token_words(30 + i, 3)}" for i in range(3)]
    reference = LLM(str(mtp_model)).generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM(str(mtp_model), speculative_config=SPEC)
    OracleDrafts(llm, continuations(reference))
    model = llm.engine.runner.model
    module = model.mtp if where == "mtp" else model.model.layers[2].mlp
    calls = {"verify": 0}
    scheduler = llm.engine.scheduler

    def hook(_module, _inputs):
        if scheduler.in_flight and scheduler.in_flight[0].plan.verifies:
            calls["verify"] += 1
            if calls["verify"] == after_calls + 1:
                raise RuntimeError("injected fault in a verify step")

    handle = module.register_forward_pre_hook(hook)
    with pytest.raises(StepFailed, match="injected fault in a verify step"):
        generate_checked(llm, prompts, GREEDY)
    handle.remove()
    llm.engine.check_integrity()
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.state_pool.requests.num_used == 0
    assert not scheduler.speculation.held_slots()
    assert_same_outputs(generate_checked(llm, prompts, GREEDY), reference)
    llm.engine.check_integrity()


def test_the_drafter_needs_an_mtp_head(tiny_model_factory):
    directory, _ = tiny_model_factory("qwen3_5_text")
    llm = LLM(str(directory))
    with pytest.raises(ValueError, match="needs the model built with its MTP head"):
        MTPDrafter(llm.engine.runner.model, K)


def two_sample_chi_square(a: list[int], b: list[int]) -> tuple[float, int]:
    """Pearson's chi-square of the 2 x C table of two samples' categories (those expected < 5 times
    pooled into one) -> (statistic, degrees of freedom)."""
    from collections import Counter

    counts_a, counts_b = Counter(a), Counter(b)
    total_a, total_b = len(a), len(b)
    kept, pooled = [], [0, 0]
    for category in set(a) | set(b):
        both = counts_a[category] + counts_b[category]
        if both * min(total_a, total_b) / (total_a + total_b) < 5:
            pooled[0] += counts_a[category]
            pooled[1] += counts_b[category]
        else:
            kept.append((counts_a[category], counts_b[category]))
    if sum(pooled):
        kept.append(tuple(pooled))
    statistic = 0.0
    for x, y in kept:
        for observed, total in ((x, total_a), (y, total_b)):
            expected = (x + y) * total / (total_a + total_b)
            statistic += (observed - expected) ** 2 / expected
    return statistic, len(kept) - 1


def test_sampled_outputs_follow_the_plain_engines_distribution(tiny_model_factory, tmp_path_factory):
    """Seeded sampling (temperature 0.8) of 160 sequences of one prompt: the tokens the verifications
    emit (output indices 1 and 2) are distributed as the plain engine's (chi-square, 1e-4 level), with
    drafts the greedy continuation (so many are accepted and many rejected)."""
    source, _ = tiny_model_factory("qwen3_5_text")
    directory = tmp_path_factory.mktemp("sampled_mtp")
    add_mtp_weights(source, directory)
    prompt, count = token_words(40, 9), 160
    greedy = LLM(str(directory)).generate([prompt], dataclasses.replace(GREEDY, max_tokens=4), use_tqdm=False)
    params = [SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True, seed=i) for i in range(count)]
    plain = LLM(str(directory), enable_checkpoints=False).generate([prompt] * count, params, use_tqdm=False)
    # state rows for every sequence and a spare row per draft (engine/speculative.py)
    llm = LLM(str(directory), enable_checkpoints=False, num_state_slots=count * (1 + K), speculative_config=SPEC)
    OracleDrafts(llm, continuations(greedy), corrupt=False)
    ours = llm.generate([prompt] * count, params, use_tqdm=False)
    assert [o.outputs[0].token_ids[0] for o in ours] == [o.outputs[0].token_ids[0] for o in plain]  # the prefill's
    metrics = llm.metrics()
    assert metrics["spec_verifications"] >= count
    assert 0.1 < metrics["spec_acceptance_rate_pos_1"] < 0.9, metrics
    for index in (1, 2):
        statistic, df = two_sample_chi_square([o.outputs[0].token_ids[index] for o in ours],
                                              [o.outputs[0].token_ids[index] for o in plain])
        assert df >= 2
        assert statistic < CHI2_CRITICAL_1E4[df], (index, statistic, df)


class FirstDrafts:
    """Records each request's first drafts (those after its prompt's last token) and the head's keys
    over its prompt positions then (the MTP layer's KV: the pools' last attention layer)."""

    def __init__(self, llm: LLM) -> None:
        self.engine = llm.engine
        self.first: dict[str, tuple[int, ...]] = {}
        self.keys: dict[str, torch.Tensor] = {}
        drafter = llm.engine.runner.drafter
        self._execute = drafter.execute
        drafter.execute = self

    def __call__(self, runner, plan) -> FinishedStep:
        step = self._execute(runner, plan)
        requests = {r.request_id: r for r in self.engine.scheduler.running}
        k_cache = runner.caches.k[-1]
        block_size = k_cache.shape[1]
        for request_id, drafts in step.result().drafts.items():
            if request_id in self.first:
                continue
            self.first[request_id] = drafts
            request = requests[request_id]
            slots = [request.blocks[p // block_size] * block_size + p % block_size
                     for p in range(len(request.prompt_token_ids))]
            self.keys[request_id] = k_cache.flatten(0, 1)[slots].clone()
        return step


def test_chunked_prefill_gives_the_head_the_same_inputs(tiny_model_factory, tmp_path_factory):
    """Prompts prefilled in chunks of 8 tokens (the head's input at a chunk's last position is the
    next chunk's first token, `Segment.next_token`) and split at a marker give the head the KV and
    drafts of one-chunk prefills."""
    source, _ = tiny_model_factory("qwen3_5_moe_text")
    directory = tmp_path_factory.mktemp("chunked_mtp")
    add_mtp_weights(source, directory)
    prompts = [token_words(50, 30), f"{token_words(51, 12)} {MARK} {token_words(52, 17)}"]
    params = dataclasses.replace(GREEDY, max_tokens=3)
    runs = []
    for threshold in (None, 8):
        llm = LLM(str(directory), long_prefill_token_threshold=threshold, speculative_config=SPEC)
        recorder = FirstDrafts(llm)
        generate_checked(llm, prompts, params)
        runs.append(recorder)
    assert runs[0].first == runs[1].first and len(runs[0].first) == len(prompts)
    assert all(len(d) == K for d in runs[0].first.values())
    for request_id, keys in runs[0].keys.items():
        torch.testing.assert_close(runs[1].keys[request_id], keys, rtol=1e-5, atol=1e-5)
