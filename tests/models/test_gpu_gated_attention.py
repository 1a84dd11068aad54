"""Qwen3.5's gated attention layer on CUDA (skipped without CUDA), at Qwen3.5-35B-A3B's attention
shapes (HQ 16, HKV 2, Dh 256, rotary_dim 64) in bf16:

- `project` gives bit for bit what the unfused GPU kernels gave (norm kernel on q, on k, rotary
  kernel on each: tests/kernels/test_gpu_attention_fusion.py checks the kernels themselves);
- the kernels each part launches, counted with the profiler: `project` one Triton kernel besides
  the GEMM (`_qk_norm_rotary_kernel`, where the unfused layer launched four norm / rotary kernels
  and a copy of the gate), `finish` one besides o_proj (`_sigmoid_gate_mul_kernel`, for a sigmoid
  and a product), and neither an ATen elementwise or copy kernel. Printed as GATED_ATTN_KERNELS.

    pytest -q -s tests/kernels/test_gpu_attention_fusion.py tests/models/test_gpu_gated_attention.py
"""

import dataclasses

import pytest
import torch

from forkpoint.config import ModelConfig
from forkpoint.models.layers import RotaryEmbedding
from forkpoint.models.qwen3_5 import GatedAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
SHAPES_35B = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=2, head_dim=256, rotary_dim=64)


@pytest.fixture(scope="module")
def config(moe_model):
    return dataclasses.replace(ModelConfig.from_hf_dir(moe_model[0]), **SHAPES_35B)


def attention_layer(config: ModelConfig) -> GatedAttention:
    layer = GatedAttention(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    layer = layer.to(DEV, torch.bfloat16)
    layer.stack_projections()
    return layer


def step_inputs(config: ModelConfig, tokens: int):
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, config.hidden_size, generator=gen).to(DEV, torch.bfloat16)
    rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.mrope_section)
    positions = torch.randint(0, 30000, (tokens,), generator=gen).to(DEV)
    return x, rotary.cos_sin(positions, torch.bfloat16)


@pytest.mark.parametrize("tokens", [1, 16, 333])
def test_project_equals_the_unfused_gpu_kernels(config, tokens):
    norms = pytest.importorskip("forkpoint.kernels.norms.triton")
    rotary = pytest.importorskip("forkpoint.kernels.rotary.triton")
    layer = attention_layer(config)
    x, (cos, sin) = step_inputs(config, tokens)
    hq, hkv, dh = layer.num_heads, layer.num_kv_heads, layer.head_dim
    with torch.inference_mode():
        q_gate, k, v = (t.clone() for t in layer.project_stacked(x))
        q, gate = q_gate.view(tokens, hq, 2 * dh).split(dh, dim=-1)
        q = rotary.apply_rotary(norms.rms_norm(q, layer.q_norm.weight, layer.q_norm.eps), cos, sin)
        k = rotary.apply_rotary(norms.rms_norm(k.view(tokens, hkv, dh), layer.k_norm.weight, layer.k_norm.eps),
                                cos, sin)
        p = layer.project(x, (cos, sin))
    for name, fused, unfused in (("q", p.q, q), ("k", p.k, k), ("gate", p.gate, gate),
                                 ("v", p.v, v.view(tokens, hkv, dh))):
        differ = (fused != unfused).sum().item()
        print(f"GATED_ATTN_UNFUSED_DIFF {name} T={tokens}: {differ} of {fused.numel()}")
        assert differ == 0, f"{name}: {differ} elements differ from the unfused GPU kernels"


def _kernels(fn) -> list[str]:
    """Names of the CUDA kernels `fn` launches (after a warm-up call that compiles them)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


@pytest.mark.parametrize("tokens", [1, 512])
def test_project_and_finish_launch_one_fused_kernel_each(config, tokens):
    pytest.importorskip("forkpoint.kernels.rotary.triton")
    layer = attention_layer(config)
    x, cos_sin = step_inputs(config, tokens)
    core = torch.randn(tokens, layer.num_heads, layer.head_dim, device=DEV).bfloat16()
    with torch.inference_mode():
        gate = layer.project(x, cos_sin).gate
        project = _kernels(lambda: layer.project(x, cos_sin))
        finish = _kernels(lambda: layer.finish(core, gate))
    print(f"GATED_ATTN_KERNELS T={tokens} project: {project}")
    print(f"GATED_ATTN_KERNELS T={tokens} finish: {finish}")
    for part, names, fused in (("project", project, "_qk_norm_rotary_kernel"),
                               ("finish", finish, "_sigmoid_gate_mul_kernel")):
        assert sum(fused in name for name in names) == 1, f"{part}: {fused} not launched once: {names}"
        aten = [name for name in names if "at::native" in name]
        assert not aten, f"{part} launches ATen elementwise / copy kernels: {aten}"
        # the rest is the GEMM (cuBLAS may split it into a kernel and a reduction)
        assert len(names) <= 3, f"{part}: {len(names)} kernels: {names}"
