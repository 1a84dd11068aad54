"""Per-step device metadata: the one value object a forward pass reads.

The runner builds a `ForwardBatch` once per step, on the host, from the scheduler's plan; layers
only index with it, so no layer synchronises with the host.

Packed token order (T tokens)::

    [ decodes | phase 0 segments | phase 1 segments | ... ]

A *segment* is a contiguous run of one request's new tokens that starts from a single recurrent
state. Phase 0 segments start from an empty state (slot 0, kept zero) or the request's own slot;
a phase p > 0 segment starts from a checkpoint written by an earlier phase of the same forward or
by an earlier step. Each phase is one packed kernel call per recurrent layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RecurrentPhase:
    """One packed variable-length recurrent call.

    token_start/token_end: slice of the packed tokens; cu_seqlens [n+1] (device, long) and
    cu_seqlens_host: segment offsets relative to token_start; initial_slots [n]: state rows each
    segment starts from; final states of segment dest_rows[i] are written to row dest_slots[i]
    (a segment may write its private slot and a checkpoint slot, or nothing).
    single_tokens: a phase of speculative verification (engine/speculative.py): every segment is one
    token with one destination row (dest_rows = 0 .. n-1, distinct rows); the driver copies each
    initial row into its destination and runs the single-token kernels there, the decode group's
    math (models/recurrent.py).
    """

    token_start: int
    token_end: int
    cu_seqlens: torch.Tensor
    cu_seqlens_host: tuple[int, ...]
    initial_slots: torch.Tensor
    dest_rows: torch.Tensor
    dest_slots: torch.Tensor
    single_tokens: bool = False


@dataclass(frozen=True)
class DecodeGroup:
    """Single-token decodes at the front of the batch: token i reads and writes state row slots[i]."""

    num_tokens: int
    slots: torch.Tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Paged-attention metadata for all segments (decodes first, each a segment of one token).

    slot_mapping [T]: flat KV slot of each new token; block_tables [N, max_blocks] int32;
    cu_seqlens_q [N+1]; seq_lens [N]: KV length of each segment after this step;
    cow_src / cow_dst [M]: flat slots copied (after the KV write, before attending) from a shared
    partial block into a consumer's private copy of it.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_q_host: tuple[int, ...]
    seq_lens: torch.Tensor
    seq_lens_host: tuple[int, ...]
    cow_src: torch.Tensor
    cow_dst: torch.Tensor


@dataclass(frozen=True)
class ForwardBatch:
    """Everything one forward pass needs. input_ids, positions: [T] long; logits_indices [R].

    Images (both None for text-only steps):
    mrope_positions [3, T] long: rotary positions on the (temporal, height, width) axes, present
        when the step computes image tokens; then it replaces `positions` (which for text tokens
        equals each of its rows).
    embedding_overrides (token_indices [M] long, embeds [M, hidden]): rows of the packed input
        embeddings replaced by vision-tower outputs (the image tokens computed in this step).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    decode: DecodeGroup | None
    phases: tuple[RecurrentPhase, ...]
    attention: AttentionMetadata
    logits_indices: torch.Tensor
    mrope_positions: torch.Tensor | None = None
    embedding_overrides: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])
