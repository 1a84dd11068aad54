"""Shared fixtures: tiny transformers-built checkpoints and engine integrity checks; one intra-op thread per
test process."""

from __future__ import annotations

import os

import pytest

# One intra-op thread per test process, and per child process (`forkpoint serve` children, Ray replicas: set
# before torch is imported, inherited by them). The tests' ops are small, and a second OpenMP thread
# spin-waits at every op's barrier whenever anything else wants a core (an in-process server's threads, a
# child server, Ray replicas, another job on the machine): tests/engine/test_{speculative,faults,memory_retry,
# decode_share}.py took 489 s with two threads beside one other busy process, 49 s with one (54 s and 56 s
# on an idle 2-core machine). OMP_NUM_THREADS set by the caller wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from tests.tiny_models import build_tiny_model  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

pytest.register_assert_rewrite("tests.helpers")  # detailed failures from its asserts (before the tests import it)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """build(model_type, fused_experts=False) -> (directory, transformers model); cached per session."""
    cache = {}

    def build(model_type: str, fused_experts: bool = False):
        key = (model_type, fused_experts)
        if key not in cache:
            directory = tmp_path_factory.mktemp(f"{model_type}{'_fused' if fused_experts else ''}")
            cache[key] = (directory, build_tiny_model(directory, model_type, fused_experts=fused_experts))
        return cache[key]

    return build


@pytest.fixture(scope="session")
def moe_model(tiny_model_factory):
    return tiny_model_factory("qwen3_5_moe_text")
