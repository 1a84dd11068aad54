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
    with torch.cuda.graph(graph, stream=stream):
        y_graph, final_graph = fla.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D)
    fresh = inputs(lengths, heads=8, groups=2, head_dim=64, state_dim=128, seed=5, device="cuda",
                   dtype=torch.bfloat16)
    for dst, src in zip((x, dt, A, B, C, h0, D), fresh[:6] + fresh[8:]):
        dst.copy_(src)
    y_new, final_new = fla.chunk_ssd(x, dt, A, B, C, h0, cu, cu_host, D=D)
    graph.replay()
    assert torch.equal(y_graph, y_new) and torch.equal(final_graph, final_new)
    assert not torch.equal(y_graph, y_eager)  # the replay read the new inputs
