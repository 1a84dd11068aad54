"""The MTP head (models/mtp.py): config.json's layer count, loading `mtp.*` as stored (per-expert and
fused experts, Qwen3-Next), dummy weights, the pools' extra attention layer, and one pass over a run
of tokens equal to the same tokens one at a time (its KV cache, float32 CPU)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from forkpoint.config import ModelConfig
from forkpoint.models.loader import build_model
from forkpoint.models.mtp import mtp_layer_count
from forkpoint.runner.model_runner import build_forward_batch
from forkpoint.step.plan import Segment, SegmentKind, StepPlan
from tests.tiny_models import add_mtp_weights

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=[("qwen3_5_text", False), ("qwen3_5_moe_text", True), ("qwen3_next", False),
                                        ("qwen3_5_moe", True)])
def mtp_dir(request, tiny_model_factory, tmp_path_factory):
    model_type, fused = request.param
    source, _ = tiny_model_factory(model_type, fused_experts=fused)
    directory = tmp_path_factory.mktemp(f"{model_type}_mtp")
    add_mtp_weights(source, directory)
    return directory


def test_the_layer_count_comes_from_config_json(mtp_dir, tiny_model_factory):
    assert mtp_layer_count(mtp_dir) == 1
    raw = json.loads((mtp_dir / "config.json").read_text())
    key = "num_nextn_predict_layers" if raw["model_type"] == "qwen3_next" else "mtp_num_hidden_layers"
    assert (raw.get("text_config") or raw)[key] == 1
    plain, _ = tiny_model_factory("qwen3_5_text")
    assert mtp_layer_count(plain) == 0


def test_mtp_weights_load_as_stored(mtp_dir):
    config = ModelConfig.from_hf_dir(mtp_dir)
    model = build_model(config, mtp_dir, "auto", CPU, torch.float32, 0, mtp_layers=1)
    stored = {name: tensor for name, tensor in load_file(str(mtp_dir / "model.safetensors")).items()
              if name.startswith("mtp.")}
    params = dict(model.named_parameters())
    for name in ("mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                 "mtp.norm.weight", "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.self_attn.o_proj.weight",
                 "mtp.layers.0.self_attn.q_norm.weight"):
        assert torch.equal(params[name], stored[name]), name
    experts = [name for name in stored if ".experts." in name]
    assert bool(experts) == (config.num_experts > 0)
    assert all(torch.isfinite(p).all() for p in model.mtp.parameters())  # nothing left at the loader's NaN
    shapes = model.pool_shapes(torch.float32)
    assert shapes.num_attention_layers == len(config.attention_layer_ids) + 1  # the head's KV, last


def test_plain_models_skip_the_mtp_weights_and_mtp_models_need_them(mtp_dir, tiny_model_factory):
    config = ModelConfig.from_hf_dir(mtp_dir)
    model = build_model(config, mtp_dir, "auto", CPU, torch.float32, 0)
    assert model.mtp is None
    assert model.pool_shapes(torch.float32).num_attention_layers == len(config.attention_layer_ids)
    if config.model_type != "qwen3_5_text":
        return
    plain, _ = tiny_model_factory("qwen3_5_text")
    with pytest.raises(ValueError, match="missing .* tensors, e.g. \\['mtp\\."):
        build_model(ModelConfig.from_hf_dir(plain), plain, "auto", CPU, torch.float32, 0, mtp_layers=1)


def test_dummy_weights_build_the_head(mtp_dir):
    config = ModelConfig.from_hf_dir(mtp_dir)
    model = build_model(config, None, "dummy", CPU, torch.float32, 0, mtp_layers=1)
    assert model.mtp is not None
    assert all(torch.isfinite(p).all() and p.abs().sum() > 0 for p in model.mtp.parameters())


def _segment(start: int, tokens: list[int], blocks: list[int], kind: SegmentKind) -> Segment:
    return Segment(request_id="r", start=start, end=start + len(tokens), token_ids=tuple(tokens), block_table=blocks,
                   initial_slot=0, dest_slots=(), kind=kind, phase=0, samples=True)


def _run(model, plan: StepPlan, previous: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
    batch, _ = build_forward_batch(plan, k_cache.shape[1], CPU)
    embeds, cos_sin = model.embed(batch.input_ids, batch.positions)
    return model.mtp(embeds, previous, cos_sin, batch, k_cache, v_cache)


@torch.inference_mode()
def test_one_pass_equals_token_by_token(mtp_dir):
    """The drafter's MTP pass (many tokens of a sequence at once) and its chain (one token a step over
    the head's KV cache) compute the same function."""
    config = ModelConfig.from_hf_dir(mtp_dir)
    model = build_model(config, mtp_dir, "auto", CPU, torch.float32, 0, mtp_layers=1)
    generator = torch.Generator().manual_seed(0)
    num_tokens, block_size, blocks = 21, 8, [3, 1, 2]
    tokens = torch.randint(5, 150, (num_tokens,), generator=generator).tolist()
    previous = torch.randn(num_tokens, config.hidden_size, generator=generator)
    shape = (4, block_size, config.num_key_value_heads, config.head_dim)
    caches = [torch.zeros(shape), torch.zeros(shape)]
    whole = _run(model, StepPlan((_segment(0, tokens, blocks, SegmentKind.PREFILL),)), previous, *caches)
    caches = [torch.zeros(shape), torch.zeros(shape)]
    steps = [_run(model, StepPlan((_segment(i, [tokens[i]], blocks, SegmentKind.DECODE),)), previous[i:i + 1],
                  *caches) for i in range(num_tokens)]
    torch.testing.assert_close(torch.cat(steps), whole, rtol=1e-5, atol=1e-5)
    # causal: a different last token changes only the last row
    changed = _run(model, StepPlan((_segment(0, tokens[:-1] + [tokens[-1] + 1], blocks, SegmentKind.PREFILL),)),
                   previous, torch.zeros(shape), torch.zeros(shape))
    torch.testing.assert_close(changed[:-1], whole[:-1], rtol=0, atol=0)
    assert not torch.allclose(changed[-1], whole[-1])
