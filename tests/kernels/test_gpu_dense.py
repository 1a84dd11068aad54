"""The Triton dense projection against its reference, F.linear (skipped without CUDA).

Fresh seeded random inputs in bf16, fp16 and fp32; every entry of `triton.TABLE` is run at the
largest and smallest M of its bucket, with and without bias, on an (N, K) of its class (with N not
a multiple of the column block, K not a multiple of BLOCK_K). The reference runs on CPU copies in
fp32. Outputs are NaN-poisoned (the `poison` fixture, or a NaN-filled `out`) and must be fully
written. Tolerances, relative RMS in fp64: 1e-5 in fp32 (the kernel keeps fp32 with
input_precision="ieee"), 4e-3 in bf16 / fp16 (one rounding of the fp32 result; a bf16 ulp is 3.9e-3
relative). Row invariance and graph replays are checked bit for bit.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

tri = pytest.importorskip("forkpoint.kernels.dense.triton")

DEV = "cuda"
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-3, torch.float16: 4e-3}
# (N, K) per class of the table, in order: a decode shape of Qwen3.5-35B-A3B and a ragged one
CLASS_SHAPES = {0: [(2048, 512), (1288, 2048), (1000, 200)], 1: [(12352, 2048), (5000, 328)]}


def shapes_of(i: int) -> list[tuple[int, int]]:
    """The test's (N, K) of class i of the table, checked to fall in it (and in no earlier class)."""
    for n, k in CLASS_SHAPES[i]:
        first = next(j for j, c in enumerate(tri.TABLE) if n <= c.max_n and k <= c.max_k)
        assert first == i, f"test shape {(n, k)} is in class {first}, not {i}: update CLASS_SHAPES"
    return CLASS_SHAPES[i]


def make(gen, m, n, k, dtype, bias):
    x = torch.randn(m, k, generator=gen, device=DEV).to(dtype)
    w = (torch.randn(n, k, generator=gen, device=DEV) / k**0.5).to(dtype)
    b = torch.randn(n, generator=gen, device=DEV).to(dtype) if bias else None
    return x, w, b


def check(name, out, x, w, b):
    from forkpoint.kernels.dense import reference

    ref = reference.linear(x.float().cpu(), w.float().cpu(), None if b is None else b.float().cpu())
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert not torch.isnan(out).any(), f"{name}: NaN left in the output (an element was never written)"
    err = ((out.double().cpu() - ref.double()).norm() / ref.double().norm()).item()
    print(f"REL_RMS {name} = {err:.3e} (tol {TOL[x.dtype]:.0e})")
    assert err < TOL[x.dtype], f"{name}: relative RMS error {err:.3e} >= {TOL[x.dtype]:.0e}"


def table_cases() -> list[tuple[int, int, int]]:
    """(class, the entry's max_m, its bucket's smallest M) for every entry of the table."""
    cases = []
    for i, shape in enumerate(tri.TABLE):
        lows = [1] + [t.max_m + 1 for t in shape.tiles[:-1]]
        cases += [(i, t.max_m, low) for t, low in zip(shape.tiles, lows)]
    return cases


def test_every_class_has_test_shapes():
    assert set(CLASS_SHAPES) == set(range(len(tri.TABLE)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cls,max_m,min_m", table_cases())
def test_every_table_entry_matches_reference(poison, dtype, bias, cls, max_m, min_m):
    gen = torch.Generator(device=DEV).manual_seed(cls * 1000 + max_m)
    for n, k in shapes_of(cls):
        for m in sorted({min_m, max_m}):
            x, w, b = make(gen, m, n, k, dtype, bias)
            tile = tri.tile_for(m, n, k)
            assert tile is not None and tile.max_m == max_m
            check(f"linear {m}x{k} @ {n}x{k} bias={bias} {dtype}", tri.linear(x, w, b), x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_out_is_fully_written(dtype):
    gen = torch.Generator(device=DEV).manual_seed(7)
    x, w, b = make(gen, 3, 1288, 2048, dtype, True)
    out = torch.full((3, 1288), float("nan"), dtype=dtype, device=DEV)
    assert tri.linear(x, w, b, out=out).data_ptr() == out.data_ptr()
    check(f"linear out= {dtype}", out, x, w, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_do_not_depend_on_m_or_other_rows(dtype):
    """Row 0 of x[:M] is the same bits for every M the table serves; and at the largest M every
    row equals that row computed alone."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    for i, shape in enumerate(tri.TABLE):
        top = shape.tiles[-1].max_m
        for n, k in shapes_of(i):
            x, w, b = make(gen, top, n, k, dtype, True)
            alone = tri.linear(x[:1], w, b)
            for m in range(2, top + 1):
                assert torch.equal(tri.linear(x[:m], w, b)[0], alone[0]), f"row 0 differs at M={m}, {(n, k)}"
            full = tri.linear(x, w, b)
            for r in range(top):
                assert torch.equal(full[r], tri.linear(x[r:r + 1], w, b)[0]), f"row {r} of M={top}, {(n, k)}"


def test_past_the_table_and_other_layouts_run_f_linear():
    gen = torch.Generator(device=DEV).manual_seed(3)
    x, w, b = make(gen, 512, 1288, 2048, torch.bfloat16, True)
    assert tri.tile_for(512, 1288, 2048) is None
    assert torch.equal(tri.linear(x, w, b), F.linear(x, w, b))
    wt = w.t().contiguous().t()  # [N, K] with column-major strides
    assert torch.equal(tri.linear(x[:2], wt, b), F.linear(x[:2], wt, b))
    empty = torch.empty(0, 2048, dtype=torch.bfloat16, device=DEV)
    assert tri.linear(empty, w, b).shape == (0, 1288)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,block_m", [(1, 1), (2, 2), (4, 4), (5, 4)])
def test_broadcast_path_matches_reference(poison, dtype, m, block_m):
    """The broadcast-multiply-sum path (not in the table; the benchmark sweeps it)."""
    gen = torch.Generator(device=DEV).manual_seed(m)
    x, w, b = make(gen, m, 1000, 200, dtype, True)
    out = torch.empty(m, 1000, dtype=dtype, device=DEV)
    tile = tri.Tile(4, block_m, 4, 512, 4, 1, dot=False)
    check(f"broadcast {m}x200 @ 1000x200 {dtype}", tri.linear_tile(x, w, b, out, tile), x, w, b)


def test_capture_in_a_cuda_graph_and_replay_new_inputs():
    gen = torch.Generator(device=DEV).manual_seed(5)
    x, w, b = make(gen, 4, 2048, 4096, torch.bfloat16, False)
    out = torch.empty(4, 2048, dtype=torch.bfloat16, device=DEV)
    tri.linear(x, w, b, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tri.linear(x, w, b, out=out)
        fresh = tri.linear(x, w, b)
    for step in range(3):
        x.copy_(torch.randn(4, 4096, generator=gen, device=DEV))
        graph.replay()
        eager = tri.linear(x, w, b)
        assert torch.equal(out, eager) and torch.equal(fresh, eager), f"replay {step} differs from eager"


def test_no_host_sync():
    gen = torch.Generator(device=DEV).manual_seed(9)
    x, w, b = make(gen, 2, 2048, 512, torch.bfloat16, True)
    tri.linear(x, w, b)
    torch.cuda.set_sync_debug_mode("error")
    try:
        tri.linear(x, w, b)
    finally:
        torch.cuda.set_sync_debug_mode("default")
