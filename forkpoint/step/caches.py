"""The device tensors a model's forward reads and writes: the pools' rows, handed over per forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerCaches:
    """Cache tensors handed to the model for one forward.

    conv[i]: [S, conv_dim, W-1] and ssm[i]: [S, ...] fp32 (GDN: [S, HV, K, V]; Mamba2: [S, H, P, N])
    for the i-th recurrent layer (row 0 is the all-zero slot); k[j], v[j]: [num_blocks, block_size,
    HKV, Dh] for the j-th attention layer. conv_stack: [L, S, conv_dim, W-1] and ssm_stack: [L, S, ...],
    when given, hold the L recurrent layers' states with conv[i] / ssm[i] their views
    (cache/state_pool.py): the piecewise forward then runs every recurrent core through one graph
    (`CausalLM.recurrent_core`, models/interface.py).
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    conv_stack: torch.Tensor | None = None
    ssm_stack: torch.Tensor | None = None
