"""Turns a `StepPlan` into one `ForwardBatch`, runs the model and returns the logits to sample.

All metadata is built here, once per step, on the host, then moved to the device in a handful
of copies; the layers only index with it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from forkpoint.cache.block_pool import BlockPool
from forkpoint.cache.state_pool import StatePool
from forkpoint.engine.scheduler import KVCopy, PlannedSegment, StepPlan
from forkpoint.models.qwen3_5 import HybridForCausalLM, LayerCaches
from forkpoint.runner.batch import AttentionMetadata, DecodeGroup, ForwardBatch, RecurrentPhase


def order_segments(segments: Sequence[PlannedSegment]) -> list[PlannedSegment]:
    """Decodes first, then prefill segments by phase (stable within a phase)."""
    return sorted(segments, key=lambda s: s.phase)


def build_forward_batch(plan: StepPlan, block_size: int, device: torch.device) -> tuple[ForwardBatch, list[PlannedSegment]]:
    """Returns the batch and the segments whose logits it yields, in logits row order."""
    segments = order_segments(plan.segments)
    token_ids: list[int] = []
    positions: list[int] = []
    slot_mapping: list[int] = []
    cu_q = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampled: list[PlannedSegment] = []
    max_blocks = max(len(s.request.blocks) for s in segments)
    block_tables = torch.zeros(len(segments), max_blocks, dtype=torch.int32)
    for row, segment in enumerate(segments):
        request = segment.request
        tokens = request.tokens(segment.start, segment.end)
        token_ids.extend(tokens)
        positions.extend(range(segment.start, segment.end))
        blocks = request.blocks
        slot_mapping.extend(blocks[p // block_size] * block_size + p % block_size
                            for p in range(segment.start, segment.end))
        block_tables[row, : len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
        cu_q.append(cu_q[-1] + len(tokens))
        seq_lens.append(segment.end)
        if segment.samples:
            logits_indices.append(cu_q[-1] - 1)
            sampled.append(segment)

    num_decodes = sum(1 for s in segments if s.phase < 0)
    decode = None
    if num_decodes:
        decode = DecodeGroup(num_decodes, _long([s.initial_slot for s in segments[:num_decodes]], device))
    phases = []
    first = num_decodes
    while first < len(segments):
        phase_id = segments[first].phase
        last = first
        while last < len(segments) and segments[last].phase == phase_id:
            last += 1
        phases.append(_phase(segments[first:last], cu_q[first], cu_q[last], device))
        first = last

    src, dst = _copy_slots(plan.kv_copies, block_size)
    attention = AttentionMetadata(
        slot_mapping=_long(slot_mapping, device),
        block_tables=block_tables.to(device),
        cu_seqlens_q=_long(cu_q, device),
        cu_seqlens_q_host=tuple(cu_q),
        seq_lens=_long(seq_lens, device),
        seq_lens_host=tuple(seq_lens),
        cow_src=_long(src, device),
        cow_dst=_long(dst, device),
    )
    batch = ForwardBatch(
        input_ids=_long(token_ids, device),
        positions=_long(positions, device),
        decode=decode,
        phases=tuple(phases),
        attention=attention,
        logits_indices=_long(logits_indices, device),
    )
    return batch, sampled


def _phase(segments: Sequence[PlannedSegment], token_start: int, token_end: int, device: torch.device) -> RecurrentPhase:
    cu = [0]
    dest_rows: list[int] = []
    dest_slots: list[int] = []
    for row, segment in enumerate(segments):
        cu.append(cu[-1] + segment.end - segment.start)
        for slot in segment.dest_slots:
            dest_rows.append(row)
            dest_slots.append(slot)
    return RecurrentPhase(
        token_start=token_start,
        token_end=token_end,
        cu_seqlens=_long(cu, device),
        cu_seqlens_host=tuple(cu),
        initial_slots=_long([s.initial_slot for s in segments], device),
        dest_rows=_long(dest_rows, device),
        dest_slots=_long(dest_slots, device),
    )


def _copy_slots(copies: Sequence[KVCopy], block_size: int) -> tuple[list[int], list[int]]:
    src: list[int] = []
    dst: list[int] = []
    for copy in copies:
        src.extend(copy.src_block * block_size + i for i in range(copy.num_tokens))
        dst.extend(copy.dst_block * block_size + i for i in range(copy.num_tokens))
    return src, dst


def _long(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device, non_blocking=True)


class ModelRunner:
    """Owns the model; reads the pools' tensors for each forward."""

    def __init__(self, model: HybridForCausalLM, block_pool: BlockPool, state_pool: StatePool,
                 device: torch.device) -> None:
        self.model = model
        self.device = device
        self.block_size = block_pool.block_size
        self.caches = LayerCaches(conv=state_pool.conv, ssm=state_pool.ssm, k=block_pool.k, v=block_pool.v)

    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, list[PlannedSegment]]:
        """Run one step. Returns logits [R, vocab] (float32) and the R segments they belong to."""
        batch, sampled = build_forward_batch(plan, self.block_size, self.device)
        logits = self.model(batch, self.caches)
        return logits, sampled
