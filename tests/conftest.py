"""Shared fixtures: tiny transformers-built checkpoints and engine integrity checks."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import build_tiny_model

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
