"""Tensor parallelism with block-wise FP8 weights (CPU, gloo): each rank holds exactly its share of every
FP8 weight and of its block scales (from the checkpoint, per-expert and fused experts, Qwen3-Next's
grouped projections, and as dummy weights), and tensor_parallel_size=2 gives one process's greedy
tokens and logprobs (float32, within 1e-5) with checkpoints; splits that would cut a block are refused."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forkpoint import LLM
from forkpoint.config import ModelConfig
from forkpoint.distributed.loading import build_shard
from forkpoint.distributed.sharding import ShardLayout, check_shardable
from forkpoint.models.loader import build_model
from tests.distributed.test_tensor_parallel import ENGINE, _prompts, _run
from tests.helpers import assert_same_outputs
from tests.models.fp8_checkpoints import quantize_checkpoint

# 16 x 16 blocks: every tiny split (GDN heads of 16 rows, a 32-row MoE share of 16, ...) is whole blocks
BLOCK = (16, 16)
CASES = [("qwen3_5_moe_text", False), ("qwen3_5_moe_text", True), ("qwen3_next", False), ("qwen3_5_text", False)]


class _Device:
    device = torch.device("cpu")


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_factory, tmp_path_factory):
    cache = {}

    def get(model_type, fused):
        if (model_type, fused) not in cache:
            directory = tmp_path_factory.mktemp(f"tp_fp8_{model_type}") / "fp8"
            quantize_checkpoint(tiny_model_factory(model_type, fused)[0], directory, BLOCK)
            cache[model_type, fused] = directory
        return cache[model_type, fused]

    return get


@pytest.mark.parametrize("model_type,fused", CASES)
@pytest.mark.parametrize("load_format", ["safetensors", "dummy"])
def test_each_rank_holds_its_share_of_fp8_weights_and_scales(fp8_dir, model_type, fused, load_format):
    directory = fp8_dir(model_type, fused)
    config = ModelConfig.from_hf_dir(directory)
    full = dict(build_model(config, directory, load_format, torch.device("cpu"), torch.float32, 3).named_parameters())
    scales = [name for name in full if name.endswith("_scale_inv")]
    assert scales and full[scales[0]].dtype == torch.float32
    for rank in range(2):
        layout = ShardLayout(config, rank, 2)
        shard = build_shard(layout, _Device(), directory, load_format, torch.float32, 3)
        for name, param in shard.named_parameters():
            assert param.dtype == full[name].dtype, name
            assert torch.equal(param.float(), layout.shard(name, full[name]).float()), name
        split = [n for n in scales if layout.pieces(n, tuple(full[n].shape)) is not None]
        assert split, "no scale tensor is split"
        for name in split:
            assert dict(shard.named_parameters())[name].numel() < full[name].numel(), name


def test_two_ranks_equal_one_process_with_fp8_weights(fp8_dir):
    directory = fp8_dir("qwen3_5_moe_text", True)
    ref_first, ref_second, ref_metrics = _run(LLM(str(directory), **ENGINE))
    llm = LLM(str(directory), tensor_parallel_size=2, **ENGINE)
    try:
        first, second, metrics = _run(llm)
        llm.engine.check_integrity()
    finally:
        llm.engine.runner.close()
    assert_same_outputs(first, ref_first)
    assert_same_outputs(second, ref_second)
    _, anchor = _prompts()
    assert sorted(o.num_cached_tokens for o in first) == [0] + [anchor] * 5
    assert metrics["checkpoint_hits"] == ref_metrics["checkpoint_hits"]


def test_splits_that_cut_fp8_blocks_are_refused(fp8_dir):
    config = ModelConfig.from_hf_dir(fp8_dir("qwen3_5_moe_text", False))
    check_shardable(config, 2)
    coarse = dataclasses.replace(config, quantization=dataclasses.replace(config.quantization, block=(32, 32)))
    with pytest.raises(ValueError, match="gives each rank 16 rows of the GDN key heads .* FP8 block's 32"):
        check_shardable(coarse, 2)
