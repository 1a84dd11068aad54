"""Building blocks shared by the hybrid models: norms, rotary embedding, feed-forward blocks.

All modules take packed token-major activations `x: [T, hidden]` (no batch dimension).
"""

from __future__ import annotations

import torch
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.kernels.activation import silu_and_mul
from forkpoint.kernels.dense import linear
from forkpoint.kernels.moe import fused_moe, topk_softmax
from forkpoint.kernels.norms import gated_rms_norm, rms_norm


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm of Qwen3.5 / Qwen3-Next: `x / rms(x) * (1 + w)`, computed in float32.

    `forward(x)` normalises the last dim of x: [..., dim] and returns a new tensor in x.dtype.
    `forward(x, residual)` fuses the pre-norm residual add: with `s = residual + x` (in x.dtype,
    exactly the unfused `hidden = residual + hidden`) it returns the pair `(norm(s), s)`, `s` being
    the residual stream for the next block. One kernel on CUDA (forkpoint.kernels.norms).
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim followed by a SiLU gate: `w * norm(x) * silu(z)` (weight not centred).

    x, gate: [..., dim] -> [..., dim] in x.dtype; one kernel on CUDA (forkpoint.kernels.norms)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return gated_rms_norm(x, gate, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Partial rotary embedding (rotate-half convention) on the first `rotary_dim` dims of each head.

    Qwen3.5's rotary is multi-axis (temporal, height, width), interleaved: frequency i rotates by
    the position on axis `mrope_axis[i]` (see `mrope_axes`). Text tokens carry the same position
    on all three axes, so for them it is the 1-D rotary of `positions: [T]` (the fast path); only
    image tokens need `positions: [3, T]`.
    """

    def __init__(self, rotary_dim: int, theta: float, mrope_section: tuple[int, int, int] = (11, 11, 10)) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("mrope_axis", mrope_axes(rotary_dim // 2, mrope_section), persistent=False)
        self.rotary_dim = rotary_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] long, or [3, T] long (T, H, W axes) -> cos, sin: [T, rotary_dim] in `dtype`."""
        inv_freq = self.inv_freq.to(positions.device)
        if positions.dim() == 1:
            freqs = positions.float()[:, None] * inv_freq[None, :]
        else:
            per_freq = positions.index_select(0, self.mrope_axis.to(positions.device))  # [rotary_dim/2, T]
            freqs = per_freq.float().T * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def mrope_axes(half: int, mrope_section: tuple[int, int, int], device: torch.device | None = None) -> torch.Tensor:
    """Axis (0 = T, 1 = H, 2 = W) of each of the `half` rotary frequencies, transformers' interleaved
    layout: H at i % 3 == 1 for i < 3 * section[1], W at i % 3 == 2 for i < 3 * section[2], T elsewhere."""
    axis = torch.zeros(half, dtype=torch.long, device=device)
    for dim in (1, 2):
        axis[dim : 3 * mrope_section[dim] : 3] = dim
    return axis


# Stacked projection weights get zero rows up to a multiple of this (16-byte output rows in bf16)
STACK_ROW_MULTIPLE = 8


class StackedProjections(nn.Module):
    """A module whose projections of one input run as one GEMM.

    `stack_projections()`, called once after the weights are loaded (`stack_all_projections`),
    concatenates the weights (and biases) of the modules `stacked_linears()` names, in that order,
    into one [sum N_i + pad, K] tensor (zero rows up to a multiple of STACK_ROW_MULTIPLE, so that
    the GEMM output's rows are 16-byte aligned in bf16: unpadded, the MoE router's 256 + 1 rows ran
    in cuBLAS's sm75 `align1` fallback, 158 us a layer in an 8,192-token step on an H200) and turns
    each module's weight into a row view of it, so the parameters, their names and the state dict
    stay as the checkpoint has them (moving the model afterwards would break the views: stack on the
    final device and dtype). `project_stacked(x)`, x [T, K], then returns the projections' outputs
    [T, N_i] as column views of one GEMM output (row stride stacked_width(); the kernels that read
    them take row strides), written into `out` [T, stacked_width()] when given (the piecewise
    forward's static buffer: runner/piecewise.py)."""

    def __init__(self) -> None:
        super().__init__()
        self._stack: tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]] | None = None

    def stacked_linears(self) -> tuple[nn.Module, ...]:
        """The modules (each with `weight` [N_i, K] and optionally `bias` [N_i]) whose outputs
        `project_stacked` returns, in order."""
        raise NotImplementedError

    def absorbed(self) -> tuple[StackedProjections, ...]:
        """Submodules whose projections this module's stack already holds (their `stacked_linears`
        are among this module's): `stack_all_projections` leaves them unstacked, and this module
        runs their token-wise rest itself."""
        return ()

    @torch.no_grad()
    def stack_projections(self) -> None:
        linears = self.stacked_linears()
        sizes = tuple(m.weight.shape[0] for m in linears)
        pad = -sum(sizes) % STACK_ROW_MULTIPLE
        first = linears[0].weight
        weight = torch.cat([m.weight.detach() for m in linears] + [first.new_zeros(pad, first.shape[1])])
        biases = [getattr(m, "bias", None) for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError(f"{type(self).__name__}: the stacked projections must all have a bias or none")
        bias = None if biases[0] is None else torch.cat([b.detach() for b in biases] + [biases[0].new_zeros(pad)])
        for i, (m, w) in enumerate(zip(linears, weight.split(sizes + (pad,)))):
            m.weight = nn.Parameter(w, requires_grad=False)
            if bias is not None:
                m.bias = nn.Parameter(bias.split(sizes + (pad,))[i], requires_grad=False)
        self._stack = (weight, bias, sizes + (pad,))

    def stacked_width(self) -> int:
        """Columns of the stacked GEMM output: sum N_i, plus the zero rows that round it up to a
        multiple of STACK_ROW_MULTIPLE."""
        return sum(self._stacked()[2])

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor | None, tuple[int, ...]]:
        if self._stack is None:
            raise RuntimeError(f"{type(self).__name__}.stack_projections() was not called after loading the weights")
        return self._stack

    def project_stacked(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """x: [T, K] -> the projections' outputs [T, N_i], column views of one GEMM output: a new
        tensor, or `out` [T, sum N_i] (contiguous) when given. The same GEMM either way
        (`kernels.dense.linear`: a decode-sized kernel for few rows on CUDA, else F.linear, which is
        addmm / mm for 2-D inputs)."""
        weight, bias, sizes = self._stacked()
        y = linear(x, weight, bias, out)
        return y.split(sizes, dim=-1)[:-1]  # the last split is the padding


def stack_all_projections(model: nn.Module) -> None:
    """`stack_projections()` on every `StackedProjections` module of `model` (once, after loading),
    except those a parent `absorbed()` (modules() lists a parent before its children)."""
    absorbed: set[int] = set()
    for module in model.modules():
        if isinstance(module, StackedProjections) and id(module) not in absorbed:
            module.stack_projections()
            absorbed.update(id(m) for m in module.absorbed())


class DenseMLP(StackedProjections):
    """SwiGLU feed-forward: `down(silu(gate(x)) * up(x))`, gate and up as one GEMM, the activation
    in fp32 with one rounding (silu_and_mul: one kernel on CUDA)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def stacked_linears(self) -> tuple[nn.Module, ...]:
        return self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.finish(*self.project_stacked(x))

    def finish(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """gate, up: [T, intermediate] (the gate and up projections, rows may be strided) -> down
        projection of silu(gate) * up, [T, hidden]."""
        return linear(silu_and_mul(gate, up), self.down_proj.weight, self.down_proj.bias)


class TopKRouter(nn.Module):
    """Softmax router: top-k of the softmax probabilities, renormalised when `norm_topk_prob`
    (`kernels.moe.topk_softmax`: one kernel on CUDA)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, renormalize: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))
        self.top_k = top_k
        self.renormalize = renormalize

    def select(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [T, E] (the router's projection of x, rows may be strided) -> (weights [T, k] in
        logits.dtype, expert ids [T, k] long)."""
        return topk_softmax(logits, self.top_k, self.renormalize, logits.dtype)


class Experts(nn.Module):
    """Routed experts stored fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))


class SparseMoE(StackedProjections):
    """Routed experts plus a shared expert scaled by a sigmoid gate. The shared expert's gate and up
    projections, the router's and the shared gate's run as one GEMM (in that order, so that each
    output starts 16-byte aligned at Qwen3.5's sizes: 2 x 512, 256, 1 columns): at decode sizes two
    small GEMMs cost two latency-bound launches (a 264-row router took 7.2 us plus a split-K reduce
    on an H200 at one token)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.gate = TopKRouter(hidden, config.num_experts, config.num_experts_per_tok, config.norm_topk_prob)
        self.experts = Experts(config.num_experts, hidden, config.moe_intermediate_size)
        self.shared_expert = DenseMLP(hidden, config.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, hidden] -> routed + sigmoid(gate) * shared expert, plus `residual` [T, hidden] when
        given (the pre-norm residual add of the layer, fused into the routed combine on CUDA)."""
        shared_up_gate, shared_up, logits, shared_gate = self.project_stacked(x)
        top_w, top_ids = self.gate.select(logits)
        return fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, top_w, top_ids,
                         shared=self.shared_expert.finish(shared_up_gate, shared_up), shared_gate=shared_gate,
                         residual=residual)

    def stacked_linears(self) -> tuple[nn.Module, ...]:
        return *self.shared_expert.stacked_linears(), self.gate, self.shared_expert_gate

    def absorbed(self) -> tuple[StackedProjections, ...]:
        return (self.shared_expert,)
