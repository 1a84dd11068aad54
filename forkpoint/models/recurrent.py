"""The two-phase recurrent driver (DESIGN.md section 4): one recurrent layer's core over a step.

Every recurrent mixer (Gated DeltaNet, Mamba2) keeps per sequence a conv state and an SSM state, one
row each in its layer's pool tensors, and runs a step the same way; only the kernels differ, and the
mixer plugs them in (`RecurrentKernels`). Packed token order (step/batch.py)::

    [ decodes | phase 0 segments | phase 1 segments | ... ]

    decode group   one token per sequence: the mixer's single-token kernels update rows
                   `decode.slots` of both states in place (rows are distinct)
    each phase     gather:  initial states = state.index_select(0, phase.initial_slots)
                            (the zero row 0, a private slot, or a checkpoint row written by an
                            earlier phase of this forward or an earlier step)
                   scan:    the mixer's packed varlen conv + scan over the phase's segments
                   scatter: state.index_copy_(0, dest_slots, final[dest_rows]) (private slots and
                            checkpoint rows; a later phase of this step reads them)
    a single_tokens phase (speculative verification: one token per segment, one row each) copies
                   each initial row into its destination row and runs the decode group's kernels there

Stacked form (runner/piecewise.py): with `row_offset` (a 0-dim long tensor on the device) the
state tensors are those of all L recurrent layers flattened ([L * S, ...]) and every row index is
shifted by it, so the layer is chosen by device data only and one CUDA graph of a core serves every
recurrent layer. Without it the indices are used as they are (no launch). No host sync either way.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from forkpoint.step.batch import ForwardBatch


class RecurrentKernels(Protocol):
    """What a recurrent mixer plugs into `two_phase_core` (which calls both positionally). `p` is the
    mixer's projection (a NamedTuple of token-major tensors, rows = tokens); `args` what the mixer
    derived from its core parameters once per core call (the driver passes it through unchanged)."""

    def decode_step(self, p: NamedTuple, args: Any, conv_state: torch.Tensor, ssm_state: torch.Tensor,
                    rows: torch.Tensor, out: torch.Tensor, /) -> None:
        """The decode group: p's n rows are one token each of the sequences whose states are rows
        `rows` [n] long of conv_state [S', conv_dim, W-1] / ssm_state [S', ...] fp32; updates those
        rows in place (single-token conv, then the recurrent step) and writes out [n, heads, dim]."""
        ...

    def phase_scan(self, p: NamedTuple, args: Any, conv_initial: torch.Tensor, ssm_initial: torch.Tensor,
                   cu_seqlens: torch.Tensor, cu_seqlens_host: tuple[int, ...],
                   out: torch.Tensor, /) -> tuple[torch.Tensor, torch.Tensor]:
        """One phase: p's rows are the phase's tokens, packed segments at offsets cu_seqlens [n+1]
        (device long; `cu_seqlens_host` the same on the host), segment i starting from
        conv_initial[i] [conv_dim, W-1] and ssm_initial[i] (gathered copies: the pool is not read).
        Writes out [phase tokens, heads, dim] (may be a strided view); returns the final states
        (conv [n, conv_dim, W-1], ssm [n, ...] fp32) of every segment."""
        ...


def _token_rows(p: NamedTuple, start: int, end: int) -> NamedTuple:
    """Views of rows start:end of every field of p."""
    return type(p)(*(t[start:end] for t in p))


def two_phase_core(kernels: RecurrentKernels, p: NamedTuple, batch: ForwardBatch, conv_state: torch.Tensor,
                   ssm_state: torch.Tensor, out: torch.Tensor, args: Any,
                   row_offset: torch.Tensor | None = None) -> torch.Tensor:
    """The decode group, then every phase of `batch` (module docstring) for one recurrent layer.

    p: the mixer's projection of the step's T tokens exactly; conv_state [S, conv_dim, W-1] and
    ssm_state [S, ...] fp32: the layer's pool rows (or, with `row_offset`, all recurrent layers'
    rows [L * S, ...] of which rows row_offset + slot are this layer's). Reads and writes those rows
    in place; writes every row of out [T, heads, dim] (decodes and phases cover all T tokens) and
    returns it."""

    def rows(slots: torch.Tensor) -> torch.Tensor:  # no launch on the per-layer path
        return slots if row_offset is None else slots + row_offset

    decode = batch.decode
    if decode is not None and decode.num_tokens:
        n = decode.num_tokens
        kernels.decode_step(_token_rows(p, 0, n), args, conv_state, ssm_state, rows(decode.slots), out[:n])
    for phase in batch.phases:
        lo, hi = phase.token_start, phase.token_end
        initial = rows(phase.initial_slots)
        if phase.single_tokens:  # speculative verification: each token from its row into its own row
            dest = rows(phase.dest_slots)
            conv_state.index_copy_(0, dest, conv_state.index_select(0, initial))
            ssm_state.index_copy_(0, dest, ssm_state.index_select(0, initial))
            kernels.decode_step(_token_rows(p, lo, hi), args, conv_state, ssm_state, dest, out[lo:hi])
            continue
        final_conv, final_ssm = kernels.phase_scan(
            _token_rows(p, lo, hi), args, conv_state.index_select(0, initial), ssm_state.index_select(0, initial),
            phase.cu_seqlens, phase.cu_seqlens_host, out[lo:hi])
        if phase.dest_slots.numel():
            dest = rows(phase.dest_slots)
            conv_state.index_copy_(0, dest, final_conv.index_select(0, phase.dest_rows).to(conv_state.dtype))
            ssm_state.index_copy_(0, dest, final_ssm.index_select(0, phase.dest_rows))
    return out
