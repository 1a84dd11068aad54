"""Building blocks shared by the hybrid models: norms, rotary embedding, feed-forward blocks.

All modules take packed token-major activations `x: [T, hidden]` (no batch dimension).
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch
from torch import nn

from forkpoint.config import ModelConfig
from forkpoint.kernels.activation import silu_and_mul
from forkpoint.kernels.dense import linear
from forkpoint.kernels.fp8 import fp8_linear, fused_moe_fp8
from forkpoint.kernels.fp8.reference import FP8_DTYPE, block_scale_shape
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


def make_fp8(module: nn.Module, block: tuple[int, int]) -> None:
    """Turn `module`'s 2-D `weight` [N, K] into a block-wise FP8 weight, in place (on the meta device,
    before the weights are materialised): `weight` becomes float8_e4m3fn [N, K] and `weight_scale_inv`
    float32 [ceil(N / bn), ceil(K / bk)] is registered after it (the checkpoints' names), `weight_block`
    = block. `apply_linear` and the stacked projections then run it through `kernels.fp8`."""
    weight = module.weight
    module.weight = nn.Parameter(torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device),
                                 requires_grad=False)
    module.weight_scale_inv = nn.Parameter(
        torch.empty(block_scale_shape(tuple(weight.shape), block), dtype=torch.float32, device=weight.device),
        requires_grad=False)
    module.weight_block = block


def fp8_block(module: nn.Module) -> tuple[int, int] | None:
    """The FP8 block shape (bn, bk) of a module that `make_fp8` converted; None for a plain one."""
    return getattr(module, "weight_block", None)


class Fp8Linear(nn.Linear):
    """An `nn.Linear` whose weight is block-wise FP8 (`make_fp8`); `forward(x)` = `apply_linear(self, x)`."""

    @classmethod
    def from_linear(cls, plain: nn.Linear, block: tuple[int, int]) -> Fp8Linear:
        """The FP8 twin of `plain` (on its device, normally meta: nothing is allocated), its bias kept."""
        module = cls(plain.in_features, plain.out_features, bias=False, device=plain.weight.device,
                     dtype=plain.weight.dtype)
        module.bias = plain.bias
        make_fp8(module, block)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_linear(self, x)


def apply_linear(module: nn.Module, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] through `module`'s projection (weight [N, K], optional bias [N]) -> [T, N] in x.dtype,
    written into `out` when given: `kernels.dense.linear` for a plain weight (`out` contiguous),
    `kernels.fp8.fp8_linear` for a block-wise FP8 one (`out` may be a column range of a wider buffer)."""
    block = fp8_block(module)
    if block is None:
        return linear(x, module.weight, module.bias, out)
    return fp8_linear(x, module.weight, module.weight_scale_inv, block, module.bias, out)


# Stacked projection weights get zero rows up to a multiple of this (16-byte output rows in bf16)
STACK_ROW_MULTIPLE = 8


class _StackRun(NamedTuple):
    """One GEMM of a stack: consecutive stacked projections of one kind (plain, or FP8 with one block)."""

    weight: torch.Tensor  # [rows, K], model dtype or e4m3
    scale: torch.Tensor | None  # FP8: the block scales of `weight`
    bias: torch.Tensor | None  # [rows]
    block: tuple[int, int] | None
    start: int  # the run's first column of the stacked output


class _Stack(NamedTuple):
    runs: tuple[_StackRun, ...]
    outputs: tuple[tuple[int, int], ...]  # (first column, width) of each projection's output
    width: int  # columns of the stacked output (a multiple of STACK_ROW_MULTIPLE)


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
    forward's static buffer: runner/piecewise.py).

    Block-wise FP8 projections (`make_fp8`) stack the same way, their scales too; a projection whose
    rows do not fill its last block gets zero rows up to the block before the next one (so that
    each block keeps one scale), and those output columns are skipped. When a stack mixes FP8 and
    plain projections (Qwen's FP8 releases keep the router, the shared expert's gate and the GDN's
    b / a projections unquantised), each run of one kind is one GEMM into its columns of the output."""

    def __init__(self) -> None:
        super().__init__()
        self._stack: _Stack | None = None

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
        biases = [getattr(m, "bias", None) for m in linears]
        if any(b is None for b in biases) and not all(b is None for b in biases):
            raise ValueError(f"{type(self).__name__}: the stacked projections must all have a bias or none")
        groups = [list(group) for _, group in itertools.groupby(linears, key=fp8_block)]
        runs, outputs, start = [], [], 0
        for i, group in enumerate(groups):
            run, offsets = _stack_run(group, start, last=i == len(groups) - 1)
            runs.append(run)
            outputs += [(start + offset, m.weight.shape[0]) for m, offset in zip(group, offsets)]
            start += run.weight.shape[0]
        self._stack = _Stack(tuple(runs), tuple(outputs), start)

    def stacked_width(self) -> int:
        """Columns of the stacked GEMM output: sum N_i, plus the zero rows that round it up to a
        multiple of STACK_ROW_MULTIPLE (and, for FP8 projections, to their blocks)."""
        return self._stacked().width

    def _stacked(self) -> _Stack:
        if self._stack is None:
            raise RuntimeError(f"{type(self).__name__}.stack_projections() was not called after loading the weights")
        return self._stack

    def project_stacked(self, x: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """x: [T, K] -> the projections' outputs [T, N_i], column views of one GEMM output: a new
        tensor, or `out` [T, stacked_width()] (contiguous) when given. The same GEMM either way
        (`kernels.dense.linear`: a decode-sized kernel for few rows on CUDA, else F.linear, which is
        addmm / mm for 2-D inputs; `kernels.fp8.fp8_linear` for FP8 weights). A mixed stack runs one
        GEMM per run into its columns."""
        stack = self._stacked()
        if len(stack.runs) == 1:
            y = _run_gemm(stack.runs[0], x, out)
        else:
            y = x.new_empty(x.shape[0], stack.width) if out is None else out
            for run in stack.runs:
                _run_gemm(run, x, y[:, run.start : run.start + run.weight.shape[0]])
        return tuple(y[:, start : start + width] for start, width in stack.outputs)


def _stack_run(group: list[nn.Module], start: int, *, last: bool) -> tuple[_StackRun, list[int]]:
    """Concatenate one run's weights (and scales, biases) and turn each module's parameters into row
    views of them. Returns the run and each module's first row in it. FP8 modules but the last are
    padded to their block's rows; the last run is padded to STACK_ROW_MULTIPLE (total columns)."""
    block = fp8_block(group[0])
    first = group[0].weight
    pads = [0 if block is None or j == len(group) - 1 else -m.weight.shape[0] % block[0] for j, m in enumerate(group)]
    rows = sum(m.weight.shape[0] for m in group) + sum(pads)
    if last:
        pads[-1] += -(start + rows) % STACK_ROW_MULTIPLE
    weight = torch.cat([t for m, pad in zip(group, pads) for t in (m.weight.detach(), _zero_rows(first, pad))])
    sizes = [n for m, pad in zip(group, pads) for n in (m.weight.shape[0], pad)]
    starts = [sum(sizes[: 2 * j]) for j in range(len(group))]
    bias = None
    if getattr(group[0], "bias", None) is not None:
        bias = torch.cat([t for m, pad in zip(group, pads) for t in (m.bias.detach(), m.bias.new_zeros(pad))])
    scale = None
    if block is not None:
        scale = torch.cat([m.weight_scale_inv.detach() for m in group])
        missing = -(-weight.shape[0] // block[0]) - scale.shape[0]  # the last module's padding past its blocks
        scale = torch.cat([scale, scale.new_ones(missing, scale.shape[1])])
    for j, m in enumerate(group):
        n = m.weight.shape[0]
        m.weight = nn.Parameter(weight[starts[j] : starts[j] + n], requires_grad=False)
        if bias is not None:
            m.bias = nn.Parameter(bias[starts[j] : starts[j] + n], requires_grad=False)
        if block is not None:
            first_block = starts[j] // block[0]
            m.weight_scale_inv = nn.Parameter(scale[first_block : first_block + -(-n // block[0])],
                                              requires_grad=False)
    return _StackRun(weight, scale, bias, block, start), starts


def _zero_rows(like: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, K] zeros of `like`'s dtype (e4m3 zeros are exact zeros)."""
    return torch.zeros(rows, like.shape[1], dtype=like.dtype, device=like.device)


def _run_gemm(run: _StackRun, x: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """One run's GEMM into `out` (contiguous, or a column range of the stacked output)."""
    if run.block is not None:
        return fp8_linear(x, run.weight, run.scale, run.block, run.bias, out)
    if out is None or out.is_contiguous():
        return linear(x, run.weight, run.bias, out)
    return out.copy_(linear(x, run.weight, run.bias))


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
        return apply_linear(self.down_proj, silu_and_mul(gate, up))


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
    """Routed experts stored fused: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].

    `make_fp8` turns both into block-wise FP8 (with `gate_up_proj_scale_inv` [E, ceil(2I / bn),
    ceil(H / bk)] and `down_proj_scale_inv` [E, ceil(H / bn), ceil(I / bk)] float32)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate))
        self.weight_block: tuple[int, int] | None = None

    def make_fp8(self, block: tuple[int, int]) -> None:
        """Both weights to float8_e4m3fn with their block scales (on the meta device, before loading)."""
        for name in ("gate_up_proj", "down_proj"):
            shape = getattr(self, name).shape
            device = getattr(self, name).device
            setattr(self, name, nn.Parameter(torch.empty(shape, dtype=FP8_DTYPE, device=device), requires_grad=False))
            setattr(self, f"{name}_scale_inv", nn.Parameter(
                torch.empty(block_scale_shape(tuple(shape), block), dtype=torch.float32, device=device),
                requires_grad=False))
        self.weight_block = block

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, **extras) -> torch.Tensor:
        """`kernels.moe.fused_moe` (or `kernels.fp8.fused_moe_fp8`) of these experts; `extras`: shared,
        shared_gate, residual."""
        if self.weight_block is None:
            return fused_moe(x, self.gate_up_proj, self.down_proj, topk_weights, topk_ids, **extras)
        return fused_moe_fp8(x, self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj,
                             self.down_proj_scale_inv, self.weight_block, topk_weights, topk_ids, **extras)


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
        return self.experts(x, top_w, top_ids, shared=self.shared_expert.finish(shared_up_gate, shared_up),
                            shared_gate=shared_gate, residual=residual)

    def stacked_linears(self) -> tuple[nn.Module, ...]:
        return *self.shared_expert.stacked_linears(), self.gate, self.shared_expert_gate

    def absorbed(self) -> tuple[StackedProjections, ...]:
        return (self.shared_expert,)
