"""Mamba2 SSD kernels of our own in Triton (GPU variants of ``reference.py``; same signatures and
semantics), and the fused glue of the fla prefill (``fla.py``).

``ssd_step_inplace`` -- grid (N sequences, H heads, P / BP blocks). Program (n, h, b) owns the tile

    state_pool[slots[n], h, b*BP:(b+1)*BP, :]        [BP, N] fp32, N contiguous

loads it from the pool row, decays it by exp(dt A_h), adds dt x B^T (B of head h's group), stores
it back and writes y = H C + D x for its BP outputs (into `out`, which may be strided). Rows of P
are independent, so no program shares data with another as long as ``slots`` are distinct (the
documented precondition).

``softplus_dt`` -- clamp(softplus(dt + dt_bias), dt_min, dt_max) in fp32, one launch (BLOCK_T
tokens x all H heads per program).

``ssd_prologue`` / ``ssd_epilogue`` -- the elementwise work around fla's simple-GLA kernels, one
launch each: the prologue runs one program per (64-token chunk, head) over the chunk list of the
packed batch (``conv1d.triton.chunk_indices``) and writes the kernels' inputs (q, k per group, k
per head, v = x dt, and g = the in-chunk cumulative sum of dt A times 1/ln 2); the epilogue adds
D's skip term and writes y in x.dtype into a caller's (strided) view. No host synchronisation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from forkpoint.kernels.ssd.reference import _check, check_out, check_pool


@triton.jit
def _ssd_step_kernel(x, dt, A, B, C, D, pool, slots, y, stride_xn, stride_xh, stride_bn, stride_bg,
                     stride_cn, stride_cg, stride_yn, stride_yh, H: tl.constexpr, P: tl.constexpr,
                     N: tl.constexpr, GROUP: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
                     HAS_D: tl.constexpr):
    i_n, i_h, i_p = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    i_g = i_h // GROUP
    o_p = i_p * BP + tl.arange(0, BP)
    o_s = tl.arange(0, BN)
    m_p, m_s = o_p < P, o_s < N
    b_x = tl.load(x + i_n * stride_xn + i_h * stride_xh + o_p, mask=m_p, other=0.0).to(tl.float32)
    b_b = tl.load(B + i_n * stride_bn + i_g * stride_bg + o_s, mask=m_s, other=0.0).to(tl.float32)
    b_c = tl.load(C + i_n * stride_cn + i_g * stride_cg + o_s, mask=m_s, other=0.0).to(tl.float32)
    b_dt = tl.load(dt + i_n * H + i_h).to(tl.float32)
    b_a = tl.load(A + i_h).to(tl.float32)
    slot = tl.load(slots + i_n).to(tl.int64)
    p_s = pool + (slot * H + i_h) * P * N + o_p[:, None] * N + o_s[None, :]
    m_ps = m_p[:, None] & m_s[None, :]
    b_s = tl.load(p_s, mask=m_ps, other=0.0)
    b_s = b_s * tl.exp(b_dt * b_a) + (b_x * b_dt)[:, None] * b_b[None, :]
    tl.store(p_s, b_s, mask=m_ps)
    b_y = tl.sum(b_s * b_c[None, :], axis=1)
    if HAS_D:
        b_y = b_y + tl.load(D + i_h).to(tl.float32) * b_x
    tl.store(y + i_n * stride_yn + i_h * stride_yh + o_p, b_y.to(y.dtype.element_ty), mask=m_p)


def ssd_step_inplace(x, dt, A, B, C, state_pool, slots, *, D=None, out=None):
    """x: [N, H, P]; dt: [N, H]; A: [H]; B, C: [N, G, N] (last dims contiguous); state_pool:
    [S, H, P, N] fp32, contiguous, rows ``slots`` [N] (distinct; not checked, that would sync)
    read and overwritten; out: [N, H, P] in x.dtype (strided view allowed) or None. Returns y
    [N, H, P] in x.dtype (`out` when given). One launch, no host synchronisation."""
    _check(x, dt, A, B, C, D)
    check_pool(state_pool, slots, x, B)
    check_out(out, x)
    if not state_pool.is_contiguous():
        raise ValueError("state_pool must be contiguous: the kernel writes its rows in place")
    n, heads, head_dim = x.shape
    groups, state_dim = B.shape[1:]
    x, B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (x, B, C))
    dt, A = dt.float().contiguous(), A.float().contiguous()
    y = out if out is not None else torch.empty(n, heads, head_dim, dtype=x.dtype, device=x.device)
    if n == 0:
        return y
    bp = min(16, triton.next_power_of_2(head_dim))
    grid = (n, heads, triton.cdiv(head_dim, bp))
    _ssd_step_kernel[grid](x, dt, A, B, C, D if D is not None else A, state_pool, slots, y,
                           x.stride(0), x.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
                           y.stride(0), y.stride(1), H=heads, P=head_dim, N=state_dim, GROUP=heads // groups,
                           BP=bp, BN=triton.next_power_of_2(state_dim), HAS_D=D is not None, num_warps=4)
    return y


@triton.jit(do_not_specialize=["T"])
def _softplus_dt_kernel(dt, bias, out, T, H, stride_t, dt_min, dt_max, BLOCK_T: tl.constexpr,
                        BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_H)
    m_h = cols < H
    mask = (rows < T)[:, None] & m_h[None, :]
    r = rows.to(tl.int64)[:, None]
    v = tl.load(dt + r * stride_t + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    v = v + tl.load(bias + cols, mask=m_h, other=0.0).to(tl.float32)[None, :]
    # torch's softplus: log1p(exp(v)), v itself above 20; log1p(u) = u * log(1 + u) / ((1 + u) - 1),
    # exact where 1 + u rounds to 1 (Goldberg's trick, no log1p needed)
    u = tl.exp(tl.minimum(v, 20.0))
    w = 1.0 + u
    d = w - 1.0
    log1p_u = tl.where(d == 0.0, u, tl.log(w) * (u / tl.where(d == 0.0, 1.0, d)))
    sp = tl.where(v > 20.0, v, log1p_u)
    tl.store(out + r * H + cols[None, :], tl.minimum(tl.maximum(sp, dt_min), dt_max), mask=mask)


def softplus_dt(dt, dt_bias, dt_min, dt_max):
    """See ``reference.softplus_dt``: dt [T, H] (row strides allowed, last dim contiguous or not),
    dt_bias [H] -> [T, H] fp32, a new tensor. One launch."""
    if dt.dim() != 2 or dt_bias.shape != (dt.shape[1],):
        raise ValueError(f"dt must be [T, H] and dt_bias [H], got {tuple(dt.shape)} and {tuple(dt_bias.shape)}")
    tokens, heads = dt.shape
    out = torch.empty((tokens, heads), dtype=torch.float32, device=dt.device)
    if out.numel() == 0:
        return out
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    block_h = triton.next_power_of_2(heads)
    block_t = max(1, 1024 // block_h)
    _softplus_dt_kernel[(triton.cdiv(tokens, block_t),)](dt, dt_bias.contiguous(), out, tokens, heads, dt.stride(0),
                                                        float(dt_min), float(dt_max), BLOCK_T=block_t,
                                                        BLOCK_H=block_h, num_warps=4)
    return out


@triton.jit
def _prologue_kernel(x, dt, A, B, C, q, k, kh, v, g, cu_seqlens, chunk_idx, scale, stride_xt, stride_xh,
                     stride_dt, stride_bt, stride_bg, stride_ct, stride_cg, H: tl.constexpr, G: tl.constexpr,
                     P: tl.constexpr, N: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_g = i_h // (H // G)
    i_n = tl.load(chunk_idx + 2 * i_c).to(tl.int64)
    i_t = tl.load(chunk_idx + 2 * i_c + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    o_t = i_t * BT + tl.arange(0, BT)
    m_t = o_t < T
    r = bos + o_t
    # g: cumulative dt A within the chunk (fla's chunk_local_cumsum), times 1/ln 2 (fla uses exp2)
    b_dt = tl.load(dt + r * stride_dt + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.cumsum(b_dt * tl.load(A + i_h).to(tl.float32), axis=0) * scale
    tl.store(g + r * H + i_h, b_g, mask=m_t)
    # v = x dt, rounded to x's dtype
    o_p = tl.arange(0, BP)
    m_tp = m_t[:, None] & (o_p < P)[None, :]
    b_x = tl.load(x + r[:, None] * stride_xt + i_h * stride_xh + o_p[None, :], mask=m_tp, other=0.0)
    tl.store(v + (r[:, None] * H + i_h) * P + o_p[None, :], (b_x.to(tl.float32) * b_dt[:, None]).to(v.dtype.element_ty),
             mask=m_tp)
    # k per head (B of the head's group); q and k per group from the group's first head
    o_s = tl.arange(0, BN)
    m_ts = m_t[:, None] & (o_s < N)[None, :]
    b_b = tl.load(B + r[:, None] * stride_bt + i_g * stride_bg + o_s[None, :], mask=m_ts, other=0.0)
    tl.store(kh + (r[:, None] * H + i_h) * N + o_s[None, :], b_b.to(kh.dtype.element_ty), mask=m_ts)
    if i_h % (H // G) == 0:
        tl.store(k + (r[:, None] * G + i_g) * N + o_s[None, :], b_b.to(k.dtype.element_ty), mask=m_ts)
        b_c = tl.load(C + r[:, None] * stride_ct + i_g * stride_cg + o_s[None, :], mask=m_ts, other=0.0)
        tl.store(q + (r[:, None] * G + i_g) * N + o_s[None, :], b_c.to(q.dtype.element_ty), mask=m_ts)


def ssd_prologue(x, dt, A, B, C, cu_seqlens, chunk_idx, *, chunk_size, scale):
    """The inputs of fla's simple-GLA kernels for the SSD scan, one launch.

    x: [T, H, P]; dt: [T, H] (used in fp32); A: [H]; B, C: [T, G, N] (last dims contiguous, row
    and group strides free: views of the conv output); cu_seqlens: [Nseq+1] long; chunk_idx:
    [NT, 2] long, the (segment, chunk) list for `chunk_size` (``conv1d.triton.chunk_indices``).
    Returns new contiguous tensors, all but g in x.dtype:
    q = C [T, G, N], k = B [T, G, N], k_heads = B per head [T, H, N] (head h reads group
    h // (H / G)), v = x dt [T, H, P] and g [T, H] fp32 = scale * (the cumulative sum of dt A
    within each chunk of each segment).
    """
    tokens, heads, head_dim = x.shape
    groups, state_dim = B.shape[1:]
    if x.stride(-1) != 1:
        x = x.contiguous()
    B, C = (t if t.stride(-1) == 1 else t.contiguous() for t in (B, C))
    dt, A = (t.float() if t.stride(-1) == 1 else t.float().contiguous() for t in (dt, A))
    q = torch.empty((tokens, groups, state_dim), dtype=x.dtype, device=x.device)
    k = torch.empty_like(q)
    k_heads = torch.empty((tokens, heads, state_dim), dtype=x.dtype, device=x.device)
    v = torch.empty((tokens, heads, head_dim), dtype=x.dtype, device=x.device)
    g = torch.empty((tokens, heads), dtype=torch.float32, device=x.device)
    if chunk_idx.shape[0]:
        _prologue_kernel[(chunk_idx.shape[0], heads)](
            x, dt, A, B, C, q, k, k_heads, v, g, cu_seqlens, chunk_idx, float(scale), x.stride(0), x.stride(1),
            dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1), H=heads, G=groups, P=head_dim,
            N=state_dim, BT=chunk_size, BP=triton.next_power_of_2(head_dim), BN=triton.next_power_of_2(state_dim),
            num_warps=4)
    return q, k, k_heads, v, g


@triton.jit(do_not_specialize=["T"])  # the step's token count: one variant for any count
def _epilogue_kernel(o, x, D, y, T, stride_xt, stride_xh, stride_yt, stride_yh, H: tl.constexpr,
                     P: tl.constexpr, BT: tl.constexpr, BP: tl.constexpr, HAS_D: tl.constexpr):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    r = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_p = tl.arange(0, BP)
    mask = (r < T)[:, None] & (o_p < P)[None, :]
    b_y = tl.load(o + (r[:, None] * H + i_h) * P + o_p[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_D:
        b_x = tl.load(x + r[:, None] * stride_xt + i_h * stride_xh + o_p[None, :], mask=mask, other=0.0)
        b_y = b_y + tl.load(D + i_h).to(tl.float32) * b_x.to(tl.float32)
    tl.store(y + r[:, None] * stride_yt + i_h * stride_yh + o_p[None, :], b_y.to(y.dtype.element_ty), mask=mask)


def ssd_epilogue(o, x, D, out):
    """y = o + D x (fp32 math) in out's dtype, written into `out`, one launch. o: [T, H, P]
    contiguous (fla's output); x: [T, H, P] (last dim contiguous); D: [H] or None (then y = o);
    out: [T, H, P] (strided view allowed, last dim contiguous). Returns out."""
    tokens, heads, head_dim = x.shape
    if tokens == 0:
        return out
    if x.stride(-1) != 1:
        x = x.contiguous()
    bp = triton.next_power_of_2(head_dim)
    bt = max(1, 4096 // bp)
    _epilogue_kernel[(triton.cdiv(tokens, bt), heads)](o, x, D if D is not None else o, out, tokens, x.stride(0),
                                                     x.stride(1), out.stride(0), out.stride(1), H=heads, P=head_dim,
                                                     BT=bt, BP=bp, HAS_D=D is not None, num_warps=4)
    return out
