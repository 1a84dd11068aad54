"""Whole-step verify graphs (runner/decode_graphs.py with drafts = k) without CUDA graphs: a uniform
verify step (every sequence verifies k drafts) through the static buffers, padded to a bucket on the
pools' scratch rows, must give the eager forward's last-layer stream and pool writes, leave every
non-scratch pool row the eager forward does not write untouched, and leave the other steps to the
eager path. Float32 CPU, tiny Qwen3.5 / Qwen3.5-MoE / Qwen3-Next models with random MTP weights and
the oracle drafts of tests/engine/test_speculative.py; greedy outputs equal the plain engine's."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.runner.decode_graphs import DecodeGraphs
from tests.engine.test_speculative import SPEC, K, OracleDrafts, continuations, generate_checked
from tests.helpers import assert_same_outputs
from tests.runner.test_decode_graphs import scratch_rows, without_scratch
from tests.tiny_models import add_mtp_weights, token_words

TOL = dict(rtol=1e-5, atol=1e-5)  # float32: only the padded matmul shapes differ
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2)
# three sequences: bucket 4 has a padding row in every group; the others finish earlier
PROMPTS = [token_words(30, 11), token_words(50, 6), token_words(70, 17)]
MAX_TOKENS = (14, 9, 12)


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
def mtp_model(request, tiny_model_factory, tmp_path_factory):
    source, _ = tiny_model_factory(request.param)
    directory = tmp_path_factory.mktemp(f"{request.param}_verify_mtp")
    add_mtp_weights(source, directory)
    return directory


def make_graphs(engine, sizes=(1, 2, 4), drafts=K, max_blocks=None) -> DecodeGraphs:
    runner = engine.runner
    return DecodeGraphs(runner.model, runner.caches, sizes, max_blocks or engine.block_pool.num_blocks,
                        scratch_block=engine.block_pool.scratch_block, block_size=engine.block_pool.block_size,
                        scratch_state_slot=engine.state_pool.scratch_slot, device=engine.device, capture=False,
                        drafts=drafts)


def is_uniform_verify(batch, drafts=K) -> bool:
    n = batch.decode.num_tokens if batch.decode is not None else 0
    return (n > 0 and len(batch.phases) == drafts and batch.num_tokens == n * (drafts + 1)
            and all(p.single_tokens and p.token_end - p.token_start == n for p in batch.phases))


class BothPaths:
    """Stands in for `ModelRunner.forward_hidden`: uniform verify steps run eagerly, the pools are
    restored, then through the verify graphs' static path (every other one with NaN in the scratch
    rows); the stream and the pools must agree. Other steps run eagerly."""

    def __init__(self, engine, graphs: DecodeGraphs) -> None:
        self.engine, self.graphs = engine, graphs
        self.verify_steps, self.padded, self.other_steps = 0, 0, 0
        self.sizes: set[int] = set()

    def __call__(self, batch):
        runner = self.engine.runner
        if not self.graphs.accepts(batch):
            assert not is_uniform_verify(batch)
            self.other_steps += 1
            return runner.model.forward_hidden(batch, runner.caches)
        assert is_uniform_verify(batch)
        pools = without_scratch(self.engine)
        before = [t.clone() for t in pools]
        eager = runner.model.forward_hidden(batch, runner.caches).clone()
        after = [t.clone() for t in pools]
        for tensor, saved in zip(pools, before):
            tensor.copy_(saved)
        poisoned = self.verify_steps % 2 == 0
        if poisoned:  # whatever the padding rows read or write there must not reach the real rows
            for row in scratch_rows(self.engine):
                row.fill_(float("nan"))
        hidden = self.graphs.forward_hidden(batch)
        assert hidden.shape == eager.shape
        torch.testing.assert_close(hidden, eager, **TOL)
        for tensor, expected in zip(pools, after):
            torch.testing.assert_close(tensor, expected, **TOL)  # incl. rows no real token touches
        n = batch.decode.num_tokens
        seqs = self.graphs.bucket(n)
        self.sizes.add(n)
        if seqs > n:
            self.padded += 1
            if not poisoned:
                assert torch.isfinite(self.graphs.hidden[: (K + 1) * seqs]).all()  # padding rows included
        if poisoned:
            for row in scratch_rows(self.engine):
                row.zero_()
        self.verify_steps += 1
        return hidden


def test_verify_steps_through_static_buffers_match_eager(mtp_model):
    params = [dataclasses.replace(GREEDY, max_tokens=m) for m in MAX_TOKENS]
    reference = LLM(str(mtp_model)).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(mtp_model), speculative_config=SPEC)
    engine = llm.engine
    both = BothPaths(engine, make_graphs(engine))
    engine.runner.forward_hidden = both
    OracleDrafts(llm, continuations(reference))
    assert_same_outputs(generate_checked(llm, PROMPTS, params), reference)
    # verify steps of 3 sequences (bucket 4: padded) and fewer; prefill and ragged verify steps eager
    assert both.verify_steps >= 3 and both.padded >= 1 and both.other_steps >= 2, vars(both)
    assert 3 in both.sizes
    metrics = llm.metrics()
    assert 0.0 < metrics["spec_acceptance_rate_pos_1"] < 1.0


def test_generation_with_verify_graphs_equals_plain(moe_model, tmp_path_factory):
    """Every draft right: every step after the prefill is a uniform verify step, of 3 sequences
    (bucket 4, padded), then 2 (bucket 2) and 1 (bucket 2, padded) as the shorter ones finish."""
    directory = tmp_path_factory.mktemp("verify_graphs_mtp")
    add_mtp_weights(moe_model[0], directory)
    params = [dataclasses.replace(GREEDY, max_tokens=m) for m in (1 + 4 * (K + 1), 1 + 2 * (K + 1), 1 + 3 * (K + 1))]
    reference = LLM(str(directory)).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(directory), speculative_config=SPEC)
    runner = llm.engine.runner
    assert runner.verify_graphs is None and runner.decode_graphs is None  # CPU: no graphs captured
    runner.verify_graphs = graphs = make_graphs(llm.engine, sizes=(2, 4))
    seqs = []
    forward_hidden = graphs.forward_hidden
    graphs.forward_hidden = lambda batch: seqs.append(batch.decode.num_tokens) or forward_hidden(batch)
    OracleDrafts(llm, continuations(reference), corrupt=False)
    assert_same_outputs(generate_checked(llm, PROMPTS, params), reference)
    assert seqs == [3, 3, 2, 1] and graphs.replays == 4
    metrics = llm.metrics()
    assert metrics["spec_verifications"] == 9 and metrics["spec_mean_acceptance_length"] == K + 1
    llm.engine.check_integrity()


def test_what_the_verify_graphs_take(moe_model, tmp_path_factory):
    directory = tmp_path_factory.mktemp("verify_take_mtp")
    add_mtp_weights(moe_model[0], directory)
    params = [dataclasses.replace(GREEDY, max_tokens=m) for m in MAX_TOKENS]
    reference = LLM(str(directory)).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(str(directory), speculative_config=SPEC)
    engine, runner = llm.engine, llm.engine.runner
    batches = []
    forward_hidden = runner.forward_hidden
    runner.forward_hidden = lambda batch: batches.append(batch) or forward_hidden(batch)
    OracleDrafts(llm, continuations(reference))
    generate_checked(llm, PROMPTS, params)
    uniform = [b for b in batches if is_uniform_verify(b)]
    ragged = [b for b in batches if b.phases and all(p.single_tokens for p in b.phases) and not is_uniform_verify(b)]
    prefill = batches[0]
    assert uniform and ragged
    wide = max(uniform, key=lambda b: (b.decode.num_tokens, b.attention.block_tables.shape[1]))
    graphs = make_graphs(engine)
    assert graphs.accepts(wide) and all(graphs.accepts(b) for b in uniform)
    assert not any(graphs.accepts(b) for b in ragged)  # some sequences verify fewer than k drafts
    assert not graphs.accepts(prefill)
    with pytest.raises(ValueError, match=f"exactly {K} drafts"):
        graphs.forward_hidden(prefill)
    with pytest.raises(ValueError, match="call forward_hidden"):
        graphs.forward(wide)
    assert not make_graphs(engine, drafts=K - 1).accepts(wide)  # another k
    decode_graphs = make_graphs(engine, drafts=0)
    assert not decode_graphs.accepts(wide)
    with pytest.raises(ValueError, match="call forward"):
        decode_graphs.forward_hidden(wide)
    width = wide.attention.block_tables.shape[1]
    assert width >= 2 and wide.decode.num_tokens == 3
    assert not make_graphs(engine, max_blocks=width - 1).accepts(wide)
    assert not make_graphs(engine, sizes=(wide.decode.num_tokens - 1,)).accepts(wide)
    with pytest.raises(ValueError, match="drafts must be >= 0"):
        make_graphs(engine, drafts=-1)
    # a plain decode step (no drafts) is not a verify step
    plain = LLM(str(directory))
    decodes = []
    plain_forward = plain.engine.runner.forward
    plain.engine.runner.forward = lambda batch: decodes.append(batch) or plain_forward(batch)
    plain.generate(PROMPTS[:2], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert decodes[-1].decode is not None and not decodes[-1].phases
    assert not graphs.accepts(decodes[-1])
