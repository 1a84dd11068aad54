"""Fixtures shared by the engine tests: the tiny Qwen3.5-MoE model directory (tests/conftest.py's
`moe_model`) and an engine on it without checkpoints, the oracle that runs with checkpoints are
compared against. A module that needs another model defines its own `model_dir`."""

from __future__ import annotations

import pytest

from forkpoint import LLM


@pytest.fixture(scope="module")
def model_dir(moe_model):
    return moe_model[0]


@pytest.fixture(scope="module")
def plain(model_dir):
    return LLM(str(model_dir), enable_checkpoints=False, num_kv_blocks=256)
