"""Rotary embedding (reference, the CPU path) against transformers' Qwen3-Next `apply_rotary_pos_emb`,
partial and full rotary; the fused q/k norm + rotary against the unfused sequence (GPU variant:
tests/kernels/test_gpu_attention_fusion.py)."""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

from forkpoint.kernels.norms import rms_norm
from forkpoint.kernels.rotary import apply_rotary, qk_norm_rotary_


def _case(tokens, heads, head_dim, rotary_dim, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, heads, head_dim, generator=gen)
    angles = torch.randn(tokens, rotary_dim // 2, generator=gen) * 10
    emb = torch.cat([angles, angles], dim=-1)
    return x, emb.cos(), emb.sin()


@pytest.mark.parametrize("heads,head_dim,rotary_dim", [(4, 32, 8), (3, 16, 16)])
def test_rotary_equals_transformers(heads, head_dim, rotary_dim):
    x, cos, sin = _case(7, heads, head_dim, rotary_dim, seed=head_dim)
    # transformers: q, k [B, heads, T, head_dim], cos / sin [B, T, rotary_dim]
    theirs, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], cos[None], sin[None])
    assert torch.equal(apply_rotary(x, cos, sin), theirs[0].transpose(0, 1))


def test_rotary_keeps_the_pass_through_dims_and_rejects_bad_shapes():
    x, cos, sin = _case(3, 2, 16, 4, seed=1)
    y = apply_rotary(x, cos, sin)
    assert torch.equal(y[..., 4:], x[..., 4:]) and not torch.equal(y[..., :4], x[..., :4])
    with pytest.raises(ValueError, match="rotary_dim"):
        apply_rotary(x, torch.ones(3, 18), torch.ones(3, 18))
    with pytest.raises(ValueError, match=r"\[T, heads, head_dim\]"):
        apply_rotary(x, cos[:2], sin[:2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,q_heads,kv_heads,head_dim,rotary_dim",
                         [(7, 4, 2, 32, 8), (1, 3, 3, 16, 16), (0, 4, 1, 32, 8)])
def test_qk_norm_rotary_equals_the_unfused_sequence(dtype, tokens, q_heads, kv_heads, head_dim, rotary_dim):
    """In place on the column views of a stacked projection (q interleaved with the gate), exactly
    rms_norm then apply_rotary for each of q and k; the gate and v columns untouched."""
    gen = torch.Generator().manual_seed(tokens + head_dim)
    widths = [q_heads * 2 * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    stacked = (3 * torch.randn(tokens, sum(widths), generator=gen)).to(dtype)
    before = stacked.clone()
    q_gate, k, _ = stacked.split(widths, dim=-1)
    q = q_gate.view(tokens, q_heads, 2 * head_dim)[..., :head_dim]
    k = k.view(tokens, kv_heads, head_dim)
    wq, wk = ((0.2 * torch.randn(head_dim, generator=gen)).to(dtype) for _ in range(2))
    _, cos, sin = _case(tokens, 1, head_dim, rotary_dim, seed=3)
    cos, sin = cos.to(dtype), sin.to(dtype)
    q_ref = apply_rotary(rms_norm(q, wq, 1e-6), cos, sin)
    k_ref = apply_rotary(rms_norm(k, wk, 1e-6), cos, sin)
    out_q, out_k = qk_norm_rotary_(q, k, wq, wk, 1e-6, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(q, q_ref) and torch.equal(k, k_ref)
    untouched = torch.ones(sum(widths), dtype=torch.bool)
    untouched[:widths[0]].view(q_heads, 2 * head_dim)[:, :head_dim] = False
    untouched[widths[0]:widths[0] + widths[1]] = False
    assert torch.equal(stacked[:, untouched], before[:, untouched])


def test_qk_norm_rotary_rejects_bad_shapes():
    q, k, w = torch.zeros(3, 4, 16), torch.zeros(3, 2, 16), torch.zeros(16)
    cos = torch.ones(3, 8)
    with pytest.raises(ValueError, match="share head_dim and dtype"):
        qk_norm_rotary_(q, torch.zeros(3, 2, 8), w, w, 1e-6, cos[:, :4], cos[:, :4])
    with pytest.raises(ValueError, match="share head_dim and dtype"):
        qk_norm_rotary_(q, k.bfloat16(), w, w, 1e-6, cos, cos)
    with pytest.raises(ValueError, match=r"q_weight and k_weight must be \[head_dim\]"):
        qk_norm_rotary_(q, k, w, torch.zeros(8), 1e-6, cos, cos)
    with pytest.raises(ValueError, match="rotary_dim"):
        qk_norm_rotary_(q, k, w, w, 1e-6, torch.ones(3, 18), torch.ones(3, 18))
