"""The Mamba2 hybrids (Nemotron-H, Granite-4.0-H, Falcon-H1) against transformers on tiny random
checkpoints saved with `save_pretrained` (float32, CPU; transformers' pure-torch Mamba2 path).
The oracle checks are those of tests/models/test_vs_transformers.py, run on these families."""

from __future__ import annotations

import json

import pytest
import torch

from forkpoint import LLM
from forkpoint.config import ModelConfig
from forkpoint.models.registry import model_class
from tests.models import test_vs_transformers as qwen_tests
from tests.tiny_models import MAMBA2_MODEL_TYPES


@pytest.mark.parametrize("model_type", MAMBA2_MODEL_TYPES)
def test_logits_match_transformers(tiny_model_factory, model_type):
    """Relative error <= 1e-4 over all 83 positions of one prefill (more than one SSD chunk)."""
    qwen_tests.test_logits_match_transformers(tiny_model_factory, model_type, False)


@pytest.mark.parametrize("model_type", MAMBA2_MODEL_TYPES)
def test_greedy_generation_matches_transformers_under_chunking_and_batching(tiny_model_factory, model_type):
    """24-token budget: chunked prefills from checkpointed states, decodes beside prefills."""
    qwen_tests.test_greedy_generation_matches_transformers_under_chunking_and_batching(
        tiny_model_factory, model_type, False)


def test_nemotron_layer_pattern_and_pool_shapes(tiny_model_factory):
    directory, _ = tiny_model_factory("nemotron_h")
    raw = json.loads((directory / "config.json").read_text())
    config = ModelConfig.from_dict(raw)
    assert config.layer_types == ("mamba2", "moe", "full_attention", "mlp", "mamba2", "moe")
    pattern = {k: v for k, v in raw.items() if k != "layers_block_type"} | {"hybrid_override_pattern": "ME*-ME"}
    assert ModelConfig.from_dict(pattern).layer_types == config.layer_types
    assert config.recurrent_layer_ids == (0, 4) and config.attention_layer_ids == (2,)
    shapes = model_class(config)(config).pool_shapes(torch.float32)
    assert shapes.num_recurrent_layers == 2 and shapes.num_attention_layers == 1
    assert shapes.state.conv_shape == (64 + 2 * 2 * 16, 3) and shapes.state.ssm_shape == (8, 8, 16)
    with pytest.raises(ValueError, match="unknown layer codes"):
        ModelConfig.from_dict(pattern | {"hybrid_override_pattern": "MQ"})


def test_falcon_parallel_layers_hold_state_and_kv(tiny_model_factory):
    directory, _ = tiny_model_factory("falcon_h1")
    config = ModelConfig.from_hf_dir(directory)
    assert config.recurrent_layer_ids == config.attention_layer_ids == (0, 1, 2)
    llm = LLM(str(directory), num_kv_blocks=32, max_num_seqs=2)
    assert llm.engine.state_pool.ssm_stack.shape[0] == 3 and len(llm.engine.block_pool.k) == 3


def test_unknown_types_and_inconsistent_architectures_are_clear_errors(tiny_model_factory):
    directory, _ = tiny_model_factory("granitemoehybrid")
    raw = json.loads((directory / "config.json").read_text())
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'.*nemotron_h"):
        ModelConfig.from_dict(raw | {"model_type": "mamba"})
    with pytest.raises(ValueError, match="architecture 'NemotronHForCausalLM'"):
        model_class(ModelConfig.from_dict(raw | {"architectures": ["NemotronHForCausalLM"]}))
    with pytest.raises(ValueError, match="mamba_n_heads"):
        ModelConfig.from_dict(raw | {"mamba_d_head": 12})
