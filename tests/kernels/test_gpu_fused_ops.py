"""Fused elementwise kernels (Triton) against their plain-PyTorch references (skipped without CUDA).

Ops: norms (rms_norm with and without the fused residual add, gated_rms_norm), activation
(silu_and_mul), gating (gdn_gating) and the grouped MoE's combine. Fresh seeded random inputs in
bf16 and fp32, shapes with T = 0, 1 and odd T, strided views as the model passes them; outputs are
NaN-poisoned (the `poison` fixture, tests/kernels/conftest.py) and must be fully written.

The references run on CPU copies of the same inputs. Both sides compute in fp32 and round at the
same points, so they differ only by fp32 evaluation order (sums, exp/sqrt approximations), which
may flip the last bit of a bf16 output now and then. Tolerances, relative RMS in fp64:
FP32_TOL = 1e-5, BF16_TOL = 4e-3 (one bf16 ulp is 2^-8 = 3.9e-3 relative, so this still fails on
any systematic error); the residual sum `s` of the fused add must match exactly (one fp32 add, one
rounding, as torch). Each measured error is printed (`pytest -s` shows them).
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
EPS = 1e-6
FP32_TOL, BF16_TOL = 1e-5, 4e-3
DTYPES = [torch.bfloat16, torch.float32]


def tol(dtype: torch.dtype) -> float:
    return FP32_TOL if dtype == torch.float32 else BF16_TOL


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        f"{name}: {tuple(out.shape)} {out.dtype} != {tuple(ref.shape)} {ref.dtype}")
    assert not torch.isnan(out).any(), f"{name}: NaN left in the output (an element was never written)"
    if ref.numel() == 0:
        return
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    err = ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()
    print(f"REL_RMS {name} = {err:.3e} (tol {tolerance:.0e})")
    assert err < tolerance, f"{name}: relative RMS error {err:.3e} >= {tolerance:.0e}"


def randn(gen, *shape, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen, device=DEV)).to(dtype)


# ---------------------------------------------------------------- norms

# [T, hidden] rows, q/k heads [T, heads, Dh], long rows (one row per program), non-power-of-2 D
NORM_SHAPES = [(1, 2048), (7, 2048), (0, 2048), (257, 2048), (3, 8192), (5, 8192 + 64), (33, 300),
               (1, 16, 256), (9, 2, 256), (7, 4, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", NORM_SHAPES)
def test_rms_norm_matches_reference(poison, dtype, shape):
    tri = pytest.importorskip("forkpoint.kernels.norms.triton")
    from forkpoint.kernels.norms import reference

    gen = torch.Generator(device=DEV).manual_seed(sum(shape))
    x = randn(gen, *shape, dtype=dtype, scale=3.0)
    residual = randn(gen, *shape, dtype=dtype, scale=3.0)
    weight = randn(gen, shape[-1], dtype=dtype, scale=0.2)
    check(f"rms_norm {dtype} {shape}", tri.rms_norm(x, weight, EPS),
          reference.rms_norm(x.cpu(), weight.cpu(), EPS), tol(dtype))
    y, s = tri.rms_norm(x, weight, EPS, residual)
    y_ref, s_ref = reference.rms_norm(x.cpu(), weight.cpu(), EPS, residual.cpu())
    check(f"rms_norm+residual {dtype} {shape}", y, y_ref, tol(dtype))
    assert not torch.isnan(s).any() and torch.equal(s.cpu(), s_ref), "the residual sum must equal residual + x exactly"
    # fp32 weights with bf16 activations (weights kept in fp32): read as they are
    check(f"rms_norm fp32 weight {dtype} {shape}", tri.rms_norm(x, weight.float(), EPS),
          reference.rms_norm(x.cpu(), weight.float().cpu(), EPS), tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 7, 130])
def test_rms_norm_strided_views(poison, dtype, tokens):
    """q of the interleaved q/gate projection ([T, heads, Dh], row stride 2*Dh), a residual that is a
    view too, and a transposed input (last dim not contiguous: copied first)."""
    tri = pytest.importorskip("forkpoint.kernels.norms.triton")
    from forkpoint.kernels.norms import reference

    gen = torch.Generator(device=DEV).manual_seed(tokens)
    heads, dh = 16, 256
    q_gate = randn(gen, tokens, heads, 2 * dh, dtype=dtype, scale=3.0)
    q = q_gate.split(dh, dim=-1)[0]
    res = randn(gen, tokens, heads, 2 * dh, dtype=dtype)[..., dh:]
    weight = randn(gen, dh, dtype=dtype, scale=0.2)
    check(f"rms_norm strided q {dtype} T={tokens}", tri.rms_norm(q, weight, EPS),
          reference.rms_norm(q.cpu(), weight.cpu(), EPS), tol(dtype))
    y, s = tri.rms_norm(q, weight, EPS, res)
    y_ref, s_ref = reference.rms_norm(q.cpu(), weight.cpu(), EPS, res.cpu())
    check(f"rms_norm strided q+residual {dtype} T={tokens}", y, y_ref, tol(dtype))
    assert torch.equal(s.cpu(), s_ref)
    xt = randn(gen, 2048, tokens, dtype=dtype).T
    w2 = randn(gen, 2048, dtype=dtype, scale=0.2)
    check(f"rms_norm transposed {dtype} T={tokens}", tri.rms_norm(xt, w2, EPS),
          reference.rms_norm(xt.cpu(), w2.cpu(), EPS), tol(dtype))


@pytest.mark.parametrize("weight_fp32", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 32, 128), (7, 32, 128), (0, 32, 128), (129, 16, 256), (5, 300)])
def test_gated_rms_norm_matches_reference(poison, dtype, shape, weight_fp32):
    tri = pytest.importorskip("forkpoint.kernels.norms.triton")
    from forkpoint.kernels.norms import reference

    gen = torch.Generator(device=DEV).manual_seed(sum(shape) + weight_fp32)
    x = randn(gen, *shape, dtype=dtype, scale=3.0)
    # the gate as a view: the second half of a wider projection
    gate = randn(gen, *shape[:-1], 2 * shape[-1], dtype=dtype, scale=2.0)[..., shape[-1]:]
    weight = (1.0 + 0.2 * torch.randn(shape[-1], generator=gen, device=DEV))
    weight = weight if weight_fp32 else weight.to(dtype)
    check(f"gated_rms_norm {dtype} {shape} w32={weight_fp32}", tri.gated_rms_norm(x, gate, weight, EPS),
          reference.gated_rms_norm(x.cpu(), gate.cpu(), weight.cpu(), EPS), tol(dtype))


# ---------------------------------------------------------------- activation

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 512), (7, 512), (0, 512), (1000, 512), (9, 5120 + 8), (3, 5, 40)])
def test_silu_and_mul_matches_reference(poison, dtype, shape):
    tri = pytest.importorskip("forkpoint.kernels.activation.triton")
    from forkpoint.kernels.activation import reference

    gen = torch.Generator(device=DEV).manual_seed(sum(shape))
    h = randn(gen, *shape[:-1], 2 * shape[-1], dtype=dtype, scale=3.0)
    gate, up = h.chunk(2, dim=-1)  # strided halves, as the grouped MoE passes them
    out = tri.silu_and_mul(gate, up)
    assert out.is_contiguous()
    check(f"silu_and_mul chunked {dtype} {shape}", out, reference.silu_and_mul(gate.cpu(), up.cpu()), tol(dtype))
    g2, u2 = gate.contiguous(), up.contiguous()
    check(f"silu_and_mul contiguous {dtype} {shape}", tri.silu_and_mul(g2, u2),
          reference.silu_and_mul(g2.cpu(), u2.cpu()), tol(dtype))


# ---------------------------------------------------------------- gating

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,heads", [(1, 32), (7, 32), (0, 32), (513, 32), (5, 48), (3, 6)])
def test_gdn_gating_matches_reference(poison, dtype, tokens, heads):
    tri = pytest.importorskip("forkpoint.kernels.gating.triton")
    from forkpoint.kernels.gating import reference

    gen = torch.Generator(device=DEV).manual_seed(tokens * 100 + heads)
    ba = randn(gen, tokens, 2 * heads, dtype=dtype, scale=6.0)  # both softplus regimes, and the > 20 cut-off:
    if tokens:
        ba[0, heads] = 30.0
        ba[0, heads + 1] = -30.0
    b, a = ba[:, :heads], ba[:, heads:]  # views of one fused projection
    A_log = randn(gen, heads, dtype=dtype)
    dt_bias = randn(gen, heads, dtype=dtype)
    g, beta = tri.gdn_gating(a, b, A_log, dt_bias)
    g_ref, beta_ref = reference.gdn_gating(a.cpu(), b.cpu(), A_log.cpu(), dt_bias.cpu())
    check(f"gdn_gating g {dtype} T={tokens} HV={heads}", g, g_ref, FP32_TOL)  # g is fp32 for every input dtype
    check(f"gdn_gating beta {dtype} T={tokens} HV={heads}", beta, beta_ref, tol(dtype))
    if tokens:  # elementwise too: softplus' far tails (tiny g) are not lost in the RMS
        assert torch.allclose(g.cpu(), g_ref, rtol=1e-4, atol=0.0)


# ---------------------------------------------------------------- MoE combine

def _combine_torch(ys, order, topk_weights):
    """The grouped MoE's combine before the Triton kernel: back to route order, weighted fp32 sum."""
    num_tokens, top_k = topk_weights.shape
    y_routes = torch.zeros_like(ys).index_copy_(0, order, ys)
    summed = (y_routes.view(num_tokens, top_k, ys.shape[1]).float() * topk_weights.float()[..., None]).sum(dim=1)
    return summed.to(ys.dtype)


@pytest.mark.parametrize("t,e,top_k,hidden", [(1, 256, 8, 2048), (7, 16, 4, 96), (0, 8, 2, 64), (333, 64, 8, 1030)])
def test_moe_combine_matches_torch(poison, t, e, top_k, hidden):
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    gen = torch.Generator(device=DEV).manual_seed(t + e)
    ids = torch.rand(t, e, generator=gen, device=DEV).argsort(dim=1)[:, :top_k]
    weights = torch.rand(t, top_k, generator=gen, device=DEV).softmax(-1).bfloat16()
    order = ids.flatten().argsort(stable=True)
    ys = randn(gen, t * top_k, hidden, dtype=torch.bfloat16)
    check(f"moe_combine T={t} E={e} k={top_k} Hd={hidden}", grouped.moe_combine(ys, order, weights),
          _combine_torch(ys, order, weights), BF16_TOL)
    # the shared expert and the residual in the same fp32 sum (residual as a strided view)
    shared = randn(gen, t, hidden, dtype=torch.bfloat16)
    shared_gate = randn(gen, t, 1, dtype=torch.bfloat16)
    residual = randn(gen, t, hidden + 8, dtype=torch.bfloat16)[:, :hidden]
    routed = _combine_torch(ys, order, weights).float()
    expected = (routed + torch.sigmoid(shared_gate.float()) * shared.float() + residual.float()).bfloat16()
    check(f"moe_combine+shared+residual T={t}", grouped.moe_combine(ys, order, weights, shared=shared,
          shared_gate=shared_gate, residual=residual), expected, BF16_TOL)


# ---------------------------------------------------------------- MoE router selection

@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,e,top_k", [(1, 256, 8), (0, 256, 8), (333, 256, 8), (7, 60, 4), (5, 8, 2), (3, 4, 4)])
def test_topk_softmax_matches_reference(poison, dtype, renormalize, t, e, top_k):
    """Same probabilities selected (an id may differ only where the probabilities tie: bf16 logits
    of 256 experts often do; the kernel gives the tie to the lower index), weights to rounding."""
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    from forkpoint.kernels.moe import reference

    gen = torch.Generator(device=DEV).manual_seed(t + e + top_k)
    logits = randn(gen, t, e, dtype=dtype, scale=3.0)
    weights, ids = grouped.topk_softmax(logits, top_k, renormalize, dtype)
    ref_w, ref_ids = reference.topk_softmax(logits, top_k, renormalize, dtype)
    assert ids.dtype == torch.long and ids.shape == ref_ids.shape
    probs = torch.softmax(logits, -1, dtype=torch.float32)
    assert ((ids == ref_ids) | (probs.gather(1, ids) == probs.gather(1, ref_ids))).all()
    assert ((ids >= 0) & (ids < e)).all()
    check(f"topk_softmax T={t} E={e} k={top_k} renorm={renormalize}", weights, ref_w, tol(dtype))


# ---------------------------------------------------------------- dispatch and host syncs

@pytest.mark.parametrize(
    "op,fn,nargs",
    [("norms", "rms_norm", 3), ("norms", "gated_rms_norm", 4), ("activation", "silu_and_mul", 2),
     ("activation", "sigmoid_gate_mul", 2), ("rotary", "qk_norm_rotary_", 7), ("gating", "gdn_gating", 4)],
)
def test_dispatch_sends_cuda_tensors_to_triton(monkeypatch, op, fn, nargs):
    import importlib

    module = pytest.importorskip(f"forkpoint.kernels.{op}.triton")
    public = importlib.import_module(f"forkpoint.kernels.{op}")
    monkeypatch.setattr(module, fn, lambda *a, **k: "triton")
    assert getattr(public, fn)(*[torch.zeros(1, device=DEV)] * nargs) == "triton"


def test_layers_run_the_kernels_without_host_sync():
    """The model's blocks on CUDA (RMSNorm with and without residual, q-norm on a strided view,
    GatedRMSNorm, DenseMLP) and the gating, after a warm-up that compiles the kernels: no sync.
    (The grouped MoE, combine included, is covered by test_paged_attention_and_moe_no_host_sync.)"""
    pytest.importorskip("forkpoint.kernels.norms.triton")
    from forkpoint.kernels.gating import gdn_gating
    from forkpoint.models.layers import DenseMLP, GatedRMSNorm, RMSNorm

    gen = torch.Generator(device=DEV).manual_seed(12)
    x = randn(gen, 37, 256, dtype=torch.bfloat16)
    res = randn(gen, 37, 256, dtype=torch.bfloat16)
    q = randn(gen, 37, 4, 2 * 64, dtype=torch.bfloat16).split(64, dim=-1)[0]
    core, z = randn(gen, 37, 4, 64, dtype=torch.bfloat16), randn(gen, 37, 4, 64, dtype=torch.bfloat16)
    ab = randn(gen, 37, 16, dtype=torch.bfloat16)
    norm = RMSNorm(256, EPS).to(DEV, torch.bfloat16)
    q_norm = RMSNorm(64, EPS).to(DEV, torch.bfloat16)
    gated = GatedRMSNorm(64, EPS).to(DEV, torch.bfloat16)
    mlp = DenseMLP(256, 512).to(DEV, torch.bfloat16)
    mlp.stack_projections()  # after the move, as the loader does
    A_log, dt_bias = torch.zeros(8, device=DEV), torch.ones(8, device=DEV)

    def run():
        norm(x)
        norm(x, res)
        q_norm(q)
        gated(core, z)
        mlp(x)
        gdn_gating(ab[:, :8], ab[:, 8:], A_log, dt_bias)

    with torch.inference_mode():
        run()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
