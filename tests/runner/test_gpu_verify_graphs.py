"""Whole-step verify graphs (runner/decode_graphs.py with drafts = k, speculative decoding) on CUDA
(skipped without): bf16, the tiny Qwen3.5-MoE model at the GPU kernels' head sizes with random MTP
weights, drafts from the oracle of tests/engine/test_speculative.py (30% corrupted). Each uniform
verify step replayed against the eager forward of the same step (output buffer poisoned with NaN
before the replay), then whole generations with the graphs against the same engine with them
detached (its verify steps through the piecewise graphs). Bit-identity with plain decode and with
the graphs-off run under `checkpoint_exact`: tests/engine/test_gpu_speculative.py, whose verify
steps replay these graphs.
Measured values are printed (`pytest -s`, lines starting with GPU_VERIFY)."""

from __future__ import annotations

import gc

import pytest
import torch

from tests.engine.test_gpu_speculative import GREEDY, PROMPTS, SPEC_ENGINE, mtp_dir, worst_diff  # noqa: F401
from tests.engine.test_speculative import K, OracleDrafts, continuations, generate_checked
from tests.runner.test_decode_graphs import without_scratch
from tests.runner.test_gpu_cuda_graphs import (  # noqa: F401 (model_dir: a fixture)
    GRAPH_LOGPROB_TOL,
    GRAPH_REL_TOL,
    assert_same_pool_writes,
    make_llm,
    model_dir,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


class VerifyVsEager:
    """Stands in for `ModelRunner.forward_hidden`: each uniform verify step runs through the model's
    eager forward, the pools are restored, then the graph replays (its output buffer NaN first).
    Checks the stream, that every row of the replayed bucket is finite (padding rows included), that
    the replay writes the pools' rows the eager step writes (to bf16 rounding) and leaves every other
    non-scratch row bit-identical. Other steps run as the runner runs them."""

    def __init__(self, llm) -> None:
        engine = llm.engine
        self.engine, self.runner = engine, engine.runner
        self.graphs = self.runner.verify_graphs
        self.block_size = engine.config.block_size
        self._forward_hidden = self.runner.forward_hidden
        self.worst, self.steps, self.padded, self.other_steps = 0.0, 0, 0, 0
        self.runner.forward_hidden = self

    def detach(self) -> None:
        del self.runner.forward_hidden  # the class's method again

    def __call__(self, batch):
        runner, graphs = self.runner, self.graphs
        if not graphs.accepts(batch):
            self.other_steps += 1
            return self._forward_hidden(batch)
        tensors = without_scratch(self.engine)
        num_states = len(runner.caches.conv) + len(runner.caches.ssm)
        before = [t.clone() for t in tensors]
        eager = runner.model.forward_hidden(batch, runner.caches).clone()
        after = [t.clone() for t in tensors]
        for tensor, saved in zip(tensors, before):
            tensor.copy_(saved)
        graphs.hidden.fill_(float("nan"))
        hidden = graphs.forward_hidden(batch)
        n = batch.decode.num_tokens
        seqs = graphs.bucket(n)
        assert seqs in graphs.graphs  # a replay, not the eager static path
        assert torch.isfinite(graphs.hidden[: (K + 1) * seqs]).all(), "the replay left rows unwritten or non-finite"
        rel = ((hidden.float() - eager.float()).norm() / eager.float().norm()).item()
        self.worst = max(self.worst, rel)
        self.steps += 1
        self.padded += seqs > n
        assert_same_pool_writes(tensors, before, after, [i >= num_states for i in range(len(tensors))],
                                self.block_size)
        return hidden


def test_verify_graphs_match_eager_steps_and_the_graphs_off_run(mtp_dir):  # noqa: F811
    plain = make_llm(mtp_dir, auto_checkpoints=True)
    reference = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    del plain
    gc.collect()
    torch.cuda.empty_cache()
    llm = make_llm(mtp_dir, **SPEC_ENGINE)
    runner = llm.engine.runner
    graphs = runner.verify_graphs
    assert runner.decode_graphs is None and graphs is not None and graphs.drafts == K
    assert sorted(graphs.graphs) == list(graphs.sizes) and graphs.sizes[-1] >= len(PROMPTS)
    assert "verify" in runner.graph_summary()
    OracleDrafts(llm, continuations(reference))

    check = VerifyVsEager(llm)
    checked = generate_checked(llm, PROMPTS, GREEDY)
    check.detach()
    assert check.steps >= 3 and check.padded >= 1 and check.other_steps >= 1, vars(check)
    assert check.worst <= GRAPH_REL_TOL

    assert llm.reset_prefix_cache()  # the runs below from an empty cache: the same steps
    replays = graphs.replays
    with_graphs = generate_checked(llm, PROMPTS, GREEDY)
    replayed = graphs.replays - replays
    runner.verify_graphs = None
    assert llm.reset_prefix_cache()
    graphs_off = generate_checked(llm, PROMPTS, GREEDY)
    runner.verify_graphs = graphs
    tokens = [o.outputs[0].token_ids for o in reference]
    for outputs in (checked, with_graphs, graphs_off):
        assert [o.outputs[0].token_ids for o in outputs] == tokens
    assert [o.num_cached_tokens for o in with_graphs] == [o.num_cached_tokens for o in graphs_off]
    graphs_vs_off = worst_diff(with_graphs, graphs_off)
    metrics = llm.metrics()
    print(f"GPU_VERIFY buckets {sorted(graphs.graphs)}; per step vs eager: {check.steps} uniform verify steps "
          f"({check.padded} padded, {check.other_steps} other steps), worst rel {check.worst:.2e}; one run: "
          f"{replayed} replays of {metrics['spec_verifications']} verifications so far; max |logprob diff| graphs "
          f"vs graphs off {graphs_vs_off:.2e}, vs plain {worst_diff(with_graphs, reference):.2e}")
    assert replayed >= 3
    assert graphs_vs_off <= GRAPH_LOGPROB_TOL
    assert worst_diff(with_graphs, reference) <= GRAPH_LOGPROB_TOL
    llm.engine.check_integrity()
