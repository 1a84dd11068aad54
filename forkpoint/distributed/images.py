"""Image inputs of a tensor-parallel step: rank 0 encodes, every rank embeds the same rows.

The vision tower runs whole on rank 0 (it is not split: rank 0 holds it, the workers hold none), in
`MultimodalInputs.attach` as with one process, which also gives the step's rotary positions (image
tokens on three axes, the text after them shifted). Rank 0 then broadcasts what `attach` put in the
batch and the workers put it in theirs, so every rank's forward sees the batch of one process:

    positions [T] long, then (when the step computes image tokens) mrope_positions [3, T] long and
    the override rows' token indices [M] long          one int64 broadcast of T (+ 3T + M) values
    the override rows [M, hidden] in the model dtype   one broadcast (M > 0 only)

The step message tells the workers M (None: a step without image requests, nothing is broadcast).
"""

from __future__ import annotations

import dataclasses

import torch

from forkpoint.distributed.collectives import TensorParallelGroup
from forkpoint.step.batch import ForwardBatch


def image_rows(batch: ForwardBatch) -> int:
    """M, the number of vision-tower rows rank 0's attached batch overrides."""
    return 0 if batch.embedding_overrides is None else batch.embedding_overrides[0].numel()


def send_image_inputs(group: TensorParallelGroup, batch: ForwardBatch, dtype: torch.dtype) -> None:
    """Rank 0: broadcast the image inputs of its attached `batch` (the override rows in `dtype`, to
    which the embedding converts them anyway)."""
    longs = [batch.positions]
    if batch.embedding_overrides is not None:
        longs += [batch.mrope_positions.reshape(-1), batch.embedding_overrides[0]]
    group.broadcast(torch.cat(longs))
    if batch.embedding_overrides is not None:
        group.broadcast(batch.embedding_overrides[1].to(dtype).contiguous())


def receive_image_inputs(group: TensorParallelGroup, batch: ForwardBatch, num_rows: int, hidden: int,
                         dtype: torch.dtype) -> ForwardBatch:
    """A worker: `batch` (built from the plan) with rank 0's positions and, when `num_rows` > 0, its
    multi-axis positions and `num_rows` override rows [num_rows, hidden] in `dtype`."""
    t, device = batch.num_tokens, batch.input_ids.device
    longs = group.broadcast(torch.empty(t + (3 * t + num_rows if num_rows else 0), dtype=torch.long, device=device))
    if not num_rows:
        return dataclasses.replace(batch, positions=longs)
    rows = group.broadcast(torch.empty(num_rows, hidden, dtype=dtype, device=device))
    return dataclasses.replace(batch, positions=longs[:t], mrope_positions=longs[t:4 * t].view(3, t),
                               embedding_overrides=(longs[4 * t:], rows))
