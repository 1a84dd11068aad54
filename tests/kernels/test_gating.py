"""Gated DeltaNet gating (CPU path = the reference) against transformers' two lines, bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from forkpoint.kernels.gating import gdn_gating


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads", [(1, 4), (7, 6), (0, 4)])
def test_equals_transformers_gating(dtype, tokens, heads):
    gen = torch.Generator().manual_seed(tokens * 10 + heads)
    ab = (8 * torch.randn(tokens, 2 * heads, generator=gen)).to(dtype)
    a, b = ab[:, :heads], ab[:, heads:]  # views of one fused projection
    A_log = torch.randn(heads, generator=gen).to(dtype)
    dt_bias = torch.randn(heads, generator=gen).to(dtype)
    g, beta = gdn_gating(a, b, A_log, dt_bias)
    # transformers' Qwen3NextGatedDeltaNet.forward
    beta_hf = b.sigmoid()
    g_hf = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    assert torch.equal(g, g_hf) and torch.equal(beta, beta_hf)
    assert (g <= 0).all()


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match=r"expected a, b \[T, HV\]"):
        gdn_gating(torch.zeros(3, 4), torch.zeros(3, 4), torch.zeros(5), torch.zeros(4))
    with pytest.raises(ValueError, match=r"expected a, b \[T, HV\]"):
        gdn_gating(torch.zeros(3, 4), torch.zeros(2, 4), torch.zeros(4), torch.zeros(4))
