"""Block-wise FP8 checkpoints (Qwen's release layout, tests/models/fp8_checkpoints.py) on CPU.

Each supported family's tiny model is quantised with the test's own quantiser and loaded; its logits at
every prompt position must equal those of the same weights dequantised to float32 and loaded as a plain
checkpoint (the CPU path dequantises, then runs the float32 op), within float32 rounding. Blocks:
non-square (16 x 32), and 48 x 32 on the fused experts, where the stacked projections' rows do not fill
their blocks (zero rows pad them; the outputs skip them). Plus: checkpoints on vs off give the same
greedy tokens and logprobs; dummy FP8 weights; every unsupported quantisation config is a ValueError
naming its field.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from forkpoint import LLM, SamplingParams
from tests.helpers import assert_same_outputs
from tests.models.fp8_checkpoints import dequantized_copy, quantize_checkpoint
from tests.models.test_vs_transformers import full_logits

FP8 = torch.float8_e4m3fn
CASES = [("qwen3_5_moe_text", False, (16, 32)), ("qwen3_5_moe_text", True, (48, 32)),
         ("qwen3_5_text", False, (16, 32)), ("qwen3_next", False, (16, 16)), ("qwen3_5_moe", True, (16, 32))]
ENGINE = dict(num_kv_blocks=64, max_num_seqs=8)


@pytest.fixture(scope="module")
def fp8_dirs(tiny_model_factory, tmp_path_factory):
    """(model_type, fused, block) -> (FP8 directory, its dequantised copy), built once per module."""
    cache = {}

    def build(model_type, fused, block):
        key = (model_type, fused, block)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"fp8_{model_type}")
            quantize_checkpoint(tiny_model_factory(model_type, fused)[0], root / "fp8", block)
            dequantized_copy(root / "fp8", root / "dequantized")
            cache[key] = (root / "fp8", root / "dequantized")
        return cache[key]

    return build


@pytest.mark.parametrize("model_type,fused,block", CASES)
def test_fp8_logits_equal_the_dequantised_model(fp8_dirs, model_type, fused, block):
    fp8_dir, plain_dir = fp8_dirs(model_type, fused, block)
    fp8 = LLM(str(fp8_dir), **ENGINE)
    model = fp8.engine.runner.model
    layers = model.model.layers
    gdn, attention = layers[0].linear_attn, layers[2].self_attn
    assert gdn.in_proj_qkv.weight.dtype == FP8 and gdn.in_proj_z.weight.dtype == FP8
    assert gdn.in_proj_b.weight.dtype == torch.float32 and attention.o_proj.weight.dtype == FP8
    assert model.lm_head.weight.dtype == torch.float32
    if model_type != "qwen3_5_text":
        assert layers[0].mlp.experts.gate_up_proj.dtype == FP8 and layers[0].mlp.gate.weight.dtype == torch.float32
    token_ids = torch.randint(5, 150, (83,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = full_logits(fp8, token_ids)
    theirs = full_logits(LLM(str(plain_dir), **ENGINE), token_ids)
    assert ((ours - theirs).norm() / theirs.norm()).item() < 1e-6
    assert (ours - theirs).abs().max().item() < 2e-5


def test_fp8_router_and_gates_stack_with_partial_blocks(tiny_model_factory, tmp_path):
    """A checkpoint that also quantises the router (4 rows) and the shared expert's gate (1 row): the MoE's
    whole stack is one FP8 GEMM whose projections are padded to whole 16-row blocks; logits still equal
    the dequantised model's."""
    quantize_checkpoint(tiny_model_factory("qwen3_5_moe_text")[0], tmp_path / "fp8", (16, 32),
                        kept=("in_proj_a.weight", "in_proj_b.weight"))
    dequantized_copy(tmp_path / "fp8", tmp_path / "dequantized")
    fp8 = LLM(str(tmp_path / "fp8"), **ENGINE)
    moe = fp8.engine.runner.model.model.layers[0].mlp
    assert moe.gate.weight.dtype == FP8 and moe.shared_expert_gate.weight.dtype == FP8
    assert moe.stacked_width() == 88  # 32 + 32 + 4 (padded to 16) + 1, to a multiple of 8
    token_ids = torch.randint(5, 150, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    ours = full_logits(fp8, token_ids)
    theirs = full_logits(LLM(str(tmp_path / "dequantized"), **ENGINE), token_ids)
    assert (ours - theirs).abs().max().item() < 2e-5


def test_qwen3_next_grouped_blocks_that_do_not_align_are_refused(tiny_model_factory, tmp_path):
    quantize_checkpoint(tiny_model_factory("qwen3_next")[0], tmp_path / "fp8", (16, 16), kept=("mlp.gate.weight",))
    with pytest.raises(ValueError, match=r"in_proj_ba of this Qwen3-Next checkpoint is FP8 with 16-row blocks"):
        LLM(str(tmp_path / "fp8"), **ENGINE)


def test_dummy_weights_honour_modules_to_not_convert(moe_model, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(moe_model[0], directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [16, 16],
                                     "modules_to_not_convert": ["linear_attn", "*.o_proj"]}
    (directory / "config.json").write_text(json.dumps(config))
    layers = LLM(str(directory), load_format="dummy", **ENGINE).engine.runner.model.model.layers
    assert layers[0].linear_attn.in_proj_qkv.weight.dtype == torch.float32
    assert layers[2].self_attn.o_proj.weight.dtype == torch.float32
    assert layers[2].self_attn.q_proj.weight.dtype == FP8 and layers[0].mlp.experts.down_proj.dtype == FP8


def test_fp8_checkpoints_on_equal_off(fp8_dirs):
    fp8_dir, _ = fp8_dirs("qwen3_5_moe_text", True, (48, 32))
    anchor = torch.randint(5, 150, (70,), generator=torch.Generator().manual_seed(2)).tolist()
    prompts = [{"prompt_token_ids": anchor + [5 + i, 9, 11 + i], "checkpoint_positions": [len(anchor)]}
               for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=3)
    on = LLM(str(fp8_dir), auto_checkpoints=False, **ENGINE)
    outs = on.generate(prompts, params, use_tqdm=False)
    plain = [{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts]
    refs = LLM(str(fp8_dir), enable_checkpoints=False, **ENGINE).generate(plain, params, use_tqdm=False)
    assert outs[-1].num_cached_tokens == len(anchor)
    assert_same_outputs(outs, refs, tol=1e-5)
    on.engine.check_integrity()


def test_dummy_fp8_weights_from_a_bf16_config_are_seeded(moe_model):
    llm = LLM(str(moe_model[0]), load_format="dummy", quantization="fp8", **ENGINE)
    model = llm.engine.runner.model
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == FP8 and experts.weight_block == (128, 128)
    assert experts.gate_up_proj_scale_inv.shape == (4, 1, 1)
    assert model.model.layers[0].linear_attn.in_proj_qkv.weight.dtype == FP8
    assert model.model.layers[0].mlp.gate.weight.dtype == torch.float32
    again = LLM(str(moe_model[0]), load_format="dummy", quantization="fp8", **ENGINE).engine.runner.model
    for (name, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a.float(), b.float()), name
        assert torch.isfinite(a.float()).all(), name
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=3),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_dummy_weights_follow_the_config_quantization(fp8_dirs):
    fp8_dir, _ = fp8_dirs("qwen3_5_moe_text", False, (16, 32))
    model = LLM(str(fp8_dir), load_format="dummy", **ENGINE).engine.runner.model
    qkv = model.model.layers[0].linear_attn.in_proj_qkv
    assert qkv.weight.dtype == FP8 and qkv.weight_block == (16, 32)


def edit_quantization(directory, **changes):
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"].update(changes)
    (directory / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("changes,message", [
    (dict(quant_method="awq"), "quantization_config.quant_method 'awq' is not supported"),
    (dict(fmt="e5m2"), "quantization_config.fmt 'e5m2' is not supported"),
    (dict(activation_scheme="static"), "quantization_config.activation_scheme 'static' is not supported"),
    (dict(weight_block_size=None), "quantization_config.weight_block_size is missing"),
    (dict(weight_block_size=[128]), "quantization_config.weight_block_size must be two positive integers"),
    (dict(kv_cache_scheme={"num_bits": 8}), "quantization_config.kv_cache_scheme is not supported"),
])
def test_unsupported_quantization_configs_name_the_field(fp8_dirs, tmp_path, changes, message):
    directory = tmp_path / "model"
    shutil.copytree(fp8_dirs("qwen3_5_moe_text", False, (16, 32))[0], directory)
    edit_quantization(directory, **changes)
    with pytest.raises(ValueError, match=message):
        LLM(str(directory), **ENGINE)


def test_engine_options_and_mismatched_checkpoints_are_clear_errors(fp8_dirs, moe_model, tmp_path):
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported"):
        LLM(str(moe_model[0]), kv_cache_dtype="fp8", **ENGINE)
    with pytest.raises(ValueError, match="quantization must be None .* or 'fp8', got 'awq'"):
        LLM(str(moe_model[0]), quantization="awq", **ENGINE)
    with pytest.raises(ValueError, match="quantising bf16 weights at load time is not supported"):
        LLM(str(moe_model[0]), quantization="fp8", **ENGINE)
    fp8_dir = fp8_dirs("qwen3_5_moe_text", False, (16, 32))[0]
    no_config = tmp_path / "no_config"
    shutil.copytree(fp8_dir, no_config)
    config = json.loads((no_config / "config.json").read_text())
    del config["quantization_config"]
    (no_config / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="has FP8 scales .* but config.json has no quantization_config"):
        LLM(str(no_config), **ENGINE)
    no_scale = tmp_path / "no_scale"
    shutil.copytree(fp8_dir, no_scale)
    tensors = load_file(str(no_scale / "model.safetensors"))
    del tensors["model.layers.0.linear_attn.in_proj_z.weight_scale_inv"]
    save_file(tensors, str(no_scale / "model.safetensors"))
    with pytest.raises(ValueError, match="in_proj_z.weight is torch.float8_e4m3fn in the checkpoint but the model "
                                         "holds it as torch.float32"):
        LLM(str(no_scale), **ENGINE)


def test_fp8_mamba2_checkpoints_are_refused(tiny_model_factory, tmp_path):
    directory = tmp_path / "nemotron"
    shutil.copytree(tiny_model_factory("nemotron_h")[0], directory)
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="FP8 checkpoints of nemotron_h are not supported"):
        LLM(str(directory), **ENGINE)
