"""Whole-step decode graphs (runner/decode_graphs.py) without CUDA graphs: the static buffers, the
padding rows on the pools' scratch rows and the block-table padding that the graphs replay must give
the plain forward's logits and pool writes, and leave every non-scratch pool row the plain forward
does not write untouched."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.runner.decode_graphs import DecodeGraphs, decode_bucket_sizes
from tests.runner.test_piecewise import ENGINE, MARK, TOL, words

SIZES = (1, 2, 4, 8)


def make_graphs(engine, sizes=SIZES, max_blocks=None) -> DecodeGraphs:
    runner = engine.runner
    return DecodeGraphs(runner.model, runner.caches, sizes, max_blocks or engine.block_pool.num_blocks,
                        scratch_block=engine.block_pool.scratch_block, block_size=engine.block_pool.block_size,
                        scratch_state_slot=engine.state_pool.scratch_slot, device=engine.device, capture=False)


def without_scratch(engine) -> list[torch.Tensor]:
    """Every pool row a request or checkpoint may own (scratch rows dropped), as views."""
    caches, scratch_slot = engine.runner.caches, engine.state_pool.scratch_slot
    states = [t[:scratch_slot] for t in (*caches.conv, *caches.ssm)]
    return states + [t[: engine.block_pool.scratch_block] for t in (*caches.k, *caches.v)]


def scratch_rows(engine) -> list[torch.Tensor]:
    caches = engine.runner.caches
    return ([t[engine.state_pool.scratch_slot] for t in (*caches.conv, *caches.ssm)]
            + [t[engine.block_pool.scratch_block] for t in (*caches.k, *caches.v)])


class BothPaths:
    """Stands in for `ModelRunner.forward`: decode steps run through the plain forward, the pools
    are restored, then through the decode graphs' static path; logits and pools must agree."""

    def __init__(self, engine, graphs: DecodeGraphs) -> None:
        self.engine, self.graphs = engine, graphs
        self.decode_steps, self.padded, self.other_steps = 0, 0, 0

    def __call__(self, batch):
        runner = self.engine.runner
        if not self.graphs.accepts(batch):
            assert batch.phases or batch.decode is None
            self.other_steps += 1
            return runner.model(batch, runner.caches)
        pools = without_scratch(self.engine)
        before = [t.clone() for t in pools]
        plain = runner.model(batch, runner.caches).clone()
        after = [t.clone() for t in pools]
        for tensor, saved in zip(pools, before):
            tensor.copy_(saved)
        # every other step the scratch rows hold NaN: whatever the padding rows read or write there
        # must not reach the real rows; on the others they hold what the padding wrote before
        poisoned = self.decode_steps % 2 == 0
        if poisoned:
            for row in scratch_rows(self.engine):
                row.fill_(float("nan"))
        graphs = self.graphs(batch).clone()
        torch.testing.assert_close(graphs, plain, **TOL)
        for tensor, expected in zip(pools, after):
            torch.testing.assert_close(tensor, expected, **TOL)  # incl. rows no real token touches
        rows = self.graphs.bucket(batch.num_tokens)
        if rows > batch.num_tokens:
            self.padded += 1
            if not poisoned:
                assert torch.isfinite(self.graphs.logits[:rows]).all()  # padding rows included
        if poisoned:
            for row in scratch_rows(self.engine):
                row.zero_()
        self.decode_steps += 1
        return graphs


# Mamba2: Nemotron-H (core-less MLP / MoE blocks, ReLU^2 experts) and Falcon-H1 (parallel layers);
# Granite-4.0-H's layers are of kinds these cover (its stacked core: test_piecewise)
@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "qwen3_5_text", "nemotron_h", "falcon_h1"])
def test_decode_steps_through_static_buffers_match_plain_forward(tiny_model_factory, model_type):
    directory, _ = tiny_model_factory(model_type)
    llm = LLM(str(directory), **ENGINE)
    engine = llm.engine
    both = BothPaths(engine, make_graphs(engine))
    engine.runner.forward = both
    anchor = words(0, 13)
    # 7 sequences at first (bucket 8: one padding row), fewer as they finish (buckets 4, 2, 1);
    # the longest grows a block table wider than the others'
    prompts = [f"{anchor} {MARK} w20 w21", f"{anchor} {MARK} w22", words(30, 23), "w5", "w6 w7", words(60, 9), "w9"]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (12, 3, 5, 2, 7, 4, 9)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert both.decode_steps >= 8 and both.padded >= 3 and both.other_steps >= 1
    assert [len(o.outputs[0].token_ids) for o in outs] == [12, 3, 5, 2, 7, 4, 9]
    engine.check_integrity()


def test_generation_with_decode_graphs_equals_plain(moe_model):
    plain = LLM(str(moe_model[0]), **ENGINE)
    llm = LLM(str(moe_model[0]), **ENGINE)
    llm.engine.runner.decode_graphs = make_graphs(llm.engine, sizes=(2, 8))
    prompts = [f"{words(40, 21)} {MARK} {words(70, n)}" for n in (1, 5, 12)] + [words(90, 40), "w7 w8"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    ours, theirs = (engine.generate(prompts, params, use_tqdm=False) for engine in (llm, plain))
    assert llm.engine.runner.decode_graphs.replays >= 5
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert step_a.keys() == step_b.keys()
            assert max(abs(step_a[t] - step_b[t]) for t in step_a) <= 1e-5
    llm.engine.check_integrity()


def test_what_the_decode_graphs_take(moe_model):
    llm = LLM(str(moe_model[0]), **ENGINE)
    engine, runner = llm.engine, llm.engine.runner
    batches = []
    plain_forward = runner.forward
    runner.forward = lambda batch: batches.append(batch) or plain_forward(batch)
    # 20 tokens: 3 blocks of 8 (then 24 tokens: 3 blocks); the other one block
    llm.generate([words(0, 20), "w1 w2"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    prefill, decode = batches[0], batches[-1]
    narrow, small, wide = make_graphs(engine, (2,), 2), make_graphs(engine, (1,), 4), make_graphs(engine, (2,), 4)
    assert not wide.accepts(prefill)  # recurrent phases
    with pytest.raises(ValueError, match="decode steps"):
        wide(prefill)
    assert decode.decode is not None and decode.decode.num_tokens == 2 and not decode.phases
    assert decode.attention.block_tables.shape[1] == 3
    assert wide.accepts(decode)
    assert not narrow.accepts(decode)  # the table is wider than the buffers
    assert not small.accepts(decode)  # more sequences than the largest bucket
    assert decode_bucket_sizes((1, 2, 4, 8, 16), 5) == (1, 2, 4, 8)
    assert decode_bucket_sizes((1, 2, 4, 8, 16), 8) == (1, 2, 4, 8)
    assert decode_bucket_sizes((1, 2, 4), 64) == (1, 2, 4)
    with pytest.raises(ValueError, match="CUDA device"):
        DecodeGraphs(runner.model, runner.caches, (1,), 4, scratch_block=0, block_size=8,
                     scratch_state_slot=1, device=torch.device("cpu"), capture=True)
