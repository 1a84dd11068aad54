"""The Mamba2 hybrids (Nemotron-H, Granite-4.0-H, Falcon-H1) against transformers on tiny random
checkpoints saved with `save_pretrained` (float32, CPU; transformers' pure-torch Mamba2 path).
The oracle checks are those of tests/models/test_vs_transformers.py, run on these families."""

from __future__ import annotations

import json
import math

import pytest
import torch

from forkpoint import LLM, SamplingParams
from forkpoint.config import ModelConfig
from forkpoint.models.registry import model_class
from tests.models import test_vs_transformers as qwen_tests
from tests.tiny_models import MAMBA2_MODEL_TYPES, build_tiny_model


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
    assert llm.engine.runner.storage.ssm_stack.shape[0] == 3 and len(llm.engine.runner.storage.k) == 3


def test_unknown_types_and_inconsistent_architectures_are_clear_errors(tiny_model_factory):
    directory, _ = tiny_model_factory("granitemoehybrid")
    raw = json.loads((directory / "config.json").read_text())
    with pytest.raises(ValueError, match="unsupported model_type 'mamba'.*nemotron_h"):
        ModelConfig.from_dict(raw | {"model_type": "mamba"})
    with pytest.raises(ValueError, match="architecture 'NemotronHForCausalLM'"):
        model_class(ModelConfig.from_dict(raw | {"architectures": ["NemotronHForCausalLM"]}))
    with pytest.raises(ValueError, match="mamba_n_heads"):
        ModelConfig.from_dict(raw | {"mamba_d_head": 12})


# config.json of nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 (the entries forkpoint reads)
NEMOTRON_3_NANO = {
    "architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "vocab_size": 131072, "hidden_size": 2688,
    "num_hidden_layers": 52, "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_attention_heads": 32, "num_key_value_heads": 2, "head_dim": 128, "attention_bias": False,
    "intermediate_size": 1856, "mlp_hidden_act": "relu2", "mlp_bias": False, "mamba_num_heads": 64,
    "mamba_head_dim": 64, "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "chunk_size": 128,
    "use_conv_bias": True, "mamba_proj_bias": False, "mamba_hidden_act": "silu", "time_step_min": 0.001,
    "time_step_limit": [0.0, 1e30], "n_routed_experts": 128, "num_experts_per_tok": 6, "moe_intermediate_size": 1856,
    "n_shared_experts": 1, "moe_shared_expert_intermediate_size": 3712, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1, "layer_norm_epsilon": 1e-5,
    "max_position_embeddings": 262144, "tie_word_embeddings": False, "eos_token_id": 2,
}


def test_published_nemotron_3_nano_config_parses_to_its_layer_counts_and_state_sizes():
    config = ModelConfig.from_dict(NEMOTRON_3_NANO)
    kinds = config.layer_types
    assert (kinds.count("mamba2"), kinds.count("moe"), kinds.count("full_attention")) == (23, 23, 6)
    assert config.num_experts == 128 and config.mamba2.routed_scaling_factor == 2.5 and config.rotary_dim == 0
    with torch.device("meta"):
        shapes = model_class(config)(config).pool_shapes(torch.bfloat16)
    assert shapes.state.conv_shape == (64 * 64 + 2 * 8 * 128, 3) and shapes.state.ssm_shape == (64, 64, 128)
    assert shapes.state.bytes == 6144 * 3 * 2 + 64 * 64 * 128 * 4  # 2.04 MiB per layer and sequence


def test_dummy_weights_generate_finite_outputs(tiny_model_factory):
    directory, _ = tiny_model_factory("nemotron_h")
    llm = LLM(str(directory), load_format="dummy", num_kv_blocks=32, max_num_seqs=2)
    out = llm.generate({"prompt_token_ids": list(range(5, 40))},
                       SamplingParams(temperature=0.0, max_tokens=3, logprobs=2, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 3
    assert all(math.isfinite(v) for step in out.outputs[0].logprobs for v in step.values())


VARIANTS = {
    "granite_dense_nope_tied": ("granitemoehybrid", {"num_local_experts": 0, "position_embedding_type": "nope",
                                                     "tie_word_embeddings": True}),
    "falcon_plain_gate_biases": ("falcon_h1", {"mamba_rms_norm": False, "attention_bias": True, "mlp_bias": True,
                                               "mamba_proj_bias": True, "projectors_bias": True,
                                               "mamba_conv_bias": False, "tie_word_embeddings": True}),
    "falcon_norm_before_gate_dt_limits": ("falcon_h1", {"mamba_norm_before_gate": True,
                                                        "time_step_limit": (0.3, 2.0)}),
    "nemotron_latent_moe": ("nemotron_h", {"moe_latent_size": 24}),
    # transformers never ties Nemotron-H's lm_head, whatever tie_word_embeddings says
    "nemotron_groups_biases_tied": ("nemotron_h", {"n_group": 4, "topk_group": 2, "norm_topk_prob": False,
                                                   "use_bias": True, "mlp_bias": True, "tie_word_embeddings": True,
                                                   "time_step_min": 0.5}),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_config_variants_match_transformers(tmp_path, variant):
    model_type, overrides = VARIANTS[variant]
    hf_model = build_tiny_model(tmp_path, model_type, **overrides)
    llm = LLM(str(tmp_path), num_kv_blocks=64, max_num_seqs=2)
    token_ids = torch.randint(5, 150, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    ours, ref = qwen_tests.full_logits(llm, token_ids), qwen_tests.hf_logits(hf_model, token_ids)
    assert (ours - ref).norm() / ref.norm() <= 1e-4


def test_nemotron_router_stays_float32_in_a_bf16_model_as_in_transformers(tiny_model_factory):
    """transformers keeps Nemotron-H's router weight and score-correction bias in float32 whatever the
    model dtype (`_keep_in_fp32_modules_strict`): the routing of a bf16 model must be transformers'
    bf16 routing, the same experts and (fp32) weights, not that of router parameters rounded to bf16."""
    from transformers import NemotronHForCausalLM

    directory, _ = tiny_model_factory("nemotron_h")
    ours = LLM(str(directory), device="cpu", dtype="bfloat16", num_kv_blocks=8, max_num_seqs=1).engine.runner.model
    theirs = NemotronHForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    x = torch.randn(512, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for layer in (1, 5):  # the MoE blocks
        gate = ours.model.layers[layer].mixer.gate
        assert ours.model.layers[layer].mixer.experts.up_proj.dtype == torch.bfloat16
        assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
        weights, ids = gate(x)
        _, ref_weights, ref_ids = theirs.model.layers[layer].mixer.gate(x)
        ids, order = ids.sort(dim=-1)
        ref_ids, ref_order = ref_ids.sort(dim=-1)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(weights.gather(1, order), ref_weights.gather(1, ref_order), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("model_type", ["nemotron_h", "falcon_h1"])
def test_mixer_projection_into_a_static_buffer_is_the_same_gemm(tiny_model_factory, model_type):
    """Mamba2Mixer.project(x, stacked_out=buf) writes the in_proj GEMM into buf, xbc and z being
    views of it (what lets the piecewise forward skip their copies), with results equal to the plain
    call and to the multipliers applied as transformers does (Falcon-H1: a torch.cat of scaled parts)."""
    from forkpoint.kernels.ssd import reference as ssd_ref
    from forkpoint.models.mamba2 import Mamba2Mixer

    directory, _ = tiny_model_factory(model_type)
    config = ModelConfig.from_hf_dir(directory)
    torch.manual_seed(0)
    mixer = Mamba2Mixer(config)
    torch.nn.init.normal_(mixer.dt_bias)
    x = torch.randn(7, config.hidden_size)
    m = mixer.m
    parts = mixer.in_proj(x * m.in_multiplier).split((m.intermediate_size, m.intermediate_size,
                                                      m.n_groups * m.state_size, m.n_groups * m.state_size,
                                                      m.num_heads), dim=-1)
    z, xbc, dt = torch.cat([p * mult for p, mult in zip(parts, m.proj_multipliers)], dim=-1).split(
        [m.intermediate_size, m.conv_dim, m.num_heads], dim=-1)
    expected = (xbc, z, ssd_ref.softplus_dt(dt, mixer.dt_bias, m.dt_min, m.dt_max))
    buf = torch.full((7, mixer.projection_width()), float("nan"))
    with torch.inference_mode():  # as the engine runs it (mm(out=) takes no autograd)
        for got in (mixer.project(x), mixer.project(x, stacked_out=buf)):
            assert all(torch.equal(a, b) for a, b in zip(got, expected))
        static = mixer.project(x, stacked_out=buf)
        with pytest.raises(ValueError, match="stacked_out must be a contiguous"):
            mixer.project(x, stacked_out=buf[:, 1:])
    assert all(torch.equal(a, b) for a, b in zip(mixer.project(x), expected))  # grad mode: no in-place error
    assert {t.untyped_storage().data_ptr() for t in (static.xbc, static.z)} == {buf.untyped_storage().data_ptr()}
    assert (model_type == "falcon_h1") == any(mult != 1.0 for mult in m.proj_multipliers)
