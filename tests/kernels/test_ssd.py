"""Mamba2 SSD scan: the chunked reference and the GPU variants against the token-by-token recurrence
(fresh random inputs, varlen, initial states, groups < heads). GPU outputs are NaN-poisoned by the
`poison` fixture (tests/kernels/conftest.py: torch.empty returns NaN while it is active), and the
in-place step's untouched pool rows hold NaN."""

from __future__ import annotations

import pytest
import torch

from forkpoint.kernels.ssd import reference as ref


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def inputs(lengths, heads=4, groups=2, head_dim=8, state_dim=6, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tokens = sum(lengths)
    x = torch.randn(tokens, heads, head_dim, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(tokens, heads, generator=g) - 1.0)
    A = -torch.rand(heads, generator=g) * 2 - 0.1
    B = torch.randn(tokens, groups, state_dim, generator=g) * 0.5
    C = torch.randn(tokens, groups, state_dim, generator=g) * 0.5
    D = torch.randn(heads, generator=g)
    h0 = torch.randn(len(lengths), heads, head_dim, state_dim, generator=g)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    move = {"device": device}
    return (x.to(dtype=dtype, **move), dt.to(**move), A.to(**move), B.to(dtype=dtype, **move),
            C.to(dtype=dtype, **move), h0.to(**move), torch.tensor(cu, **move), cu, D.to(**move))


@pytest.mark.parametrize("lengths,chunk", [([37], 16), ([5, 0, 33, 16, 1], 8), ([70, 3], 64), ([1], 4)])
def test_chunked_equals_recurrence_varlen_with_initial_states(lengths, chunk):
    x, dt, A, B, C, h0, cu, cu_host, D = inputs(lengths, seed=len(lengths) + chunk)
    y, final = ref.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D, chunk_size=chunk)
    y_ref, final_ref = ref.ssd_recurrence(x, dt, A, B, C, h0, cu_host, D=D)
    assert rel(y, y_ref) < 1e-5 and rel(final, final_ref) < 1e-5
    assert torch.equal(final[1], h0[1]) if len(lengths) > 1 and lengths[1] == 0 else True


def test_chunked_equals_transformers_scan():
    """transformers' mamba2_chunk_scan (its torch path) on one sequence from a given initial state."""
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan

    x, dt, A, B, C, h0, cu, cu_host, D = inputs([29], seed=3)
    raw_dt = torch.log(torch.expm1(dt))  # transformers applies softplus itself
    y_hf, final_hf = mamba2_chunk_scan(x[None], raw_dt[None], A, B[None], C[None], chunk_size=8, D=D,
                                       initial_states=h0, dt_softplus=True, return_final_states=True)
    y, final = ref.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D, chunk_size=16)
    assert rel(y, y_hf[0]) < 1e-5 and rel(final, final_hf) < 1e-5


def test_steps_equal_recurrence_and_inplace_touches_only_its_rows():
    x, dt, A, B, C, h0, _, cu_host, D = inputs([1, 1, 1], seed=5)
    y, new = ref.ssd_step(x, dt, A, B, C, h0, D=D)
    y_ref, final_ref = ref.ssd_recurrence(x, dt, A, B, C, h0, cu_host, D=D)
    assert rel(y, y_ref) < 1e-6 and rel(new, final_ref) < 1e-6
    pool = torch.randn(6, *h0.shape[1:])
    slots = torch.tensor([4, 1, 3])
    pool[slots] = h0
    before = pool.clone()
    y_in = ref.ssd_step_inplace(x, dt, A, B, C, pool, slots, D=D)
    assert torch.allclose(y_in, y) and torch.allclose(pool[slots], new)
    untouched = [0, 2, 5]
    assert torch.equal(pool[untouched], before[untouched])


def test_bad_shapes_raise_clear_errors():
    x, dt, A, B, C, h0, cu, cu_host, _ = inputs([4, 3], heads=4, groups=2)
    with pytest.raises(ValueError, match="multiple of G"):
        ref.chunk_ssd(x, dt, A, B[:, :1].expand(-1, 3, -1), C[:, :1].expand(-1, 3, -1), h0, cu, cu_host)
    with pytest.raises(ValueError, match="float32"):
        ref.chunk_ssd(x, dt, A, B, C, h0.double(), cu, cu_host)
    with pytest.raises(ValueError, match="initial_state"):
        ref.chunk_ssd(x, dt, A, B, C, h0[:1], cu, cu_host)


def test_out_is_written_in_place_through_a_strided_view():
    """chunk_ssd(out=) and ssd_step_inplace(out=) write a strided view of a bigger buffer (rows of
    other tokens and other heads stay NaN) and return it; the values equal the returned y."""
    x, dt, A, B, C, h0, cu, cu_host, D = inputs([9, 0, 4], heads=4, groups=2)
    y, final = ref.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D, chunk_size=4)
    big = torch.full((x.shape[0] + 3, 6, x.shape[2]), float("nan"))
    out = big[1:1 + x.shape[0], 1:5]
    y_out, final_out = ref.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D, chunk_size=4, out=out)
    assert y_out.data_ptr() == out.data_ptr() and torch.equal(out, y) and torch.equal(final_out, final)
    assert big[0].isnan().all() and big[-2:].isnan().all() and big[:, [0, 5]].isnan().all()
    pool = torch.randn(4, *h0.shape[1:])
    step = inputs([1, 1], heads=4, groups=2, seed=2)
    xs, dts, Bs, Cs = step[0], step[1], step[3], step[4]
    slots = torch.tensor([3, 1])
    y_step = ref.ssd_step_inplace(xs, dts, A, Bs, Cs, pool.clone(), slots, D=D)
    small = torch.full((2, 6, x.shape[2]), float("nan"))
    ref.ssd_step_inplace(xs, dts, A, Bs, Cs, pool, slots, D=D, out=small[:, 2:6])
    assert torch.equal(small[:, 2:6], y_step) and small[:, :2].isnan().all()
    with pytest.raises(ValueError, match="out must be"):
        ref.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, out=out[:-1])
    with pytest.raises(ValueError, match="out must be"):
        ref.ssd_step_inplace(xs, dts, A, Bs, Cs, pool, slots, out=small[:, 2:6].double())


def test_softplus_dt_is_transformers_step_size():
    """The Mamba2 mixers of transformers: dt = softplus(dt + dt_bias), clamped to time_step_limit
    (both ends; an infinite upper limit leaves it open); raw values cross softplus' threshold 20."""
    g = torch.Generator().manual_seed(1)
    raw = torch.randn(7, 12, generator=g) * 15
    bias = torch.randn(5, generator=g)
    view = raw[:, 2:7]  # a column view of a wider projection
    expected = torch.clamp(torch.log1p(torch.exp(view.double() + bias.double())), 0.01, 3.0)
    expected = torch.where(view + bias > 20, (view + bias).double(), expected)
    assert torch.allclose(ref.softplus_dt(view, bias, 0.01, 3.0), expected.float(), rtol=1e-6, atol=1e-7)
    opened = ref.softplus_dt(view, bias, 0.0, float("inf"))
    assert opened.dtype == torch.float32 and (opened > 3.0).any() and (opened >= 0).all()
    with pytest.raises(ValueError, match="dt_bias"):
        ref.softplus_dt(view, bias[:4], 0.0, 1.0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_softplus_dt_matches_reference(poison, dtype):
    from forkpoint.kernels.ssd import triton as ssd_triton

    g = torch.Generator().manual_seed(3)
    raw = (torch.randn(300, 77, generator=g) * 12).to(device="cuda", dtype=dtype)
    view, bias = raw[:, 5:5 + 48], torch.randn(48, generator=g).to(device="cuda", dtype=dtype)
    for limits in ((0.0, float("inf")), (0.001, 0.1)):
        got, want = ssd_triton.softplus_dt(view, bias, *limits), ref.softplus_dt(view, bias, *limits)
        err = float((got - want).abs().max() / want.abs().max())
        print(f"SSD_GPU softplus_dt {dtype} {limits}: max rel {err:.2e}")
        assert got.dtype == torch.float32 and not got.isnan().any() and err < 1e-6


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_prologue_is_exact_and_epilogue_writes_a_strided_view(poison, dtype):
    """The fused glue around fla's kernels: q, k (per group and per head) and v = x dt equal the
    torch expressions exactly, g the in-chunk cumulative sum of dt A / ln 2; the epilogue writes y =
    o + D x into a strided view and nowhere else."""
    import math

    from forkpoint.kernels.conv1d.triton import chunk_indices
    from forkpoint.kernels.ssd import triton as ssd_triton

    lengths = [130, 0, 1, 64, 57]
    x, dt, A, B, C, _, cu, cu_host, D = inputs(lengths, heads=8, groups=2, head_dim=64, state_dim=128, seed=6,
                                               device="cuda", dtype=dtype)
    idx = chunk_indices(cu_host, 64, x.device)
    q, k, k_heads, v, g = ssd_triton.ssd_prologue(x, dt, A, B, C, cu, idx, chunk_size=64, scale=1 / math.log(2))
    assert torch.equal(q, C) and torch.equal(k, B) and torch.equal(k_heads, ref._heads(B, 8))
    assert torch.equal(v, (x.float() * dt[..., None]).to(dtype))
    a, g_ref = dt * A, torch.empty_like(dt)
    for s in range(len(lengths)):
        for lo in range(cu_host[s], cu_host[s + 1], 64):
            hi = min(lo + 64, cu_host[s + 1])
            g_ref[lo:hi] = torch.cumsum(a[lo:hi], 0) / math.log(2)
    assert torch.allclose(g, g_ref, rtol=1e-5, atol=1e-5)
    big = torch.full((x.shape[0] + 2, 10, 64), float("nan"), device="cuda", dtype=dtype)
    out = big[1:-1, 1:9]
    for skip in (D, None):
        ssd_triton.ssd_epilogue(v, x, skip, out)
        expect = v if skip is None else (v.float() + D[None, :, None] * x.float()).to(dtype)
        assert torch.allclose(out.float(), expect.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-5)
        assert big[[0, -1]].isnan().all() and big[:, [0, 9]].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,groups", [(8, 8), (8, 2), (16, 1)])
def test_gpu_chunk_matches_recurrence(poison, dtype, heads, groups):
    from forkpoint.kernels.ssd import fla

    lengths = [130, 0, 1, 64, 257, 7]
    args = inputs(lengths, heads=heads, groups=groups, head_dim=64, state_dim=128, seed=heads + groups, device="cuda",
                  dtype=dtype)
    x, dt, A, B, C, h0, cu, cu_host, D = args
    y, final = fla.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D)
    y_ref, final_ref = ref.ssd_recurrence(*(t.cpu() for t in (x.float(), dt, A, B.float(), C.float(), h0)),
                                          cu_host, D=D.cpu())
    # fla's dots run in TF32 for float32 inputs: measured 1.3e-3 (y) / 4.7e-4 (state) on an H200,
    # bf16 3.2e-3 / 1.3e-3 (docs/models.md)
    tol = 5e-3 if dtype == torch.float32 else 2e-2
    err_y, err_state = rel(y.cpu(), y_ref), rel(final.cpu(), final_ref)
    print(f"SSD_GPU chunk {dtype} H={heads} G={groups}: y {err_y:.2e}, final state {err_state:.2e}")
    assert not y.isnan().any() and not final.isnan().any() and err_y < tol and err_state < tol
    big = torch.full((x.shape[0] + 3, heads + 2, 64), float("nan"), device="cuda", dtype=dtype)
    out = big[2:-1, 1:-1]  # rows and heads of a bigger buffer: the caller's core output
    y_out, final_out = fla.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D, out=out)
    assert y_out.data_ptr() == out.data_ptr() and torch.equal(out, y) and torch.equal(final_out, final)
    assert big[:2].isnan().all() and big[-1].isnan().all() and big[:, [0, -1]].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_inplace_step_matches_reference(poison, dtype):
    from forkpoint.kernels.ssd import triton as ssd_triton

    x, dt, A, B, C, h0, _, _, D = inputs([1] * 5, heads=16, groups=4, head_dim=64, state_dim=128, seed=9,
                                                device="cuda", dtype=dtype)
    pool = torch.full((9, *h0.shape[1:]), float("nan"), device="cuda")
    slots = torch.tensor([8, 2, 5, 1, 3], device="cuda")
    pool[slots] = h0
    y = ssd_triton.ssd_step_inplace(x, dt, A, B, C, pool, slots, D=D)
    y_ref, new_ref = ref.ssd_step(x.float(), dt, A, B.float(), C.float(), h0, D=D)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err_y, err_state = rel(y, y_ref), rel(pool[slots], new_ref)
    print(f"SSD_GPU inplace step {dtype}: y {err_y:.2e}, state {err_state:.2e}")
    assert not y.isnan().any() and err_y < tol and err_state < 1e-5
    others = [0, 4, 6, 7]
    assert pool[others].isnan().all()  # untouched rows keep their poison
    pool[slots] = h0
    big = torch.full((5, 18, 64), float("nan"), device="cuda", dtype=dtype)
    out = big[:, 1:17]
    assert ssd_triton.ssd_step_inplace(x, dt, A, B, C, pool, slots, D=D, out=out).data_ptr() == out.data_ptr()
    assert torch.equal(big[:, 1:17], y) and big[:, [0, 17]].isnan().all()


@pytest.mark.gpu
def test_gpu_chunk_is_sync_free_and_replays_in_a_cuda_graph():
    """Once an offsets layout is warm (fla autotuned, chunk lists uploaded), chunk_ssd makes no host
    sync and a CUDA graph of it, replayed on new inputs copied into the same buffers, equals the
    eager call (runner/piecewise.py replays one such graph per step for every Mamba2 layer)."""
    from forkpoint.kernels.ssd import fla

    lengths = [130, 0, 1, 64, 57]
    x, dt, A, B, C, h0, cu, cu_host, D = inputs(lengths, heads=8, groups=2, head_dim=64, state_dim=128, seed=4,
                                                device="cuda", dtype=torch.bfloat16)
    fla.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D)  # warm: autotune, uploads
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y_eager, final_eager = fla.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    core_out = torch.zeros(x.shape[0] + 1, 8, 64, device="cuda", dtype=torch.bfloat16)  # the runner's buffer
    with torch.cuda.graph(graph, stream=stream):
        y_graph, final_graph = fla.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D, out=core_out[:-1])
    fresh = inputs(lengths, heads=8, groups=2, head_dim=64, state_dim=128, seed=5, device="cuda",
                   dtype=torch.bfloat16)
    for dst, src in zip((x, dt, A, B, C, h0, D), fresh[:6] + fresh[8:]):
        dst.copy_(src)
    y_new, final_new = fla.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D)
    graph.replay()
    assert torch.equal(y_graph, y_new) and torch.equal(final_graph, final_new)
    assert not torch.equal(y_graph, y_eager)  # the replay read the new inputs
    assert y_graph.data_ptr() == core_out.data_ptr() and not core_out[-1].any()
