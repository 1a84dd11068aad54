"""The Mamba2 mixer and the blocks the Mamba2 hybrids share (Nemotron-H, Granite-4.0-H, Falcon-H1).

The mixer runs like the Gated DeltaNet layer of models/qwen3_5.py, in three parts:

    project   token-wise: in_proj -> gate z [T, I], xBC [T, I + 2 G N] and dt [T, H] fp32
              (softplus(dt + dt_bias), clamped to the configured limits)      -> Mamba2Projection
    core      varlen, reads the ForwardBatch and the pools: causal conv over xBC, then the SSD scan
              per decode group and phase (two-phase prefill: phases start from the zero row,
              private slots or checkpoint rows and write their final states to `dest_slots`)
                                                                              -> [T, H, P]
    finish    token-wise: gated RMSNorm over groups, out_proj                 -> [T, hidden]

Per sequence it keeps a conv state [conv_dim, W-1] (model dtype) and an SSM state [H, P, N]
(float32), declared by `Mamba2Mixer.state_spec` for the state pool.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from forkpoint.cache.state_pool import RecurrentStateSpec
from forkpoint.config import ModelConfig
from forkpoint.kernels.conv1d import causal_conv1d_step_inplace, causal_conv1d_varlen
from forkpoint.kernels.norms import group_mean_square, grouped_gated_rms_norm, rms_norm
from forkpoint.kernels.rotary import apply_rotary
from forkpoint.kernels.ssd import chunk_ssd, softplus_dt, ssd_step_inplace
from forkpoint.mamba2_config import Mamba2Config
from forkpoint.models.attention_core import attention_core
from forkpoint.models.recurrent import two_phase_core
from forkpoint.step.batch import ForwardBatch


class PlainRMSNorm(nn.Module):
    """RMSNorm `w * x / rms(x)` (weight not centred), fp32 math, result in x.dtype.

    `forward(x)`: [..., dim] -> [..., dim]. `forward(x, residual)` fuses the pre-norm residual add:
    with `s = residual + x` (in x.dtype, exactly the unfused `hidden = residual + x`) it returns
    `(norm(s), s)`. One kernel on CUDA (kernels/norms `rms_norm(centred=False)`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual, centred=False)


class GroupedGatedRMSNorm(nn.Module):
    """Mamba2's gated RMSNorm over `groups` groups of the I channels (weight [I], not centred):
    `w * norm_g(y * silu(z))`, or `w * norm_g(y) * silu(z)` when `norm_before_gate` (Falcon-H1's
    option). y, z: [T, I] -> [T, I] in y.dtype, fp32 math; one kernel on CUDA (kernels/norms
    `grouped_gated_rms_norm`) unless a subclass overrides `mean_square`."""

    def __init__(self, dim: int, groups: int, eps: float, norm_before_gate: bool) -> None:
        super().__init__()
        self.groups, self.eps, self.norm_before_gate = groups, eps, norm_before_gate
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        plain = type(self).mean_square is GroupedGatedRMSNorm.mean_square
        return grouped_gated_rms_norm(y, z, self.weight, self.groups, self.eps, self.norm_before_gate,
                                      mean_square=None if plain else self.mean_square)

    def mean_square(self, grouped: torch.Tensor) -> torch.Tensor:
        """grouped: [T, groups, I / groups] fp32 -> the mean of squares per group, [T, groups, 1]
        (a tensor-parallel rank holding part of a group sums over the ranks instead)."""
        return group_mean_square(grouped)


class Mamba2Projection(NamedTuple):
    """Token-wise outputs of the Mamba2 input projection (T rows each)."""

    xbc: torch.Tensor  # [T, conv_dim]: x, B, C channels before the causal convolution
    z: torch.Tensor  # [T, I]: output gate
    dt: torch.Tensor  # [T, H] float32: step sizes, softplus'd and clamped


class Mamba2CoreParams(NamedTuple):
    """The per-layer parameters a Mamba2 core reads (all else is per token, from the projection)."""

    conv_weight: torch.Tensor  # [conv_dim, W]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A_log: torch.Tensor  # [H]
    D: torch.Tensor  # [H]


class _ScanArgs(NamedTuple):
    """What the conv and scan kernels read, derived from `Mamba2CoreParams` once per core call."""

    conv_weight: torch.Tensor  # [conv_dim, W]
    conv_bias: torch.Tensor | None  # [conv_dim]
    A: torch.Tensor  # [H] fp32: -exp(A_log)
    D: torch.Tensor  # [H]


class QKVProjection(NamedTuple):
    """Token-wise outputs of a plain attention layer's projections (T rows each)."""

    q: torch.Tensor  # [T, HQ, Dh]: rotated (when the model has rotary)
    k: torch.Tensor  # [T, HKV, Dh]: rotated, times key_multiplier
    v: torch.Tensor  # [T, HKV, Dh]


class Mamba2Mixer(nn.Module):
    """Mamba2 token mixer with packed two-phase execution: the driver of models/recurrent.py with
    its conv and SSD kernels plugged in (`decode_step`, `phase_scan`). Parameter names follow the
    HF checkpoints: in_proj, conv1d, dt_bias, A_log, D, norm, out_proj."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        m: Mamba2Config = config.mamba2.mamba
        self.m = m
        self.num_heads, self.head_dim = m.num_heads, m.head_dim
        self.n_groups, self.state_size = m.n_groups, m.state_size
        self.intermediate = m.intermediate_size
        conv_dim = m.conv_dim
        self.in_proj = nn.Linear(config.hidden_size, self.intermediate + conv_dim + m.num_heads, bias=m.in_proj_bias)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, m.conv_kernel, groups=conv_dim, bias=m.conv_bias)
        self.dt_bias = nn.Parameter(torch.ones(m.num_heads))
        self.A_log = nn.Parameter(torch.zeros(m.num_heads))
        self.D = nn.Parameter(torch.ones(m.num_heads))
        self.norm = (GroupedGatedRMSNorm(self.intermediate, m.norm_groups, m.norm_eps, m.norm_before_gate)
                     if m.gated_norm else None)
        self.out_proj = nn.Linear(self.intermediate, config.hidden_size, bias=m.out_proj_bias)

    @staticmethod
    def state_spec(config: ModelConfig, dtype: torch.dtype) -> RecurrentStateSpec:
        """Per-sequence state: conv [conv_dim, W-1] in the model dtype, SSM [H, P, N] float32."""
        m = config.mamba2.mamba
        return RecurrentStateSpec((m.conv_dim, m.conv_kernel - 1), dtype, (m.num_heads, m.head_dim, m.state_size),
                                  torch.float32)

    def projection_width(self) -> int:
        """Columns of the in_proj GEMM output [z | xBC | dt] (the `stacked_out` of `project`)."""
        return self.in_proj.out_features

    def project(self, x: torch.Tensor, stacked_out: torch.Tensor | None = None) -> Mamba2Projection:
        """x: [T, hidden] (after the block's input norm). Token-wise. xbc and z are column views of
        the in_proj output (row-strided): a new tensor, or `stacked_out` [T, projection_width()]
        (contiguous; the piecewise forward's static buffer) when given, the same GEMM either way."""
        m = self.m
        if m.in_multiplier != 1.0:
            x = x * m.in_multiplier
        if stacked_out is None:
            zxbcdt = self.in_proj(x)
        elif stacked_out.shape != (x.shape[0], self.projection_width()) or not stacked_out.is_contiguous():
            raise ValueError(f"stacked_out must be a contiguous [{x.shape[0]}, {self.projection_width()}] tensor, "
                             f"got {list(stacked_out.shape)} with strides {stacked_out.stride()}")
        elif self.in_proj.bias is None:
            zxbcdt = torch.mm(x, self.in_proj.weight.t(), out=stacked_out)
        else:
            zxbcdt = torch.addmm(self.in_proj.bias, x, self.in_proj.weight.t(), out=stacked_out)
        if any(mult != 1.0 for mult in m.proj_multipliers):  # Falcon-H1's per-part muP multipliers, in place
            gn = m.n_groups * m.state_size
            start = 0
            for size, mult in zip((self.intermediate, self.intermediate, gn, gn, m.num_heads), m.proj_multipliers):
                if mult != 1.0:
                    zxbcdt.narrow(-1, start, size).mul_(mult)
                start += size
        z, xbc, dt = zxbcdt.split([self.intermediate, m.conv_dim, m.num_heads], dim=-1)
        return Mamba2Projection(xbc, z, softplus_dt(dt, self.dt_bias, m.dt_min, m.dt_max))

    def _split(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """xbc: [n, conv_dim] (after the conv) -> x [n, H, P], B and C [n, G, N]."""
        gn = self.n_groups * self.state_size
        x, b, c = xbc.split([self.intermediate, gn, gn], dim=-1)
        n = xbc.shape[0]
        return (x.reshape(n, self.num_heads, self.head_dim), b.reshape(n, self.n_groups, self.state_size),
                c.reshape(n, self.n_groups, self.state_size))

    def core_params(self) -> Mamba2CoreParams:
        """This layer's parameters that `core` reads (views, no copies)."""
        return Mamba2CoreParams(self.conv1d.weight.squeeze(1), self.conv1d.bias, self.A_log, self.D)

    def core(self, p: Mamba2Projection, batch: ForwardBatch, conv_state: torch.Tensor, ssm_state: torch.Tensor,
             out: torch.Tensor | None = None, *, params: Mamba2CoreParams | None = None,
             row_offset: torch.Tensor | None = None) -> torch.Tensor:
        """Causal conv and SSD scan of the decode group and every phase (models/recurrent.py): reads
        `batch`, reads and writes rows of conv_state [S, conv_dim, W-1] / ssm_state [S, H, P, N] fp32
        in place. Returns out [T, H, P] (every row written: decodes and phases cover all T tokens;
        `out` may be a strided view).

        With `row_offset` (a 0-dim long tensor on the device) the states are those of all L Mamba2
        layers flattened ([L * S, ...]), of which rows row_offset + slot are this layer's, and
        `params` (this layer's own when None) are read instead of the module's: then the layer is
        chosen by device data only, so one CUDA graph of this call serves every Mamba2 layer
        (runner/piecewise.py), as `GatedDeltaNet.core` does for GDN. No host sync."""
        if out is None:
            out = p.xbc.new_empty(p.xbc.shape[0], self.num_heads, self.head_dim)
        weight, bias, A_log, D = params if params is not None else self.core_params()
        args = _ScanArgs(weight, bias, -torch.exp(A_log.float()), D)
        return two_phase_core(self, p, batch, conv_state, ssm_state, out, args, row_offset)

    def decode_step(self, p: Mamba2Projection, args: _ScanArgs, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                    rows: torch.Tensor, out: torch.Tensor) -> None:
        """`RecurrentKernels.decode_step`: single-token conv and SSD step, rows updated in place."""
        x, b, c = self._split(causal_conv1d_step_inplace(p.xbc, args.conv_weight, args.conv_bias, conv_state, rows))
        ssd_step_inplace(x, p.dt, args.A, b, c, ssm_state, rows, D=args.D, out=out)

    def phase_scan(self, p: Mamba2Projection, args: _ScanArgs, conv_initial: torch.Tensor, ssm_initial: torch.Tensor,
                   cu_seqlens: torch.Tensor, cu_seqlens_host: tuple[int, ...],
                   out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`RecurrentKernels.phase_scan`: packed varlen conv, then the chunked SSD scan into `out`."""
        conv_out, final_conv = causal_conv1d_varlen(p.xbc, args.conv_weight, args.conv_bias, conv_initial,
                                                    cu_seqlens, cu_seqlens_host)
        x, b, c = self._split(conv_out)
        _, final_ssm = chunk_ssd(x, p.dt, args.A, b, c, ssm_initial, cu_seqlens, cu_seqlens_host, D=args.D, out=out)
        return final_conv, final_ssm

    def finish(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """core: [T, H, P]; z: [T, I] -> [T, hidden]. Token-wise."""
        y = core.reshape(core.shape[0], self.intermediate)
        y = self.norm(y, z) if self.norm is not None else (y.float() * F.silu(z.float())).to(y.dtype)
        return self.out_proj(y)


class Attention(nn.Module):
    """Plain multi-head attention with GQA over paged KV: q/k/v/o projections (optional bias),
    optional rotary embedding (rotate-half on the first rotary_dim dims; none when rotary_dim is 0),
    `key_multiplier` on the keys (Falcon-H1) and softmax scale `scale`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, hybrid = config.hidden_size, config.mamba2
        self.num_heads, self.num_kv_heads, self.head_dim = (config.num_attention_heads, config.num_key_value_heads,
                                                            config.head_dim)
        bias = config.attention_bias
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=bias)
        self.scale = hybrid.attention_scale if hybrid.attention_scale is not None else self.head_dim**-0.5
        self.key_multiplier = hybrid.key_multiplier

    def project(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> QKVProjection:
        """x: [T, hidden]; cos, sin: [T, rotary_dim] (rotary_dim 0: no rotary) -> q [T, HQ, Dh], k and
        v [T, HKV, Dh]. Token-wise."""
        t = x.shape[0]
        q = self.q_proj(x).reshape(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        v = self.v_proj(x).reshape(t, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        if cos.shape[-1]:
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return QKVProjection(q, k, v)

    def core(self, p: QKVProjection, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Writes this step's K/V, copies shared partial blocks (copy-on-write), attends -> [T, HQ, Dh]
        (copied into `out` when given): models/attention_core.py, as Qwen's gated attention."""
        return attention_core(p.q, p.k, p.v, batch, k_cache, v_cache, self.scale, out)

    def finish(self, core: torch.Tensor) -> torch.Tensor:
        """core: [T, HQ, Dh] -> o_proj [T, hidden]. Token-wise."""
        return self.o_proj(core.reshape(core.shape[0], -1))
