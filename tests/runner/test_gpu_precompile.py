"""Start-up compile workers on CUDA (runner/precompile.py): they compile into the Triton cache they are
given, and an engine that ran them gives the same tokens as one that did not (skipped without CUDA)."""

from __future__ import annotations

import logging

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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("gpu_precompile")
    build_tiny_model(directory, "qwen3_5_moe_text", fused_experts=True, **GPU_DIMS)
    return directory


def test_workers_compile_into_the_given_cache(model_dir, tmp_path):
    plan = CompilePlan(ModelConfig.from_hf_dir(model_dir), "bfloat16", SIZES, num_request_slots=16, block_size=16,
                       max_context=256, device="cuda:0")
    report = precompile(plan, 2, tmp_path)
    assert report.failed == 0 and marker_path(plan, tmp_path).exists()
    assert any(tmp_path.rglob("*.cubin")), "the workers compiled no kernel into the cache"
    autotuned = list(tmp_path.rglob("*.autotune.json"))
    assert not autotuned, f"workers kept autotune choices timed side by side: {autotuned[:3]}"


def test_an_engine_after_its_workers_gives_the_same_tokens(model_dir, tmp_path, monkeypatch, caplog):
    prompts = [token_words(1, 40), token_words(2, 9)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1)
    kwargs = dict(device="cuda", dtype="bfloat16", cuda_graph_sizes=SIZES, **ENGINE)
    plain = LLM(str(model_dir), startup_compile_workers=0, **kwargs).generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.INFO):
        llm = LLM(str(model_dir), startup_compile_workers=2, **kwargs)
    assert "kernels compiled in 2 processes" in caplog.text
    assert "parallel compile" in caplog.text  # its own phase in the start-up summary
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, outputs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    caplog.clear()
    with caplog.at_level(logging.INFO):
        LLM(str(model_dir), startup_compile_workers=2, **kwargs)
    assert "kernel cache warm" in caplog.text and "compiled in 2 processes" not in caplog.text
