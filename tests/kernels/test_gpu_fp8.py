"""The Triton FP8 kernels against their references (skipped without CUDA).

Fresh seeded random inputs. `fp8_linear`: Qwen's 128 x 128 blocks (and 128 x 64, 64 x 128) at decode
and prefill row counts, N and K with partial blocks, with and without bias, bf16 and fp32 activations,
against `reference.w8a8_block_linear` (the same per-token-group activation quantisation, fp32 math) on
CPU copies; outputs NaN-poisoned (the `poison` fixture), and a column range of a NaN-filled wider
buffer must be written exactly there. Tolerances, relative RMS in fp64: 3e-4 for fp32 outputs (the
FP8 tensor cores sum each 128-wide block with fewer than fp32's bits: 1.3e-4 measured on an H200),
8e-3 for bf16 (one rounding; 6.5e-3 measured at M = 1, N = 384).
`quantize_activations`: the same scales, and the same e4m3 values but for rounding ties (<= 1e-4 of
them). `fused_moe_fp8`: against `reference.fused_moe_fp8` (the dequantised experts) at decode and
prefill sizes, 5e-3 (bf16 roundings of h and the activation, as the bf16 tiles). Also: the kernel is
close to the dequantised bf16 GEMM (the activation rounding: 2.6e-2 relative RMS measured), and the
Triton GEMM agrees with torch's block-scaled `torch._scaled_mm` (3.3e-6 measured; skipped where this
torch build has no block scaling). Each `fp8_linear` case also runs the Triton GEMM alone
(`block_fp8_gemm`), since large bf16 steps dispatch to `torch._scaled_mm`.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

tri = pytest.importorskip("forkpoint.kernels.fp8.triton")
from forkpoint.kernels.fp8 import reference  # noqa: E402

DEV = "cuda"


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double().cpu() - ref.double().cpu()).norm() / ref.double().cpu().norm()).item()


def random_fp8_weight(gen, shape, block):
    w = torch.randn(shape, generator=gen, device=DEV) / shape[-1] ** 0.5
    return reference.quantize_blocks(w, block)


# Qwen's 128 x 128 blocks at every size; the other blocks on the ragged shape
LINEAR_CASES = ([((128, 128), m, n, k, dtype) for m in (1, 5, 16, 33, 128, 300)
                 for n, k in ((2048, 512), (1000, 200), (384, 2048)) for dtype in (torch.bfloat16, torch.float32)]
                + [(block, m, 1000, 200, dtype) for block in ((128, 64), (64, 128)) for m in (5, 300)
                   for dtype in (torch.bfloat16, torch.float32)])


@pytest.mark.parametrize("block,m,n,k,dtype", LINEAR_CASES)
def test_fp8_linear_matches_the_w8a8_reference(poison, block, m, n, k, dtype):
    gen = torch.Generator(device=DEV).manual_seed(m * 7 + n + k)
    q, s = random_fp8_weight(gen, (n, k), block)
    x = torch.randn(m, k, generator=gen, device=DEV).to(dtype)
    for bias in (None, torch.randn(n, generator=gen, device=DEV).to(dtype)):
        ref = reference.w8a8_block_linear(x.cpu(), q.cpu(), s.cpu(), block, None if bias is None else bias.cpu())
        xq, xs = tri.quantize_activations(x, block[1])
        # the dispatch (Triton GEMM, or torch._scaled_mm for large bf16 steps), and the Triton GEMM alone
        for path, out in (("fp8_linear", tri.fp8_linear(x, q, s, block, bias)),
                          ("triton_gemm", tri.block_fp8_gemm(xq, xs, q, s, block, bias, None, dtype))):
            assert out.shape == (m, n) and out.dtype == dtype
            assert not torch.isnan(out).any(), "an output element was never written"
            err = rel_rms(out, ref)
            tol = 3e-4 if dtype == torch.float32 else 8e-3
            print(f"REL_RMS {path} m={m} n={n} k={k} block={block} {dtype} bias={bias is not None}: {err:.2e}")
            assert err < tol


def test_fp8_linear_writes_a_column_range_of_a_wider_buffer():
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, s = random_fp8_weight(gen, (256, 512), (128, 128))
    x = torch.randn(40, 512, generator=gen, device=DEV).to(torch.bfloat16)
    wide = torch.full((40, 400), float("nan"), dtype=torch.bfloat16, device=DEV)
    tri.fp8_linear(x, q, s, (128, 128), out=wide[:, 100:356])
    assert torch.isnan(wide[:, :100]).all() and torch.isnan(wide[:, 356:]).all()
    assert torch.equal(wide[:, 100:356], tri.fp8_linear(x, q, s, (128, 128)))


def test_quantize_activations_matches_reference(poison):
    gen = torch.Generator(device=DEV).manual_seed(2)
    x = (torch.randn(77, 1000, generator=gen, device=DEV) * torch.rand(77, 1, generator=gen, device=DEV) * 10)
    x[3] = 0.0  # an all-zero row: the floor scale, zeros
    for dtype in (torch.bfloat16, torch.float32):
        xq, s = tri.quantize_activations(x.to(dtype), 128)
        rq, rs = reference.quantize_activations(x.to(dtype).cpu(), 128)
        assert torch.equal(s.cpu(), rs)
        differ = (xq.cpu().float() != rq.float()).float().mean().item()
        assert differ <= 1e-4, f"{differ:.2e} of the e4m3 values differ"


def test_fp8_linear_is_close_to_the_dequantised_gemm():
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, s = random_fp8_weight(gen, (2048, 2048), (128, 128))
    x = torch.randn(64, 2048, generator=gen, device=DEV).to(torch.bfloat16)
    dense = x.float() @ reference.dequantize_blocks(q, s, (128, 128)).T
    err = rel_rms(tri.fp8_linear(x, q, s, (128, 128)), dense)
    print(f"REL_RMS fp8_linear vs dequantised bf16 GEMM (activation rounding): {err:.2e}")
    assert err < 0.04


def test_torch_scaled_mm_agrees_where_it_runs():
    """torch's block-scaled FP8 GEMM (1 x 128 activation, 128 x 128 weight scales) on the same inputs,
    when this torch build has it."""
    gen = torch.Generator(device=DEV).manual_seed(4)
    m, n, k = 256, 1024, 2048
    q, s = random_fp8_weight(gen, (n, k), (128, 128))
    x = torch.randn(m, k, generator=gen, device=DEV).to(torch.bfloat16)
    xq, xs = tri.quantize_activations(x, 128)
    try:  # activation scales column-major (as cuBLAS's 1 x 128 blockwise scaling wants them)
        theirs = torch._scaled_mm(xq, q.T, scale_a=xs.T.contiguous().T, scale_b=s.T, out_dtype=torch.bfloat16)
    except (RuntimeError, TypeError, ValueError) as err:
        pytest.skip(f"torch._scaled_mm has no block-wise scaling here: {err}")
    err = rel_rms(tri.block_fp8_gemm(xq, xs, q, s, (128, 128), None, None, torch.bfloat16), theirs.float())
    print(f"REL_RMS Triton GEMM vs torch._scaled_mm (blockwise): {err:.2e}")
    assert err < 5e-3


@pytest.mark.parametrize("num_tokens", [1, 8, 64, 700])
@pytest.mark.parametrize("extras", [False, True])
def test_fused_moe_fp8_matches_reference(poison, num_tokens, extras):
    gen = torch.Generator(device=DEV).manual_seed(num_tokens)
    num_experts, hidden, inter, top_k, block = 32, 512, 256, 4, (128, 128)
    gate_up, gate_up_s = random_fp8_weight(gen, (num_experts, 2 * inter, hidden), block)
    down, down_s = random_fp8_weight(gen, (num_experts, hidden, inter), block)
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEV).to(torch.bfloat16)
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=DEV)
    weights, ids = torch.topk(torch.softmax(logits, -1), top_k, dim=-1)
    kwargs = {}
    if extras:
        kwargs = dict(shared=torch.randn(num_tokens, hidden, generator=gen, device=DEV).to(torch.bfloat16),
                      shared_gate=torch.randn(num_tokens, 1, generator=gen, device=DEV).to(torch.bfloat16),
                      residual=torch.randn(num_tokens, hidden, generator=gen, device=DEV).to(torch.bfloat16))
    out = tri.fused_moe_fp8(x, gate_up, gate_up_s, down, down_s, block, weights, ids, **kwargs)
    ref = reference.fused_moe_fp8(x.cpu(), gate_up.cpu(), gate_up_s.cpu(), down.cpu(), down_s.cpu(), block,
                                  weights.cpu(), ids.cpu(), **{k: v.cpu() for k, v in kwargs.items()})
    assert out.shape == x.shape and not torch.isnan(out).any()
    err = rel_rms(out, ref)
    print(f"REL_RMS fused_moe_fp8 T={num_tokens} extras={extras}: {err:.2e}")
    assert err < 5e-3
