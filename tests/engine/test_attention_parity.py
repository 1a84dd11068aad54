"""The attention parity C (engine/attention_parity.py): the matrix weights a token multiplies, counted from
the model's shape, equal those of the Hugging Face model; C is those over the attention multiply-adds a
context position costs; the engine's scheduler gets it, or `attention_parity_tokens` when given."""

from __future__ import annotations

import argparse
import dataclasses

import torch

from forkpoint import LLM
from forkpoint.config import ModelConfig
from forkpoint.engine.attention_parity import attention_parity, matmul_params_per_token
from forkpoint.server.engine_args import add_engine_args, engine_kwargs


def test_the_count_is_the_hf_models_linear_weights(tiny_model_factory):
    """Dense Qwen3.5 (no experts to scale by top-k): every nn.Linear but the LM head, one weight a multiply-add."""
    directory, hf_model = tiny_model_factory("qwen3_5_text")
    weights = sum(module.weight.numel() for name, module in hf_model.named_modules()
                  if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head"))
    config = ModelConfig.from_hf_dir(directory)
    assert matmul_params_per_token(config) == weights
    per_position = 2 * config.num_attention_heads * config.head_dim  # one attention layer: q.k and p.v
    assert attention_parity(config) == round(weights / per_position)


def test_more_attention_layers_lower_it_and_none_without_attention(model_dir):
    config = ModelConfig.from_hf_dir(model_dir)
    one = attention_parity(config)
    two = dataclasses.replace(config, layer_types=("full_attention",) * 2 + config.layer_types[2:])
    assert attention_parity(two) < one
    assert attention_parity(dataclasses.replace(config, layer_types=("linear_attention",) * config.num_layers)) is None


def test_the_engine_takes_the_count_or_the_override(model_dir):
    derived = LLM(str(model_dir), num_kv_blocks=32).engine.scheduler.attention_parity
    assert derived == attention_parity(ModelConfig.from_hf_dir(model_dir))
    assert LLM(str(model_dir), num_kv_blocks=32, attention_parity_tokens=123).engine.scheduler.attention_parity == 123


def test_the_servers_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser, positional_model=False)
    assert engine_kwargs(parser.parse_args([]))["attention_parity_tokens"] is None  # counted from the shape
    assert engine_kwargs(parser.parse_args(["--attention-parity-tokens", "500"]))["attention_parity_tokens"] == 500
