"""CUDA graphs for the Mamba2 hybrids (skipped without CUDA): piecewise graphs with the per-step
Mamba2 core graph (runner/piecewise.py) and whole-step decode graphs (runner/decode_graphs.py) on
tiny Nemotron-H (Mamba2, attention, ReLU^2 MLP and grouped ReLU^2 MoE), Granite-4.0-H (Mamba2,
attention, grouped SwiGLU MoE) and Falcon-H1 (attention and Mamba2 in parallel) against the eager
path of the same engine, and a random mix of served steps after the warm-up that must not compile,
autotune or capture anything beyond the per-step core graphs. Measured values are printed
(`pytest -s`, lines starting with GPU_MAMBA2_GRAPHS)."""

from __future__ import annotations

import pytest
import torch

from forkpoint import LLM, SamplingParams
from tests.models.test_gpu_mamba2 import ENGINE, GPU_DIMS
from tests.models.test_gpu_model import max_logprob_diff, random_ids
from tests.runner.test_gpu_cuda_graphs import GRAPH_LOGPROB_TOL
from tests.runner.test_gpu_decode_graphs import CompileCounter
from tests.tiny_models import MAMBA2_MODEL_TYPES, build_tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@pytest.fixture(scope="module", params=MAMBA2_MODEL_TYPES)
def llm(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(f"gpu_graphs_{request.param}")
    build_tiny_model(directory, request.param, **GPU_DIMS[request.param])
    return LLM(str(directory), device="cuda", dtype="bfloat16", cuda_graph_sizes=SIZES, max_num_batched_tokens=512,
               **ENGINE)


def mixed_prompts(generator, marker):
    anchor = random_ids(generator, 70)
    prompts = [{"prompt_token_ids": anchor + [marker] + random_ids(generator, n)} for n in (3, 20, 1, 45)]
    prompts += [{"prompt_token_ids": random_ids(generator, n)} for n in (1, 9, 130, 33, 600, 5, 17)]
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5)
              for m in (12, 3, 9, 16, 7, 2, 10, 5, 14, 4, 8)]
    return prompts, params


def test_graphs_match_the_eager_path(llm):
    """Generations (1-to-N through a checkpoint, chunked prefill of a 600-token prompt next to
    decodes) through piecewise + decode graphs vs the same engine with both detached."""
    runner = llm.engine.runner
    piecewise, graphs = runner.piecewise, runner.decode_graphs
    assert piecewise is not None and piecewise.captured and graphs is not None
    assert sorted(graphs.graphs) == [1, 2, 4, 8, 16]
    prompts, params = mixed_prompts(torch.Generator().manual_seed(11), llm.checkpoint_token_id)
    replays, core_steps = graphs.replays, piecewise.core_graph_steps
    # both runs start from an empty cache, so they run the same steps (a producer and three consumers);
    # a second run would resume every anchor from the first run's checkpoint, another path (not bit-equal
    # in bf16 without checkpoint_exact)
    assert llm.reset_prefix_cache()
    with_graphs = llm.generate(prompts, params, use_tqdm=False)
    replays, core_steps = graphs.replays - replays, piecewise.core_graph_steps - core_steps
    assert replays >= 12 and core_steps >= 2 and piecewise.core_capture_failures == 0
    runner.piecewise = runner.decode_graphs = None
    try:
        assert llm.reset_prefix_cache()
        eager = llm.generate(prompts, params, use_tqdm=False)
    finally:
        runner.piecewise, runner.decode_graphs = piecewise, graphs
    worst = max(max_logprob_diff(a, b) for a, b in zip(with_graphs, eager))
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(with_graphs, eager))
    print(f"GPU_MAMBA2_GRAPHS {llm.engine.model_config.model_type}: {replays} decode replays, {core_steps} steps "
          f"with a replayed Mamba2 core, max top-5 logprob diff {worst:.2e}, {same}/{len(prompts)} generations "
          "identical")
    assert worst <= GRAPH_LOGPROB_TOL
    assert [o.num_cached_tokens for o in with_graphs[:4]] == [0, 70, 70, 70]
    assert [o.num_cached_tokens for o in eager] == [o.num_cached_tokens for o in with_graphs]
    llm.engine.check_integrity()


def test_nothing_compiles_after_the_warm_up(llm, monkeypatch):
    runner = llm.engine.runner
    piecewise = runner.piecewise
    counter = CompileCounter(monkeypatch, piecewise)
    generator = torch.Generator().manual_seed(21)
    marker = llm.checkpoint_token_id
    for _round in range(3):
        anchor = random_ids(generator, int(torch.randint(1, 400, (1,), generator=generator)))
        prompts, params = [], []
        for _ in range(int(torch.randint(1, 17, (1,), generator=generator))):
            suffix = random_ids(generator, int(torch.randint(1, 300, (1,), generator=generator)))
            kind = int(torch.randint(0, 3, (1,), generator=generator))
            ids = anchor + [marker] + suffix if kind == 0 else anchor + suffix if kind == 1 else suffix
            prompts.append({"prompt_token_ids": ids})
            params.append(SamplingParams(temperature=0.0, ignore_eos=True,
                                         max_tokens=int(torch.randint(1, 9, (1,), generator=generator))))
        llm.generate(prompts, params, use_tqdm=False)
    core_captures = counter.core_captures
    print(f"GPU_MAMBA2_GRAPHS {llm.engine.model_config.model_type} after warm-up ({runner.warmup}): Triton cache "
          f"misses {len(counter.compiled)}, autotunes {len(counter.autotuned)}, graph captures {counter.captures} "
          f"(per-step core graphs {core_captures}); compiled: {sorted(set(counter.compiled))[:12]}; "
          f"autotuned: {sorted(set(counter.autotuned))}")
    assert not counter.compiled
    assert not counter.autotuned
    assert counter.captures == core_captures and piecewise.core_capture_failures == 0
    llm.engine.check_integrity()
