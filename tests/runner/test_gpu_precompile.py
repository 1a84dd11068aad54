"""Start-up compile workers on CUDA (runner/precompile.py): worker processes run their share against the
process's Triton cache (their autotuners on a share of the configs), and an engine that ran them gives
the same tokens as one that did not (skipped without CUDA). The cold-start gain is measured by
bench/startup.py, not here: a cold compile into an empty cache takes minutes."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.config import ModelConfig
from forkpoint.runner.precompile import CompilePlan, marker_path, precompile
from tests.models.test_gpu_model import ENGINE, GPU_DIMS
from tests.tiny_models import build_tiny_model, token_words

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SIZES = (1, 8, 24, 64)
ENGINE_KWARGS = dict(device="cuda", dtype="bfloat16", cuda_graph_sizes=SIZES, **ENGINE)
PROMPTS = [token_words(1, 40), token_words(2, 9)]
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpu_precompile")
    build_tiny_model(directory, "qwen3_5_moe_text", fused_experts=True, **GPU_DIMS)
    return directory


@pytest.fixture(scope="module")
def plain_outputs(model_dir):
    """The engine without workers, first: its kernels are then in this process's Triton cache, so the
    workers below load them (a cold compile into an empty cache takes minutes per worker)."""
    llm = LLM(str(model_dir), startup_compile_workers=0, **ENGINE_KWARGS)
    return llm.generate(PROMPTS, PARAMS, use_tqdm=False)


def triton_cache_dir() -> Path:
    from triton import knobs

    return Path(knobs.cache.dir)


def test_workers_run_their_shares_on_cuda(model_dir, plain_outputs):
    plan = CompilePlan(ModelConfig.from_hf_dir(model_dir), "bfloat16", SIZES, num_request_slots=16, block_size=16,
                       max_context=255, device="cuda:0")  # a plan of its own: no engine's marker
    report = precompile(plan, 2, triton_cache_dir())
    assert report.failed == 0, report.summary()
    assert marker_path(plan, triton_cache_dir()).exists()


def test_an_engine_after_its_workers_gives_the_same_tokens(model_dir, plain_outputs, caplog):
    with caplog.at_level(logging.INFO):
        llm = LLM(str(model_dir), startup_compile_workers=2, **ENGINE_KWARGS)
    if "kernel cache warm" not in caplog.text:  # this cache has not seen this plan: the workers ran
        assert "kernels compiled in 2 processes" in caplog.text and "failed (their share" not in caplog.text
        assert "parallel compile" in caplog.text  # its own phase in the start-up summary
    outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for a, b in zip(plain_outputs, outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    caplog.clear()
    with caplog.at_level(logging.INFO):
        LLM(str(model_dir), startup_compile_workers=2, **ENGINE_KWARGS)
    assert "kernel cache warm" in caplog.text and "compiled in 2 processes" not in caplog.text
