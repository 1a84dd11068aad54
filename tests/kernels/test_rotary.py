"""Rotary embedding (reference, the CPU path) against transformers' Qwen3-Next `apply_rotary_pos_emb`,
partial and full rotary."""

import pytest
import torch
from transformers.models.qwen3_next.modeling_qwen3_next import apply_rotary_pos_emb

from forkpoint.kernels.rotary import apply_rotary


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
