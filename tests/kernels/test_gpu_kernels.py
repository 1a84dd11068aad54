"""GPU variants of every kernel op against its plain-PyTorch reference (skipped without CUDA).

Fresh seeded random inputs (never zeros), variable segment lengths, non-zero initial states and
grouped heads. The reference runs on CPU copies of the same (bf16) inputs, in fp32. Error measure:
relative RMS, ||out - ref|| / ||ref|| in fp64. Tolerances, for bf16 operands: 2e-2 for the gated
delta rule (fla keeps per-chunk states in bf16 for the output product), 1e-2 elsewhere; copies
(conv states) must match exactly. Each measured error is printed (`pytest -s` shows them).

Outputs are fresh tensors from the op, so "poisoned before the kernel writes them" is arranged by
the `poison` fixture (tests/kernels/conftest.py): while it is active, torch.empty / empty_like /
Tensor.new_empty (used by our kernels and by fla) return NaN-filled float tensors, and every check
asserts that no NaN is left. `test_*_no_host_sync` run each op under
`torch.cuda.set_sync_debug_mode("error")`.
"""

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"


def rel_rms(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    return ((out - ref).norm() / ref.norm()).item()


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any(), f"{name}: NaN left in the output (an element was never written)"
    err = rel_rms(out, ref)
    print(f"REL_RMS {name} = {err:.3e} (tol {tol:.0e})")
    assert err < tol, f"{name}: relative RMS error {err:.3e} >= {tol:.0e}"


def _offsets(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _gdn_inputs(gen, lens, h, hv, k, v, dtype=torch.bfloat16):
    t = sum(lens)
    q = torch.randn(t, h, k, generator=gen, device=DEV).to(dtype)
    kk = torch.randn(t, h, k, generator=gen, device=DEV).to(dtype)
    vv = torch.randn(t, hv, v, generator=gen, device=DEV).to(dtype)
    g = F.logsigmoid(torch.randn(t, hv, generator=gen, device=DEV) + 2.0)  # fp32 log-decay in (-inf, 0)
    beta = torch.rand(t, hv, generator=gen, device=DEV).to(dtype)
    s0 = 0.1 * torch.randn(len(lens), hv, k, v, generator=gen, device=DEV)
    return q, kk, vv, g, beta, s0


def _cpu(*ts):
    return [t.cpu() for t in ts]


# ---------------------------------------------------------------- gated delta rule

@pytest.mark.parametrize(
    "lens,h,hv,dim",
    [
        ([1, 63, 64, 65, 200, 7], 2, 4, 128),      # GVA 2 -> 4, chunk edges
        ([512, 64, 64, 64], 4, 8, 128),            # the seed's shape: producer + consumers
        ([130, 3, 77], 4, 4, 64),                  # no grouping, small heads
    ],
)
def test_chunk_gated_delta_rule_matches_reference(poison, lens, h, hv, dim):
    fla = pytest.importorskip("forkpoint.kernels.gated_delta.fla")
    from forkpoint.kernels.gated_delta import reference

    gen = torch.Generator(device=DEV).manual_seed(1000 + sum(lens))
    q, k, v, g, beta, s0 = _gdn_inputs(gen, lens, h, hv, dim, dim)
    cu = _offsets(lens)
    cu_dev = torch.tensor(cu, device=DEV)
    o, st = fla.chunk_gated_delta_rule(q, k, v, g, beta, s0, cu_dev, cu)
    torch.cuda.synchronize()
    o_ref, st_ref = reference.chunk_gated_delta_rule(*_cpu(q, k, v, g, beta, s0), torch.tensor(cu), cu)
    assert o.dtype == v.dtype and st.dtype == torch.float32
    check(f"gdn_chunk_o lens={lens} H={h} HV={hv} K={dim}", o, o_ref, 2e-2)
    check(f"gdn_chunk_state lens={lens} H={h} HV={hv} K={dim}", st, st_ref, 2e-2)


def test_chunk_gated_delta_rule_zero_length_segment(poison):
    fla = pytest.importorskip("forkpoint.kernels.gated_delta.fla")
    from forkpoint.kernels.gated_delta import reference

    lens = [70, 0, 5]
    gen = torch.Generator(device=DEV).manual_seed(7)
    q, k, v, g, beta, s0 = _gdn_inputs(gen, lens, 2, 4, 64, 64)
    cu = _offsets(lens)
    o, st = fla.chunk_gated_delta_rule(q, k, v, g, beta, s0, torch.tensor(cu, device=DEV), cu)
    o_ref, st_ref = reference.chunk_gated_delta_rule(*_cpu(q, k, v, g, beta, s0), torch.tensor(cu), cu)
    check("gdn_chunk_o zero-length segment", o, o_ref, 2e-2)
    check("gdn_chunk_state zero-length segment", st, st_ref, 2e-2)


def test_recurrent_gated_delta_rule_matches_reference(poison):
    fla = pytest.importorskip("forkpoint.kernels.gated_delta.fla")
    from forkpoint.kernels.gated_delta import reference

    gen = torch.Generator(device=DEV).manual_seed(11)
    q, k, v, g, beta, s0 = _gdn_inputs(gen, [1] * 9, 4, 8, 128, 128)
    o, st = fla.recurrent_gated_delta_rule(q, k, v, g, beta, s0)
    o_ref, st_ref = reference.recurrent_gated_delta_rule(*_cpu(q, k, v, g, beta, s0))
    check("gdn_recurrent_o", o, o_ref, 1e-2)
    check("gdn_recurrent_state", st, st_ref, 1e-2)


def test_two_phase_equals_one_pass(poison):
    """Prefix once, gather its state for N consumers, run all suffixes packed: equals running each
    prefix + suffix in one pass (outputs on the suffix tokens and final states)."""
    fla = pytest.importorskip("forkpoint.kernels.gated_delta.fla")
    gen = torch.Generator(device=DEV).manual_seed(5)
    p, suffixes, h, hv, d = 300, [64, 17, 128, 1], 4, 8, 128
    qp, kp, vp, gp, bp, _ = _gdn_inputs(gen, [p], h, hv, d, d)
    qs, ks, vs, gs, bs, _ = _gdn_inputs(gen, suffixes, h, hv, d, d)
    s0 = 0.1 * torch.randn(1, hv, d, d, generator=gen, device=DEV)
    # phase 1: the prefix; phase 2: every suffix from the gathered checkpoint state
    _, ckpt = fla.chunk_gated_delta_rule(qp, kp, vp, gp, bp, s0, torch.tensor([0, p], device=DEV), [0, p])
    cu = _offsets(suffixes)
    init = ckpt.index_select(0, torch.zeros(len(suffixes), dtype=torch.long, device=DEV))
    o2, st2 = fla.chunk_gated_delta_rule(qs, ks, vs, gs, bs, init, torch.tensor(cu, device=DEV), cu)
    # one pass: [prefix, suffix_i] for every i, packed
    cat = lambda a, b: torch.cat([x for i in range(len(suffixes)) for x in (a, b[cu[i]:cu[i + 1]])])  # noqa: E731
    full = [cat(a, b) for a, b in zip((qp, kp, vp, gp, bp), (qs, ks, vs, gs, bs))]
    cu_full = _offsets([p + s for s in suffixes])
    o1, st1 = fla.chunk_gated_delta_rule(*full, s0.expand(len(suffixes), -1, -1, -1).contiguous(),
                                         torch.tensor(cu_full, device=DEV), cu_full)
    keep = torch.cat([torch.arange(cu_full[i] + p, cu_full[i + 1]) for i in range(len(suffixes))]).to(DEV)
    check("two_phase_vs_one_pass_o", o2, o1.index_select(0, keep), 1e-2)
    check("two_phase_vs_one_pass_state", st2, st1, 1e-2)


def _pool_case(gen, n, h, hv, dim, pool_rows):
    """Decode inputs plus a pool (row 0 zero) and n distinct target rows in random order, with gaps."""
    q, k, v, g, beta, _ = _gdn_inputs(gen, [1] * n, h, hv, dim, dim)
    pool = 0.1 * torch.randn(pool_rows, hv, dim, dim, generator=gen, device=DEV)
    pool[0] = 0
    slots = (torch.randperm(pool_rows - 1, generator=gen, device=DEV)[:n] + 1).long()
    return q, k, v, g, beta, pool, slots


@pytest.mark.parametrize("n", [1, 3, 64])
@pytest.mark.parametrize("h,hv,dim", [(16, 32, 128), (4, 4, 128), (2, 4, 64)])
def test_recurrent_inplace_matches_reference(poison, n, h, hv, dim):
    """Triton in-place step vs gather / reference step / scatter: o (NaN-poisoned before the kernel
    writes it), the target rows, and every other row bit-identical (row 0 stays zero)."""
    tri = pytest.importorskip("forkpoint.kernels.gated_delta.triton")
    from forkpoint.kernels.gated_delta import reference

    gen = torch.Generator(device=DEV).manual_seed(2000 + 7 * n + hv + dim)
    q, k, v, g, beta, pool, slots = _pool_case(gen, n, h, hv, dim, pool_rows=2 * n + 5)
    before = pool.clone()
    o = tri.recurrent_gated_delta_rule_inplace(q, k, v, g, beta, pool, slots)
    torch.cuda.synchronize()
    pool_ref = before.cpu()
    o_ref = reference.recurrent_gated_delta_rule_inplace(*_cpu(q, k, v, g, beta), pool_ref, slots.cpu())
    assert o.dtype == v.dtype and pool.dtype == torch.float32
    check(f"gdn_inplace_o N={n} H={h} HV={hv} K={dim}", o, o_ref, 1e-2)
    check(f"gdn_inplace_state N={n} H={h} HV={hv} K={dim}", pool[slots], pool_ref[slots.cpu()], 1e-5)
    untouched = torch.ones(len(pool), dtype=torch.bool, device=DEV)
    untouched[slots] = False
    assert torch.equal(pool[untouched], before[untouched]), "rows outside `slots` must stay bit-identical"
    assert not pool[0].any(), "the zero row must stay zero"


def test_recurrent_inplace_writes_into_out(poison):
    """`out=` (a row range of a NaN-filled buffer) receives exactly what the returned tensor holds,
    and the rows around it stay NaN."""
    tri = pytest.importorskip("forkpoint.kernels.gated_delta.triton")
    gen = torch.Generator(device=DEV).manual_seed(2100)
    q, k, v, g, beta, pool, slots = _pool_case(gen, 4, 16, 32, 128, pool_rows=13)
    expected = tri.recurrent_gated_delta_rule_inplace(q, k, v, g, beta, pool.clone(), slots)
    buffer = torch.full((6, 32, 128), float("nan"), dtype=v.dtype, device=DEV)
    o = tri.recurrent_gated_delta_rule_inplace(q, k, v, g, beta, pool, slots, out=buffer[1:5])
    assert o.data_ptr() == buffer[1:5].data_ptr() and torch.equal(buffer[1:5], expected)
    assert buffer[0].isnan().all() and buffer[5].isnan().all()


def test_recurrent_inplace_matches_fla_path(poison):
    """The in-place kernel against the path it replaces (index_select, fla fused recurrent, index_copy_)."""
    tri = pytest.importorskip("forkpoint.kernels.gated_delta.triton")
    fla = pytest.importorskip("forkpoint.kernels.gated_delta.fla")
    gen = torch.Generator(device=DEV).manual_seed(2100)
    q, k, v, g, beta, pool, slots = _pool_case(gen, 16, 16, 32, 128, pool_rows=40)
    o_fla, st_fla = fla.recurrent_gated_delta_rule(q, k, v, g, beta, pool.index_select(0, slots))
    o = tri.recurrent_gated_delta_rule_inplace(q, k, v, g, beta, pool, slots)
    check("gdn_inplace_vs_fla_o", o, o_fla, 1e-2)
    check("gdn_inplace_vs_fla_state", pool[slots], st_fla, 1e-5)


def test_recurrent_inplace_in_cuda_graph():
    """Captured once, replayed twice: two reference steps. Also no host sync once compiled."""
    tri = pytest.importorskip("forkpoint.kernels.gated_delta.triton")
    from forkpoint.kernels.gated_delta import reference

    gen = torch.Generator(device=DEV).manual_seed(2200)
    q, k, v, g, beta, pool, slots = _pool_case(gen, 8, 2, 4, 128, pool_rows=20)
    scratch = pool.clone()
    tri.recurrent_gated_delta_rule_inplace(q, k, v, g, beta, scratch, slots)  # compile outside capture
    _no_sync(lambda: tri.recurrent_gated_delta_rule_inplace(q, k, v, g, beta, scratch, slots))
    pool_ref = pool.cpu()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = tri.recurrent_gated_delta_rule_inplace(q, k, v, g, beta, pool, slots)
    for step in range(2):
        graph.replay()
        torch.cuda.synchronize()
        o_ref = reference.recurrent_gated_delta_rule_inplace(*_cpu(q, k, v, g, beta), pool_ref, slots.cpu())
        check(f"gdn_inplace_graph_o step {step}", o, o_ref, 1e-2)
        check(f"gdn_inplace_graph_state step {step}", pool, pool_ref, 1e-5)


# ---------------------------------------------------------------- conv1d

def test_causal_conv1d_varlen_matches_reference(poison):
    tri = pytest.importorskip("forkpoint.kernels.conv1d.triton")
    from forkpoint.kernels.conv1d import reference

    gen = torch.Generator(device=DEV).manual_seed(3)
    lens, d, w = [1, 2, 0, 3, 64, 65, 130, 200], 320, 4
    t = sum(lens)
    x = torch.randn(t, d, generator=gen, device=DEV).bfloat16()
    weight = (0.5 * torch.randn(d, w, generator=gen, device=DEV)).bfloat16()
    bias = torch.randn(d, generator=gen, device=DEV).bfloat16()
    s0 = torch.randn(len(lens), d, w - 1, generator=gen, device=DEV).bfloat16()
    cu = _offsets(lens)
    for b, act in ((bias, "silu"), (None, None)):
        y, st = tri.causal_conv1d_varlen(x, weight, b, s0, torch.tensor(cu, device=DEV), cu, activation=act)
        y_ref, st_ref = reference.causal_conv1d_varlen(*_cpu(x, weight), None if b is None else b.cpu(), s0.cpu(),
                                                       torch.tensor(cu), cu, activation=act)
        check(f"conv_varlen_y act={act}", y, y_ref, 1e-2)
        assert not torch.isnan(st).any() and torch.equal(st.cpu(), st_ref), "conv final state must be an exact copy"
    # channel groups written contiguous by the kernel (GDN q / k / v), from row-strided input
    wide = torch.randn(t, d + 24, generator=gen, device=DEV).bfloat16()
    for split in ((96, 96, 128), (64, 256), (320,)):
        parts, st = tri.causal_conv1d_varlen(wide[:, :d], weight, bias, s0, torch.tensor(cu, device=DEV), cu,
                                             split=split)
        plain, _ = tri.causal_conv1d_varlen(wide[:, :d].contiguous(), weight, bias, s0,
                                            torch.tensor(cu, device=DEV), cu)
        assert all(p.is_contiguous() for p in parts) and [p.shape[1] for p in parts] == list(split)
        assert torch.equal(torch.cat(parts, dim=1), plain), f"split {split} must equal the plain layout"


def test_causal_conv1d_step_matches_reference(poison):
    tri = pytest.importorskip("forkpoint.kernels.conv1d.triton")
    from forkpoint.kernels.conv1d import reference

    gen = torch.Generator(device=DEV).manual_seed(4)
    n, d, w = 6, 8192 + 64, 4
    x = torch.randn(n, d, generator=gen, device=DEV).bfloat16()
    weight = (0.5 * torch.randn(d, w, generator=gen, device=DEV)).bfloat16()
    bias = torch.randn(d, generator=gen, device=DEV).bfloat16()
    s0 = torch.randn(n, d, w - 1, generator=gen, device=DEV).bfloat16()
    y, st = tri.causal_conv1d_step(x, weight, bias, s0)
    y_ref, st_ref = reference.causal_conv1d_step(*_cpu(x, weight, bias, s0))
    check("conv_step_y", y, y_ref, 1e-2)
    assert not torch.isnan(st).any() and torch.equal(st.cpu(), st_ref), "conv step state must be an exact copy"


@pytest.mark.parametrize("n", [1, 5, 64])
def test_causal_conv1d_step_inplace_matches_reference(poison, n):
    """In-place step on pool rows (x a column view of a wider projection, as the GDN decode reads
    it) vs the reference: y (NaN-poisoned), the target rows exactly, every other row untouched."""
    tri = pytest.importorskip("forkpoint.kernels.conv1d.triton")
    from forkpoint.kernels.conv1d import reference

    gen = torch.Generator(device=DEV).manual_seed(40 + n)
    d, w, rows = 8192 + 64, 4, 2 * n + 5
    wide = torch.randn(n, d + 4160, generator=gen, device=DEV).bfloat16()
    x = wide[:, :d]
    weight = (0.5 * torch.randn(d, w, generator=gen, device=DEV)).bfloat16()
    pool = torch.randn(rows, d, w - 1, generator=gen, device=DEV).bfloat16()
    slots = (torch.randperm(rows - 1, generator=gen, device=DEV)[:n] + 1).long()
    before = pool.clone()
    y = tri.causal_conv1d_step_inplace(x, weight, None, pool, slots)
    torch.cuda.synchronize()
    pool_ref = before.cpu()
    y_ref = reference.causal_conv1d_step_inplace(*_cpu(x, weight), None, pool_ref, slots.cpu())
    check(f"conv_step_inplace_y N={n}", y, y_ref, 1e-2)
    assert torch.equal(pool.cpu(), pool_ref), "pool rows: the targets an exact shift, the others untouched"


@pytest.mark.parametrize("t,h,d,r", [(1, 16, 256, 64), (300, 2, 256, 64), (37, 32, 128, 128), (5, 5, 96, 32)])
def test_rotary_matches_reference(poison, t, h, d, r):
    """Triton rotary vs the reference in fp32 on CPU copies (partial and full rotary, head counts
    that do not fill a block, x a row-strided view): NaN-poisoned output, bf16 tolerance."""
    tri = pytest.importorskip("forkpoint.kernels.rotary.triton")
    from forkpoint.kernels.rotary import reference

    gen = torch.Generator(device=DEV).manual_seed(60 + t + h)
    x = torch.randn(t, h, d + 32, generator=gen, device=DEV).bfloat16()[..., :d]
    angles = 40 * torch.rand(t, r // 2, generator=gen, device=DEV)
    emb = torch.cat([angles, angles], dim=-1)
    cos, sin = emb.cos().bfloat16(), emb.sin().bfloat16()
    y = tri.apply_rotary(x, cos, sin)
    y_ref = reference.apply_rotary(*(v.float() for v in _cpu(x, cos, sin)))
    check(f"rotary T={t} H={h} D={d} R={r}", y, y_ref, 1e-2)
    assert torch.equal(y[..., r:].cpu(), x[..., r:].cpu()), "the pass-through dims must be copied exactly"


# ---------------------------------------------------------------- paged attention

def _paged_case(gen, hq, hkv, dh, block_size):
    """Segments: a fresh prefill (the producer), two consumers whose block tables start with the
    producer's blocks (prefix shared) and add their own, and three decodes with long contexts."""
    prod = 100
    q_lens = [prod, 37, 5, 1, 1, 1]
    seq_lens = [prod, prod + 37, prod + 5, 300, 17, 64]
    nblk = lambda n: -(-n // block_size)  # noqa: E731
    num_blocks = 4 * sum(nblk(s) for s in seq_lens)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables, shared = [], nblk(prod) - 1 if prod % block_size else nblk(prod)
    for n, s in enumerate(seq_lens):
        if n in (1, 2):  # consumers: the producer's full blocks, then their own
            row = tables[0][:shared] + [perm.pop() for _ in range(nblk(s) - shared)]
        else:
            row = [perm.pop() for _ in range(nblk(s))]
        tables.append(row)
    width = max(len(r) for r in tables)
    bt = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, hkv, dh, generator=gen, device=DEV).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, hkv, dh, generator=gen, device=DEV).bfloat16()
    q = torch.randn(sum(q_lens), hq, dh, generator=gen, device=DEV).bfloat16()
    return q, k_cache, v_cache, bt, _offsets(q_lens), seq_lens


@pytest.mark.parametrize("hq,hkv,dh,block_size", [(16, 2, 256, 16), (8, 8, 128, 16), (4, 1, 64, 5)])
def test_paged_attention_matches_reference(poison, hq, hkv, dh, block_size):
    tri = pytest.importorskip("forkpoint.kernels.attention.triton")
    from forkpoint.kernels.attention import reference

    gen = torch.Generator(device=DEV).manual_seed(hq * 1000 + dh)
    q, kc, vc, bt, cu, seq_lens = _paged_case(gen, hq, hkv, dh, block_size)
    scale = dh ** -0.5
    o = tri.paged_attention(q, kc, vc, bt.to(DEV), torch.tensor(cu, device=DEV), cu,
                            torch.tensor(seq_lens, device=DEV), seq_lens, scale=scale)
    o_ref = reference.paged_attention(*_cpu(q, kc, vc, bt), torch.tensor(cu), cu, torch.tensor(seq_lens), seq_lens,
                                      scale=scale)
    check(f"paged_attention HQ={hq} HKV={hkv} Dh={dh} bs={block_size}", o, o_ref, 1e-2)
    # decode-only step (smaller tiles)
    dec = list(range(len(seq_lens) + 1))
    qd = torch.randn(len(seq_lens), hq, dh, generator=gen, device=DEV).bfloat16()
    od = tri.paged_attention(qd, kc, vc, bt.to(DEV), torch.tensor(dec, device=DEV), dec,
                             torch.tensor(seq_lens, device=DEV), seq_lens, scale=scale)
    od_ref = reference.paged_attention(qd.cpu(), kc.cpu(), vc.cpu(), bt, torch.tensor(dec), dec,
                                       torch.tensor(seq_lens), seq_lens, scale=scale)
    check(f"paged_attention decode HQ={hq} HKV={hkv} Dh={dh} bs={block_size}", od, od_ref, 1e-2)


def _decode_case(gen, hq, hkv, dh, block_size, seq_lens, q_len):
    """q_len queries per segment after seq_lens[n] - q_len cached keys, each segment over its own
    shuffled blocks."""
    nblk = [-(-s // block_size) for s in seq_lens]
    perm = torch.randperm(sum(nblk) + 2, generator=torch.Generator().manual_seed(1)).tolist()
    tables = [[perm.pop() for _ in range(b)] for b in nblk]
    width = max(nblk)
    bt = torch.tensor([r + [0] * (width - len(r)) for r in tables], dtype=torch.int32)
    kc = torch.randn(sum(nblk) + 2, block_size, hkv, dh, generator=gen, device=DEV).bfloat16()
    vc = torch.randn(sum(nblk) + 2, block_size, hkv, dh, generator=gen, device=DEV).bfloat16()
    q = torch.randn(q_len * len(seq_lens), hq, dh, generator=gen, device=DEV).bfloat16()
    return q, kc, vc, bt, [q_len * i for i in range(len(seq_lens) + 1)]


# contexts around the split edges: one split (<= DECODE_MIN_CHUNK keys), a few, all DECODE_SPLITS
DECODE_CONTEXTS = [1, 31, 127, 128, 129, 300, 880, 2049, 4352]


@pytest.mark.parametrize("hq,hkv,dh,block_size,q_len", [(16, 2, 256, 16, 1), (16, 2, 256, 16, 2), (8, 8, 128, 16, 16),
                                                        (4, 1, 64, 5, 3)])
def test_split_decode_matches_reference(poison, hq, hkv, dh, block_size, q_len):
    """Decode steps (q_len * G <= 16) run the split-KV kernels; against the reference at contexts
    on both sides of every split edge, one query per segment and several (the causal tail)."""
    tri = pytest.importorskip("forkpoint.kernels.attention.triton")
    from forkpoint.kernels.attention import reference

    assert tri.is_decode_step(q_len, hq // hkv)
    seq_lens = [max(s, q_len) for s in DECODE_CONTEXTS]
    gen = torch.Generator(device=DEV).manual_seed(11 * hq + q_len)
    q, kc, vc, bt, cu = _decode_case(gen, hq, hkv, dh, block_size, seq_lens, q_len)
    o = tri.paged_attention(q, kc, vc, bt.to(DEV), torch.tensor(cu, device=DEV), cu,
                            torch.tensor(seq_lens, device=DEV), seq_lens, scale=dh ** -0.5)
    o_ref = reference.paged_attention(*_cpu(q, kc, vc, bt), torch.tensor(cu), cu, torch.tensor(seq_lens), seq_lens,
                                      scale=dh ** -0.5)
    for n, s in enumerate(seq_lens):
        rows = slice(cu[n], cu[n + 1])
        check(f"split decode HQ={hq} HKV={hkv} Dh={dh} q_len={q_len} ctx={s}", o[rows], o_ref[rows], 1e-2)


def test_split_decode_is_batch_invariant():
    """A segment's decode output is the same bits alone and among others of other lengths (the
    chunking depends on its own kv length only), and in a CUDA graph replay."""
    tri = pytest.importorskip("forkpoint.kernels.attention.triton")
    seq_lens = DECODE_CONTEXTS
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, kc, vc, bt, cu = _decode_case(gen, 16, 2, 256, 16, seq_lens, 1)
    bt = bt.to(DEV)
    together = tri.paged_attention(q, kc, vc, bt, torch.tensor(cu, device=DEV), cu,
                                   torch.tensor(seq_lens, device=DEV), seq_lens, scale=0.0625)
    for n, s in enumerate(seq_lens):
        alone = tri.paged_attention(q[n: n + 1], kc, vc, bt[n: n + 1], torch.tensor([0, 1], device=DEV), [0, 1],
                                    torch.tensor([s], device=DEV), [s], scale=0.0625)
        assert torch.equal(alone, together[n: n + 1]), f"context {s}: alone != in the batch"
    static = [torch.tensor(cu, device=DEV), torch.tensor(seq_lens, device=DEV)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tri.paged_attention(q, kc, vc, bt, static[0], cu, static[1], seq_lens, scale=0.0625)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = tri.paged_attention(q, kc, vc, bt, static[0], cu, static[1], seq_lens, scale=0.0625)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, together), "graph replay != eager"


def _prefill_configs_for(tri, g, dh):
    block_d = max(16, 1 << (dh - 1).bit_length())
    return tri._prune_prefill(list(tri.PREFILL_CONFIGS), {}, G=g, BLOCK_D=block_d, Q_BUCKET=1)


def test_paged_attention_every_prefill_tile_matches_reference(poison):
    """Each tile the autotuner may pick for the Qwen3.5 shape, forced, is correct (the autotuner
    would keep a wrong but fast one)."""
    tri = pytest.importorskip("forkpoint.kernels.attention.triton")
    from forkpoint.kernels.attention import reference

    gen = torch.Generator(device=DEV).manual_seed(7)
    q, kc, vc, bt, cu, seq_lens = _paged_case(gen, 16, 2, 256, 16)
    o_ref = reference.paged_attention(*_cpu(q, kc, vc, bt), torch.tensor(cu), cu, torch.tensor(seq_lens), seq_lens,
                                      scale=0.0625)
    configs = _prefill_configs_for(tri, 8, 256)
    assert any(c.kwargs["BLOCK_M"] == 128 for c in configs), "no 16-position tile left for G=8, Dh=256"
    for c in configs:
        o = tri.paged_attention_with_config(q, kc, vc, bt.to(DEV), torch.tensor(cu, device=DEV), cu,
                                            torch.tensor(seq_lens, device=DEV), seq_lens, scale=0.0625, config=c)
        check(f"paged_attention tile {c}", o, o_ref, 1e-2)


def test_paged_attention_pipeline_stages_do_not_change_the_result(poison):
    """Tiles that differ only in pipeline stages give bit-identical outputs (stages move the K/V loads,
    not the arithmetic), so the autotuner's choice among them never moves a token; on a device with
    Hopper's shared memory the 2-stage 128x64 tile (the fastest on long prefills) is among the choices."""
    tri = pytest.importorskip("forkpoint.kernels.attention.triton")
    gen = torch.Generator(device=DEV).manual_seed(9)
    q, kc, vc, bt, cu, seq_lens = _paged_case(gen, 16, 2, 256, 16)
    args = (bt.to(DEV), torch.tensor(cu, device=DEV), cu, torch.tensor(seq_lens, device=DEV), seq_lens)
    configs = _prefill_configs_for(tri, 8, 256)
    if torch.cuda.get_device_properties(DEV).shared_memory_per_block_optin >= 227 * 1024:
        assert any((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == (128, 64, 8, 2)
                   for c in configs), [str(c) for c in configs]
    by_tile: dict[tuple, list] = {}
    for c in configs:
        by_tile.setdefault((c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps), []).append(c)
    compared = 0
    for group in by_tile.values():
        outputs = [tri.paged_attention_with_config(q, kc, vc, *args, scale=0.0625, config=c) for c in group]
        for c, o in zip(group[1:], outputs[1:]):
            assert not torch.isnan(o).any()
            assert torch.equal(o, outputs[0]), f"{c} differs from {group[0]}"
            compared += 1
    assert compared > 0


def test_paged_attention_autotune_key_is_stable_across_steps():
    """Prefill steps of new lengths reuse the tuned tile: the key holds no raw query length."""
    tri = pytest.importorskip("forkpoint.kernels.attention.triton")
    gen = torch.Generator(device=DEV).manual_seed(8)
    q, kc, vc, bt, cu, seq_lens = _paged_case(gen, 16, 2, 256, 16)
    args = (bt.to(DEV), torch.tensor(cu, device=DEV), cu, torch.tensor(seq_lens, device=DEV), seq_lens)
    tri.paged_attention(q, kc, vc, *args, scale=0.0625)
    tuned = dict(tri.prefill_tuned_configs())
    for q_len in (37, 200):
        cu2, sl2 = [0, q_len], [q_len]
        q2 = torch.randn(q_len, 16, 256, generator=gen, device=DEV).bfloat16()
        tri.paged_attention(q2, kc, vc, bt[:1].to(DEV), torch.tensor(cu2, device=DEV), cu2,
                            torch.tensor(sl2, device=DEV), sl2, scale=0.0625)
    assert tri.prefill_tuned_configs() == tuned


# ---------------------------------------------------------------- MoE

@pytest.mark.parametrize("kernel", ["one_program", "rank"])
@pytest.mark.parametrize("t,e,top_k", [(1, 256, 8), (64, 256, 8), (303, 256, 8), (512, 256, 8), (3, 5, 2),
                                       (100, 128, 6), (3001, 256, 8), (777, 64, 8)])
def test_triton_route_sort_equals_torch_sort(monkeypatch, kernel, t, e, top_k):
    # small steps' routes are sorted by one Triton program, larger ones by one program per expert (the
    # rank kernel, RANK_BLOCK_ROUTES at a time: 3001 x 8 routes end in a partial block), the largest by
    # torch.sort + searchsorted: all must give the same grouping, exactly
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    if kernel == "one_program" and t * top_k > 4096:
        pytest.skip("one program sorts at most 4,096 routes here")
    monkeypatch.setattr(grouped, "MAX_ONE_PROGRAM_ROUTES", 4096 if kernel == "one_program" else 0)
    monkeypatch.setattr(grouped, "MAX_RANK_ROUTES", 1 << 20)
    gen = torch.Generator().manual_seed(t * e + top_k)
    ids = torch.stack([torch.randperm(e, generator=gen)[:top_k] for _ in range(t)])
    if t > 1:
        ids[-1] = ids[0]  # two tokens on the same experts: ties resolved in route order
    ids = ids.to(DEV)
    empty = torch.empty

    def poisoned(*args, **kwargs):  # integer outputs too: an unwritten element shows as -7
        return empty(*args, **kwargs).fill_(-7)

    monkeypatch.setattr(torch, "empty", poisoned)
    monkeypatch.setattr(torch, "empty_like", lambda t, **kw: poisoned(t.shape, dtype=kw.get("dtype", t.dtype),
                                                                      device=t.device))
    one = grouped._sorted_routes(ids, e)
    monkeypatch.setattr(grouped, "MAX_ONE_PROGRAM_ROUTES", 0)
    monkeypatch.setattr(grouped, "MAX_RANK_ROUTES", 0)
    ref = grouped._sorted_routes(ids, e)
    for name in ("pos", "tokens"):
        assert torch.equal(getattr(one, name), getattr(ref, name)), name
    assert torch.equal(one.rows.offs, ref.rows.offs)
    hit = sorted(set(ids.flatten().tolist()))  # the one program lists the hit experts, torch's path all
    assert one.rows.num_active.item() == len(hit) and one.rows.active[: len(hit)].tolist() == hit
    assert one.rows.slots == min(e, t * top_k)
    assert ref.rows.active.tolist() == list(range(e)) and ref.rows.num_active.item() == ref.rows.slots == e
    assert sorted(one.pos.tolist()) == list(range(t * top_k))


# (600, 64, 8): 4,800 routes, sorted by torch.sort; the others by the one-program sort. Each case
# through the Triton tiles (the default up to 64 routes per expert) and through the grouped GEMMs.
@pytest.mark.parametrize("path", ["tiled", "grouped_mm"])
@pytest.mark.parametrize("t,e,top_k,hidden,inter", [(100, 16, 4, 256, 128), (7, 64, 8, 512, 64), (600, 64, 8, 256, 64)])
def test_grouped_moe_matches_reference(poison, force_moe_path, path, t, e, top_k, hidden, inter):
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    force_moe_path(path)
    from forkpoint.kernels.moe import reference

    gen = torch.Generator(device=DEV).manual_seed(t * e)
    x = torch.randn(t, hidden, generator=gen, device=DEV).bfloat16()
    gate_up = (torch.randn(e, 2 * inter, hidden, generator=gen, device=DEV) / math.sqrt(hidden)).bfloat16()
    down = (torch.randn(e, hidden, inter, generator=gen, device=DEV) / math.sqrt(inter)).bfloat16()
    logits = torch.randn(t, e, generator=gen, device=DEV)
    logits[:, : e // 2] -= 100.0  # half the experts get no tokens: empty groups
    weights, ids = logits.softmax(-1).topk(top_k)
    y = grouped.fused_moe(x, gate_up, down, weights, ids)
    y_ref = reference.fused_moe(*_cpu(x, gate_up, down, weights, ids))
    check(f"moe_grouped {path} T={t} E={e} k={top_k}", y, y_ref, 1e-2)
    # with the shared expert's gated output and the residual added in the combine
    shared, residual = (torch.randn(t, hidden, generator=gen, device=DEV).bfloat16() for _ in range(2))
    shared_gate = torch.randn(t, 1, generator=gen, device=DEV).bfloat16()
    extras = dict(shared=shared, shared_gate=shared_gate, residual=residual)
    y = grouped.fused_moe(x, gate_up, down, weights, ids, **extras)
    y_ref = reference.fused_moe(*_cpu(x, gate_up, down, weights, ids), **{k: v.cpu() for k, v in extras.items()})
    check(f"moe_grouped+shared+residual {path} T={t} E={e} k={top_k}", y, y_ref, 1e-2)


@pytest.mark.parametrize("path", ["tiled", "grouped_mm"])
@pytest.mark.parametrize("t,e,top_k,hidden,inter", [(100, 16, 4, 256, 128), (7, 64, 6, 2688, 1856 // 8)])
def test_grouped_relu2_moe_matches_reference(poison, force_moe_path, path, t, e, top_k, hidden, inter):
    """Nemotron's non-gated ReLU^2 experts (second case: Nemotron-3-Nano's hidden size, k = 6)."""
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    force_moe_path(path)
    from forkpoint.kernels.moe import reference

    gen = torch.Generator(device=DEV).manual_seed(t + e)
    x = torch.randn(t, hidden, generator=gen, device=DEV).bfloat16()
    up = (torch.randn(e, inter, hidden, generator=gen, device=DEV) / math.sqrt(hidden)).bfloat16()
    down = (torch.randn(e, hidden, inter, generator=gen, device=DEV) / math.sqrt(inter)).bfloat16()
    logits = torch.randn(t, e, generator=gen, device=DEV)
    logits[:, : e // 2] -= 100.0  # half the experts get no tokens: empty groups
    weights, ids = logits.sigmoid().topk(top_k)
    y = grouped.fused_moe_relu2(x, up, down, weights, ids)
    y_ref = reference.fused_moe_relu2(*_cpu(x, up, down, weights, ids))
    check(f"moe_grouped_relu2 {path} T={t} E={e} k={top_k}", y, y_ref, 1e-2)
    residual = torch.randn(t, hidden, generator=gen, device=DEV).bfloat16()
    y = grouped.fused_moe_relu2(x, up, down, weights, ids, residual=residual)
    check(f"moe_grouped_relu2+residual {path} T={t} E={e} k={top_k}", y,
          reference.fused_moe_relu2(*_cpu(x, up, down, weights, ids), residual=residual.cpu()), 1e-2)


# ---------------------------------------------------------------- dispatch and host syncs

@pytest.mark.parametrize(
    "op,variant,fn,nargs",
    [
        ("gated_delta", "fla", "chunk_gated_delta_rule", 8),
        ("gated_delta", "fla", "recurrent_gated_delta_rule", 6),
        ("gated_delta", "triton", "recurrent_gated_delta_rule_inplace", 7),
        ("conv1d", "triton", "causal_conv1d_varlen", 6),
        ("conv1d", "triton", "causal_conv1d_step", 4),
        ("conv1d", "triton", "causal_conv1d_step_inplace", 5),
        ("ssd", "fla", "chunk_ssd", 8),
        ("ssd", "triton", "ssd_step_inplace", 7),
        ("ssd", "triton", "softplus_dt", 4),
        ("rotary", "triton", "apply_rotary", 3),
        ("attention", "triton", "paged_attention", 8),
        ("moe", "grouped", "fused_moe", 5),
        ("moe", "grouped", "topk_softmax", 4),
    ],
)
def test_dispatch_sends_cuda_tensors_to_gpu_variant(monkeypatch, op, variant, fn, nargs):
    import importlib

    module = pytest.importorskip(f"forkpoint.kernels.{op}.{variant}")
    public = importlib.import_module(f"forkpoint.kernels.{op}")
    monkeypatch.setattr(module, fn, lambda *a, **k: variant)
    args = [torch.zeros(1, device=DEV)] * nargs
    kwargs = {"scale": 1.0} if op == "attention" else {}
    assert getattr(public, fn)(*args, **kwargs) == variant


def _no_sync(fn):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_prefill_ops_no_host_sync():
    """Warm up (fla autotunes, syncing), then new offsets with the same token count: no sync."""
    fla = pytest.importorskip("forkpoint.kernels.gated_delta.fla")
    tri = pytest.importorskip("forkpoint.kernels.conv1d.triton")
    gdn = pytest.importorskip("forkpoint.kernels.gated_delta.triton")
    gen = torch.Generator(device=DEV).manual_seed(9)
    slots = torch.tensor([5, 2, 4, 1], device=DEV)
    x = torch.randn(256, 1024, generator=gen, device=DEV).bfloat16()
    weight = torch.randn(1024, 4, generator=gen, device=DEV).bfloat16()
    q, k, v, g, beta, _ = _gdn_inputs(gen, [256], 4, 8, 128, 128)

    def run(lens):
        cu = _offsets(lens)
        cu_dev = torch.tensor(cu).pin_memory().to(DEV, non_blocking=True)
        s0 = torch.zeros(len(lens), 8, 128, 128, device=DEV)
        c0 = torch.zeros(len(lens), 1024, 3, device=DEV, dtype=torch.bfloat16)
        tri.causal_conv1d_varlen(x, weight, None, c0, cu_dev, cu)
        fla.chunk_gated_delta_rule(q, k, v, g, beta, s0, cu_dev, cu)
        fla.recurrent_gated_delta_rule(q[:4], k[:4], v[:4], g[:4], beta[:4], s0[:1].expand(4, -1, -1, -1))
        pool = torch.zeros(6, 8, 128, 128, device=DEV)
        gdn.recurrent_gated_delta_rule_inplace(q[:4], k[:4], v[:4], g[:4], beta[:4], pool, slots)
        tri.causal_conv1d_step(x[:4], weight, None, c0[:1].expand(4, -1, -1))
        tri.causal_conv1d_step_inplace(x[:4, :1000], weight[:1000], None, torch.zeros(6, 1000, 3, device=DEV,
                                                                                    dtype=torch.bfloat16), slots)

    run([100, 100, 56])
    _no_sync(lambda: run([64, 1, 191]))


def test_paged_attention_and_moe_no_host_sync():
    tri = pytest.importorskip("forkpoint.kernels.attention.triton")
    grouped = pytest.importorskip("forkpoint.kernels.moe.grouped")
    gen = torch.Generator(device=DEV).manual_seed(10)
    q, kc, vc, bt, cu, seq_lens = _paged_case(gen, 16, 2, 256, 16)
    bt, cu_dev, sl_dev = bt.to(DEV), torch.tensor(cu, device=DEV), torch.tensor(seq_lens, device=DEV)
    x = torch.randn(64, 256, generator=gen, device=DEV).bfloat16()
    gate_up = torch.randn(8, 256, 256, generator=gen, device=DEV).bfloat16()
    down = torch.randn(8, 256, 128, generator=gen, device=DEV).bfloat16()
    up = torch.randn(8, 128, 256, generator=gen, device=DEV).bfloat16()
    weights, ids = torch.randn(64, 8, generator=gen, device=DEV).softmax(-1).topk(2)

    def run():
        tri.paged_attention(q, kc, vc, bt, cu_dev, cu, sl_dev, seq_lens, scale=0.0625)
        grouped.fused_moe(x, gate_up, down, weights, ids)
        grouped.fused_moe_relu2(x, up, down, weights, ids)
        grouped.topk_softmax(x[:, :8], 2, True, torch.bfloat16)
        rotary.apply_rotary(q, cos, sin)

    rotary = pytest.importorskip("forkpoint.kernels.rotary.triton")
    cos, sin = (torch.rand(q.shape[0], 64, generator=gen, device=DEV).bfloat16() for _ in range(2))
    run()
    _no_sync(run)
