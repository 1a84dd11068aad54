"""RMSNorms (CPU path = the reference) against transformers' modules (Qwen3-Next, Nemotron-H,
Falcon-H1), bit for bit, and the fused residual add against the unfused `residual + x`.

The `gpu` tests at the end compare the Triton variants of the Mamba2 hybrids' norms with the
reference on fresh random inputs, NaN-poisoned outputs (tolerances: tests/kernels/test_gpu_fused_ops.py).
They run on the device `DEV`; the same functions run on CPU tensors under the Triton interpreter
(TRITON_INTERPRET=1) with DEV set to "cpu"."""

import pytest
import torch
import torch.nn.functional as F

from forkpoint.kernels.norms import gated_rms_norm, grouped_gated_rms_norm, rms_norm

EPS = 1e-6
DTYPES = [torch.float32, torch.bfloat16]
DEV = "cuda"


def hf_rms_norm(dim, weight):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    module = Qwen3NextRMSNorm(dim, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module.to(weight.dtype)


def hf_gated_rms_norm(dim, weight):
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    module = Qwen3NextRMSNormGated(dim, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module.to(weight.dtype)


def inputs(shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(shape, generator=gen)).to(dtype)
    weight = (0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    return x, weight, gen


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 48), (0, 32), (5, 4, 16), (2, 3, 2, 8)])
def test_rms_norm_equals_transformers(dtype, shape):
    x, weight, _ = inputs(shape, dtype, seed=sum(shape))
    y = rms_norm(x, weight, EPS)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, hf_rms_norm(shape[-1], weight)(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_reads_strided_heads(dtype):
    """q of the interleaved q/gate projection: [T, heads, D] with row stride 2D."""
    x, weight, gen = inputs((6, 3, 32), dtype, seed=1)
    q_gate = torch.cat([x, torch.randn(6, 3, 32, generator=gen).to(dtype)], dim=-1)
    q = q_gate.split(32, dim=-1)[0]
    assert not q.is_contiguous()
    assert torch.equal(rms_norm(q, weight, EPS), rms_norm(x, weight, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_residual_equals_unfused(dtype):
    x, weight, gen = inputs((9, 40), dtype, seed=2)
    residual = (3 * torch.randn(9, 40, generator=gen)).to(dtype)
    y, s = rms_norm(x, weight, EPS, residual)
    unfused = residual + x
    assert s.dtype == dtype and torch.equal(s, unfused)
    assert torch.equal(y, rms_norm(unfused, weight, EPS))


def test_rms_norm_rejects_mismatches():
    x, weight, _ = inputs((4, 8), torch.float32, seed=3)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, weight[:4], EPS)
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm(x, weight, EPS, x.bfloat16())
    with pytest.raises(ValueError, match="residual must match"):
        rms_norm(x, weight, EPS, x[:2])


@pytest.mark.parametrize("weight_dtype", [None, torch.float32])  # None: the activations' dtype
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 4, 32), (7, 2, 16), (0, 2, 16), (5, 24)])
def test_gated_rms_norm_equals_transformers(dtype, weight_dtype, shape):
    x, _, gen = inputs(shape, dtype, seed=10 + sum(shape))
    gate = (2 * torch.randn(shape, generator=gen)).to(dtype)
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(weight_dtype or dtype)
    y = gated_rms_norm(x, gate, weight, EPS)
    assert y.dtype == dtype and y.shape == x.shape
    assert torch.equal(y, hf_gated_rms_norm(shape[-1], weight)(x, gate))


def test_gated_rms_norm_rejects_mismatched_gate():
    x, _, _ = inputs((4, 8), torch.float32, seed=4)
    with pytest.raises(ValueError, match="gate must have"):
        gated_rms_norm(x, x[:, :4], torch.ones(8), EPS)


# ---------------------------------------------------------------- the Mamba2 hybrids' norms

def hf_nemotron_rms_norm(dim, weight):
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNorm

    module = NemotronHRMSNorm(dim, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module.to(weight.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (7, 48), (0, 32), (5, 4, 16)])
def test_plain_rms_norm_equals_transformers(dtype, shape):
    """centred=False: `w * norm(x)` with the weight product in fp32 (NemotronHRMSNorm), and the fused
    residual add."""
    x, _, gen = inputs(shape, dtype, seed=20 + sum(shape))
    weight = (1 + 0.2 * torch.randn(shape[-1], generator=gen)).to(dtype)
    y = rms_norm(x, weight, EPS, centred=False)
    assert y.dtype == dtype and torch.equal(y, hf_nemotron_rms_norm(shape[-1], weight)(x))
    residual = (3 * torch.randn(shape, generator=gen)).to(dtype)
    y, s = rms_norm(x, weight, EPS, residual, centred=False)
    assert torch.equal(s, residual + x) and torch.equal(y, rms_norm(residual + x, weight, EPS, centred=False))


def hf_grouped_gated(dim, groups, weight, norm_before_gate):
    if norm_before_gate:
        from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1RMSNormGated

        module = FalconH1RMSNormGated(dim, eps=EPS, n_groups=groups, norm_before_gate=True)
    else:
        from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated

        module = NemotronHRMSNormGated(dim, group_size=dim // groups, eps=EPS)
    with torch.no_grad():
        module.weight.copy_(weight)
    return module


@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("tokens", [0, 1, 9])
def test_grouped_gated_rms_norm_equals_transformers(tokens, groups, norm_before_gate):
    """fp32, bit for bit: Nemotron-H's gate-then-norm and Falcon-H1's norm-then-gate; x a row-strided
    view and the gate a column slice of a wider projection, as the Mamba2 mixer passes them."""
    gen = torch.Generator().manual_seed(tokens * 10 + groups + norm_before_gate)
    x = (3 * torch.randn(tokens, 80, generator=gen))[:, :64]
    gate = (2 * torch.randn(tokens, 100, generator=gen))[:, 20:84]
    weight = 1 + 0.2 * torch.randn(64, generator=gen)
    y = grouped_gated_rms_norm(x, gate, weight, groups, EPS, norm_before_gate)
    assert y.shape == (tokens, 64) and y.dtype == torch.float32
    assert torch.equal(y, hf_grouped_gated(64, groups, weight, norm_before_gate)(x, gate))


def test_grouped_gated_rms_norm_uses_the_given_mean_square():
    """A tensor-parallel rank's all-reduced mean of squares replaces the local one."""
    gen = torch.Generator().manual_seed(5)
    x, gate = torch.randn(6, 32, generator=gen), torch.randn(6, 32, generator=gen)
    weight = torch.randn(32, generator=gen)
    y = grouped_gated_rms_norm(x, gate, weight, 2, EPS, mean_square=lambda g: torch.full_like(g[..., :1], 4.0))
    expected = (x * F.silu(gate)) * torch.rsqrt(torch.tensor(4.0 + EPS)) * weight
    assert torch.allclose(y, expected, rtol=1e-6, atol=0)


def test_grouped_gated_rms_norm_rejects_mismatches():
    x = torch.zeros(4, 12)
    with pytest.raises(ValueError, match="groups must divide"):
        grouped_gated_rms_norm(x, x, torch.ones(12), 5, EPS)
    with pytest.raises(ValueError, match=r"gate \[T, I\]"):
        grouped_gated_rms_norm(x, x[:, :6], torch.ones(12), 2, EPS)
    with pytest.raises(ValueError, match=r"weight \[I\]"):
        grouped_gated_rms_norm(x, x, torch.ones(6), 2, EPS)


# ---------------------------------------------------------------- Triton variants (gpu)

def randn(gen, *shape, dtype, scale=1.0):
    return (scale * torch.randn(*shape, generator=gen, device=gen.device)).to(dtype)


# Nemotron-3-Nano's hidden size 2688 (not a power of 2), T = 0, 1, odd and long rows
PLAIN_SHAPES = [(1, 2688), (7, 2688), (0, 2688), (257, 2688), (3, 4096 + 64), (5, 300), (4, 3, 64)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", PLAIN_SHAPES)
def test_triton_plain_rms_norm_matches_reference(poison, dtype, shape):
    from forkpoint.kernels.norms import reference
    from tests.kernels.test_gpu_fused_ops import check, tol

    tri = pytest.importorskip("forkpoint.kernels.norms.triton")
    gen = torch.Generator(device=DEV).manual_seed(sum(shape) + 1)
    x = randn(gen, *shape, dtype=dtype, scale=3.0)
    residual = randn(gen, *shape[:-1], shape[-1] + 8, dtype=dtype, scale=3.0)[..., 8:]  # a strided view
    for weight in (randn(gen, shape[-1], dtype=dtype, scale=0.5) + 1, torch.randn(shape[-1], generator=gen,
                                                                                  device=DEV)):  # and fp32
        name = f"rms_norm centred=False {dtype} {shape} w {weight.dtype}"
        check(name, tri.rms_norm(x, weight, EPS, centred=False),
              reference.rms_norm(x.cpu(), weight.cpu(), EPS, centred=False), tol(dtype))
        y, s = tri.rms_norm(x, weight, EPS, residual, centred=False)
        y_ref, s_ref = reference.rms_norm(x.cpu(), weight.cpu(), EPS, residual.cpu(), centred=False)
        check(name + " +residual", y, y_ref, tol(dtype))
        assert torch.equal(s.cpu(), s_ref), "the residual sum must equal residual + x exactly"


# Nemotron-3-Nano: I = 4096 in 8 groups of 512; one group; a group size that is not a power of 2
GROUPED_SHAPES = [(1, 4096, 8), (7, 4096, 8), (0, 4096, 8), (300, 4096, 8), (5, 1024, 1), (3, 96, 4), (9, 6144, 3)]


@pytest.mark.gpu
@pytest.mark.parametrize("norm_before_gate", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,width,groups", GROUPED_SHAPES)
def test_triton_grouped_gated_rms_norm_matches_reference(poison, dtype, tokens, width, groups, norm_before_gate):
    """y row-strided (Falcon-H1's Mamba2 columns of the core output), z a column slice of the
    in_proj output; bf16 and fp32 weights."""
    from forkpoint.kernels.norms import reference
    from tests.kernels.test_gpu_fused_ops import check, tol

    tri = pytest.importorskip("forkpoint.kernels.norms.triton")
    gen = torch.Generator(device=DEV).manual_seed(tokens + width + groups)
    y = randn(gen, tokens, width + 40, dtype=dtype, scale=3.0)[:, :width]
    z = randn(gen, tokens, 2 * width + 24, dtype=dtype, scale=2.0)[:, width:2 * width]
    for weight in (randn(gen, width, dtype=dtype, scale=0.2) + 1, 1 + 0.2 * torch.randn(width, generator=gen,
                                                                                         device=DEV)):
        out = tri.grouped_gated_rms_norm(y, z, weight, groups, EPS, norm_before_gate)
        assert out.is_contiguous()
        check(f"grouped_gated_rms_norm {dtype} T={tokens} I={width} G={groups} nbg={norm_before_gate} "
              f"w {weight.dtype}", out,
              reference.grouped_gated_rms_norm(y.cpu(), z.cpu(), weight.cpu(), groups, EPS, norm_before_gate),
              tol(dtype))


@pytest.mark.gpu
def test_triton_norms_capture_in_a_cuda_graph():
    """The Mamba2 hybrids' norms as the model calls them (PlainRMSNorm with and without the residual,
    GroupedGatedRMSNorm), warmed up, then captured (no host sync); replays on new inputs equal eager."""
    pytest.importorskip("forkpoint.kernels.norms.triton")
    from forkpoint.models.mamba2 import GroupedGatedRMSNorm, PlainRMSNorm

    gen = torch.Generator(device=DEV).manual_seed(3)
    x, res = randn(gen, 37, 2688, dtype=torch.bfloat16), randn(gen, 37, 2688, dtype=torch.bfloat16)
    y, z = randn(gen, 37, 4096, dtype=torch.bfloat16), randn(gen, 37, 5000, dtype=torch.bfloat16)[:, 100:4196]
    norm = PlainRMSNorm(2688, EPS).to(DEV, torch.bfloat16)
    gated = GroupedGatedRMSNorm(4096, 8, EPS, norm_before_gate=False).to(DEV, torch.bfloat16)

    def run():
        return norm(x), *norm(x, res), gated(y, z)

    with torch.inference_mode():
        eager = run()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):  # a host sync here fails the capture
            captured = run()
        for t in (x, res, y, z):
            t.mul_(-1)
        graph.replay()
        for out, again in zip(captured, run()):
            assert torch.equal(out, again)
        assert not torch.equal(captured[0], eager[0])


@pytest.mark.gpu
def test_dispatch_sends_cuda_tensors_to_the_grouped_kernel(monkeypatch):
    from forkpoint.kernels import norms

    module = pytest.importorskip("forkpoint.kernels.norms.triton")
    monkeypatch.setattr(module, "grouped_gated_rms_norm", lambda *a, **k: "triton")
    t = torch.zeros(1, 8, device=DEV)
    assert norms.grouped_gated_rms_norm(t, t, torch.ones(8, device=DEV), 2, EPS) == "triton"
    assert norms.grouped_gated_rms_norm(t.cpu(), t.cpu(), torch.ones(8), 2, EPS).shape == (1, 8)
