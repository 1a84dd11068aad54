"""Speculative decoding with the MTP head on CUDA (skipped without): bf16, the tiny Qwen3.5-MoE model at
the GPU kernels' head sizes with random MTP weights, drafts from the oracle of test_speculative.py
(30% corrupted). Greedy tokens equal the plain engine's with checkpoints (markers, turn ends), with
logprobs within the graph tolerance; with `checkpoint_exact` the issue asks for bit-identical
results. The verify step runs every position through the single-token recurrent kernels as plain
decode does, as a whole-step graph when every sequence verifies k drafts (runner/decode_graphs.py's
verify graphs; the other verify steps through the piecewise graphs) and with k + 1 rows per sequence
in each GEMM, padded to a bucket (beyond 16 rows the dense projections leave the row-stable Triton
kernel for F.linear): this test says whether the bits still agree, with the verify graphs and
without them."""

from __future__ import annotations

import pytest
import torch

from forkpoint import SamplingParams
from tests.engine.test_speculative import MARK, SPEC, K, OracleDrafts, continuations, generate_checked
from tests.models.test_gpu_model import max_logprob_diff
from tests.runner.test_gpu_cuda_graphs import GRAPH_LOGPROB_TOL, make_llm, model_dir  # noqa: F401 (fixture)
from tests.tiny_models import add_mtp_weights, token_words

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=5)
ANCHOR = token_words(3, 80)
PROMPTS = [f"{ANCHOR} {MARK} {token_words(10 + i, 6 + 3 * i)}" for i in range(4)] + [token_words(20, 50)]
# every running sequence gets a spare state row per draft (engine/speculative.py)
SPEC_ENGINE = dict(speculative_config=SPEC, num_state_slots=16 * (1 + K), auto_checkpoints=True)


@pytest.fixture(scope="module")
def mtp_dir(model_dir, tmp_path_factory):  # noqa: F811 (the imported fixture)
    directory = tmp_path_factory.mktemp("gpu_mtp")
    add_mtp_weights(model_dir, directory)
    return directory


def worst_diff(outputs, reference) -> float:
    return max(max_logprob_diff(a, b) for a, b in zip(outputs, reference))


def _run_both(mtp_dir, **kwargs):
    plain = make_llm(mtp_dir, auto_checkpoints=True, **kwargs)
    reference = plain.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm = make_llm(mtp_dir, **SPEC_ENGINE, **kwargs)
    OracleDrafts(llm, continuations(reference))
    ours = generate_checked(llm, PROMPTS, GREEDY)
    again = generate_checked(llm, PROMPTS, GREEDY)  # warm: consumers of the marked prefix
    return reference, ours, again, llm


def test_greedy_tokens_equal_the_plain_engine_on_cuda(mtp_dir):
    reference, ours, again, llm = _run_both(mtp_dir)
    for outputs in (ours, again):
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
        assert worst_diff(outputs, reference) <= GRAPH_LOGPROB_TOL
    runner = llm.engine.runner  # the verify steps ran through the verify graphs and the captured pieces
    assert runner.piecewise is not None and runner.piecewise.captured and runner.decode_graphs is None
    assert runner.verify_graphs is not None and runner.verify_graphs.replays > 0
    metrics = llm.metrics()
    assert metrics["spec_verifications"] > 0 and 0.0 < metrics["spec_acceptance_rate_pos_1"] < 1.0
    assert metrics["checkpoint_hits"] > 0
    print(f"GPU_SPEC mean acceptance length {metrics['spec_mean_acceptance_length']:.2f}, "
          f"max |logprob diff| {max(worst_diff(ours, reference), worst_diff(again, reference)):.2e}")


def test_checkpoint_exact_results_are_bit_identical(mtp_dir):
    reference, ours, again, llm = _run_both(mtp_dir, checkpoint_exact=True)
    runner = llm.engine.runner
    graphs = runner.verify_graphs
    assert graphs is not None and graphs.replays > 0
    runner.verify_graphs = None  # every verify step through the piecewise graphs
    assert llm.reset_prefix_cache()
    graphs_off = generate_checked(llm, PROMPTS, GREEDY)
    print(f"GPU_SPEC checkpoint_exact: {graphs.replays} verify graph replays; max |logprob diff| vs plain "
          f"{max(worst_diff(ours, reference), worst_diff(again, reference)):.2e} with the verify graphs, "
          f"{worst_diff(graphs_off, reference):.2e} without")
    for outputs in (ours, again, graphs_off):
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in reference]
        assert worst_diff(outputs, reference) == 0.0
