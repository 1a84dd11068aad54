"""Routed experts against a dense per-token float64 definition and transformers' Qwen3NextExperts."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint.kernels.moe import fused_moe, fused_moe_relu2

FP32_REL_RMS = 1e-6


def rel_rms(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt().clamp_min(1e-30)).item()


def make_inputs(tokens, *, experts=8, top_k=2, hidden=16, inter=12, seed=0, hit=None):
    """Random weights and routes; ``hit`` restricts routing to those experts."""
    gen = torch.Generator().manual_seed(seed)
    pool = torch.tensor(hit if hit is not None else range(experts))
    choice = torch.rand(tokens, len(pool), generator=gen).argsort(dim=1)[:, :top_k]  # distinct per token
    return dict(
        x=torch.randn(tokens, hidden, generator=gen),
        gate_up=torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5,
        down=torch.randn(experts, hidden, inter, generator=gen) / inter**0.5,
        topk_weights=torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=1),
        topk_ids=pool[choice],
    )


def dense_moe(x, gate_up, down, topk_weights, topk_ids):
    """sum_j w_j * down_e (silu(gate_e x) * up_e x), token by token, float64."""
    inter = down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(topk_weights[t].double(), topk_ids[t].tolist()):
            gate, up = gate_up[e, :inter].double() @ x[t].double(), gate_up[e, inter:].double() @ x[t].double()
            out[t] += w * (down[e].double() @ (F.silu(gate) * up))
    return out


def test_matches_dense_definition():
    inputs = make_inputs(20)
    y = fused_moe(**inputs)
    assert y.shape == inputs["x"].shape and y.dtype == torch.float32 and not y.isnan().any()
    assert rel_rms(y, dense_moe(**inputs)) <= FP32_REL_RMS


def test_matches_transformers_experts_layout():
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextExperts

    inputs = make_inputs(11, seed=1)
    config = Qwen3NextConfig(num_experts=8, hidden_size=16, moe_intermediate_size=12, hidden_act="silu")
    experts = Qwen3NextExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.copy_(inputs["gate_up"])
        experts.down_proj.copy_(inputs["down"])
        y_hf = experts(inputs["x"], inputs["topk_ids"], inputs["topk_weights"])
    assert rel_rms(fused_moe(**inputs), y_hf) <= FP32_REL_RMS


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.integers(min_value=0, max_value=9),
    hit=st.lists(st.integers(min_value=0, max_value=7), min_size=2, max_size=8, unique=True),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_matches_dense_definition_when_few_experts_are_hit(tokens, hit, seed):
    inputs = make_inputs(tokens, hit=hit, seed=seed)
    y = fused_moe(**inputs)
    assert y.shape == (tokens, 16)
    if tokens:
        assert rel_rms(y, dense_moe(**inputs)) <= FP32_REL_RMS


def test_low_precision_returns_input_dtype():
    inputs = make_inputs(6, seed=2)
    low = {name: x.bfloat16() if x.is_floating_point() else x for name, x in inputs.items()}
    y = fused_moe(**low)
    assert y.dtype == torch.bfloat16 and rel_rms(y, dense_moe(**low)) <= 1e-2


def test_rejects_expert_ids_out_of_range():
    inputs = make_inputs(3, seed=3)
    inputs["topk_ids"][1, 0] = 8
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        fused_moe(**inputs)


def test_topk_softmax_is_the_routers_softmax_top_k():
    from forkpoint.kernels.moe import topk_softmax

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(9, 16, generator=gen)
    probs = torch.softmax(logits, -1)
    for renormalize in (True, False):
        weights, ids = topk_softmax(logits, 4, renormalize, torch.float64)
        expected_ids = probs.argsort(-1, descending=True)[:, :4]
        assert torch.equal(ids, expected_ids) and weights.dtype == torch.float64
        expected = probs.gather(1, expected_ids).double()
        if renormalize:
            expected = expected / expected.sum(-1, keepdim=True)
        assert torch.allclose(weights, expected, rtol=1e-6)
    with pytest.raises(ValueError, match="top_k"):
        topk_softmax(logits, 17, True, torch.float32)


def test_relu2_experts_match_dense_definition():
    """Nemotron's non-gated experts: sum_j w_j down_e relu(up_e x)^2, token by token in float64;
    experts that no token picks, and the residual added after the sum."""
    inputs = make_inputs(23, experts=8, top_k=3, hit=[0, 2, 3, 6])
    x, up, down = inputs["x"], inputs["gate_up"][:, :12], inputs["down"]
    weights, ids = inputs["topk_weights"], inputs["topk_ids"]
    expected = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].double(), ids[t].tolist()):
            expected[t] += w * (down[e].double() @ F.relu(up[e].double() @ x[t].double()).square())
    assert rel_rms(fused_moe_relu2(x, up, down, weights, ids), expected) < FP32_REL_RMS
    residual = torch.randn(x.shape, generator=torch.Generator().manual_seed(1))
    assert rel_rms(fused_moe_relu2(x, up, down, weights, ids, residual=residual), expected + residual) < FP32_REL_RMS
    with pytest.raises(ValueError, match=r"up \[E, I, Hd\]"):
        fused_moe_relu2(x, inputs["gate_up"], down, weights, ids)
