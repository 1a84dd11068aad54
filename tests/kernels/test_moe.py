"""Routed experts against a dense per-token float64 definition and transformers' Qwen3NextExperts;
the routers' selection against transformers' routers.

The `gpu` tests at the end compare the Triton sigmoid router with the reference on fresh random
inputs, NaN-poisoned outputs; they run on the device `DEV` (the Triton interpreter runs them on CPU
tensors with DEV set to "cpu")."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from forkpoint.kernels.moe import fused_moe, fused_moe_relu2

FP32_REL_RMS = 1e-6
DEV = "cuda"


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


# ---------------------------------------------------------------- Nemotron-3's sigmoid router

def hf_router(num_experts, top_k, n_group, topk_group, renormalize, seed):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    config = NemotronHConfig(hidden_size=16, n_routed_experts=num_experts, num_experts_per_tok=top_k, n_group=n_group,
                             topk_group=topk_group, norm_topk_prob=renormalize, routed_scaling_factor=2.5)
    router = NemotronHTopkRouter(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(num_experts, generator=gen))
    return router, gen


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("num_experts,top_k,n_group,topk_group", [(128, 6, 1, 1), (8, 2, 2, 1), (64, 8, 8, 3)])
def test_sigmoid_grouped_topk_equals_transformers(num_experts, top_k, n_group, topk_group, renormalize):
    """fp32, bit for bit: the same ids in the same order, the same weights."""
    from forkpoint.kernels.moe import sigmoid_grouped_topk

    router, gen = hf_router(num_experts, top_k, n_group, topk_group, renormalize, seed=num_experts + top_k)
    x = torch.randn(40, 16, generator=gen)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = sigmoid_grouped_topk(logits, router.e_score_correction_bias, top_k, n_group, topk_group,
                                        renormalize, 2.5)
    assert weights.dtype == torch.float32 and ids.dtype == torch.long
    assert torch.equal(ids, hf_ids) and torch.equal(weights, hf_weights)


def test_sigmoid_grouped_topk_gives_ties_to_the_lowest_index():
    from forkpoint.kernels.moe import sigmoid_grouped_topk

    bias = torch.zeros(16)
    _, ids = sigmoid_grouped_topk(torch.zeros(3, 16), bias, 4, 1, 1, True, 1.0)
    assert torch.equal(ids.sort(-1)[0], torch.arange(4).expand(3, 4))
    logits = torch.zeros(2, 16)
    logits[:, [3, 9]] = 1.0  # groups 0 and 2 tie (best two: 1 and 0), ahead of 1 and 3; then experts 0, 1
    _, ids = sigmoid_grouped_topk(logits, bias, 4, 4, 2, True, 1.0)
    assert torch.equal(ids.sort(-1)[0], torch.tensor([[0, 1, 3, 9]] * 2))
    logits[1, 12:] = 1.0  # group 3 now best; group 0 wins the tie with group 2
    _, ids = sigmoid_grouped_topk(logits, bias, 5, 4, 2, False, 1.0)
    assert torch.equal(ids[1].sort()[0], torch.tensor([3, 12, 13, 14, 15]))


def test_sigmoid_grouped_topk_rejects_bad_configs():
    from forkpoint.kernels.moe import sigmoid_grouped_topk

    logits, bias = torch.zeros(2, 12), torch.zeros(12)
    with pytest.raises(ValueError, match="equal groups"):
        sigmoid_grouped_topk(logits, bias, 2, 5, 1, True, 1.0)
    with pytest.raises(ValueError, match="top_k <= topk_group"):
        sigmoid_grouped_topk(logits, bias, 4, 4, 1, True, 1.0)
    with pytest.raises(ValueError, match="topk_group <= n_group"):
        sigmoid_grouped_topk(logits, bias, 2, 2, 3, True, 1.0)
    with pytest.raises(ValueError, match="correction_bias"):
        sigmoid_grouped_topk(logits, bias[:6], 2, 1, 1, True, 1.0)


# ---------------------------------------------------------------- Triton sigmoid router (gpu)

ROUTER_CASES = [(1, 128, 6, 1, 1), (0, 128, 6, 1, 1), (333, 128, 6, 1, 1), (7, 256, 8, 8, 4), (5, 64, 4, 4, 1),
                (3, 8, 2, 2, 1), (9, 96, 6, 3, 2), (4, 48, 4, 2, 2), (6, 16, 16, 1, 1)]


def by_id(weights, ids):
    """Each row's (weights, ids) sorted by expert id: the ids' order within a row is unspecified."""
    ids_sorted, order = ids.sort(dim=-1)
    return weights.gather(1, order), ids_sorted


@pytest.mark.gpu
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("t,e,top_k,n_group,topk_group", ROUTER_CASES)
def test_triton_sigmoid_grouped_topk_matches_reference(poison, t, e, top_k, n_group, topk_group, renormalize, ties):
    """The same experts, the weights to fp32 rounding. `ties` draws logits and biases from a few
    values (no two distinct sums of them are within rounding of each other), so that choices and
    group scores tie and the lowest index must win in both: then the ids must be equal. With
    continuous logits a row may pick another expert only where two choices are within fp32
    rounding (sigmoid on the GPU and the CPU may differ in the last bit)."""
    from forkpoint.kernels.moe import reference
    from tests.kernels.test_gpu_fused_ops import FP32_TOL, check

    router = pytest.importorskip("forkpoint.kernels.moe.router")
    gen = torch.Generator(device=DEV).manual_seed(t + e + top_k + n_group + topk_group + ties)
    if ties:
        logits = torch.randint(0, 3, (t, e), generator=gen, device=DEV).float()
        bias = torch.randint(0, 2, (e,), generator=gen, device=DEV).float() * 0.25
    else:
        logits = 3 * torch.randn(t, e + 8, generator=gen, device=DEV)[:, 4:e + 4]  # a row-strided view
        bias = 0.1 * torch.randn(e, generator=gen, device=DEV)
    weights, ids = router.sigmoid_grouped_topk(logits, bias, top_k, n_group, topk_group, renormalize, 2.5)
    ref_w, ref_ids = reference.sigmoid_grouped_topk(logits.cpu(), bias.cpu(), top_k, n_group, topk_group,
                                                    renormalize, 2.5)
    assert weights.dtype == torch.float32 and ids.dtype == torch.long and ids.shape == (t, top_k)
    weights, ids = by_id(weights.cpu(), ids.cpu())
    ref_w, ref_ids = by_id(ref_w, ref_ids)
    same = (ids == ref_ids).all(dim=-1)
    if not ties and not same.all():
        choice = logits.cpu().sigmoid() + bias.cpu()
        near = (choice.gather(1, ids).sort(-1)[0] - choice.gather(1, ref_ids).sort(-1)[0]).abs().amax(-1) < 1e-6
        assert (same | near).all(), "an expert differs where the choices are not within rounding"
        weights, ref_w = weights[same], ref_w[same]
    else:
        assert torch.equal(ids, ref_ids)
    check(f"sigmoid_grouped_topk T={t} E={e} k={top_k} groups={n_group}/{topk_group} renorm={renormalize} "
          f"ties={ties}", weights, ref_w, FP32_TOL)


@pytest.mark.gpu
def test_triton_router_captures_in_a_cuda_graph(monkeypatch):
    """Nemotron-3-Nano's router (fp32 GEMM + the kernel), warmed up, then captured (no host sync);
    a replay on new inputs equals eager; the public function dispatches CUDA tensors to Triton."""
    pytest.importorskip("forkpoint.kernels.moe.router")
    from forkpoint.kernels import moe

    gen = torch.Generator(device=DEV).manual_seed(4)
    weight, bias = torch.randn(128, 2688, generator=gen, device=DEV), 0.1 * torch.randn(128, generator=gen, device=DEV)
    x = torch.randn(37, 2688, generator=gen, device=DEV).bfloat16()

    def run():
        logits = torch.nn.functional.linear(x.float(), weight)
        return moe.sigmoid_grouped_topk(logits, bias, 6, 1, 1, True, 2.5)

    with torch.inference_mode():
        run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a host sync here fails the capture
            captured = run()
        x.mul_(-1)
        graph.replay()
        for out, again in zip(captured, run()):
            assert torch.equal(out, again)
    module = pytest.importorskip("forkpoint.kernels.moe.router")
    monkeypatch.setattr(module, "sigmoid_grouped_topk", lambda *a, **k: "triton")
    assert moe.sigmoid_grouped_topk(torch.zeros(2, 128, device=DEV), bias, 6, 1, 1, True, 2.5) == "triton"
