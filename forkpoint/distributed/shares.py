"""The ranges of a split tensor that one tensor-parallel rank holds (shared by the families' sharding).

Rank r of N holds the r-th contiguous share of every split dimension; a tensor whose split dimension
concatenates several parts (a fused q | k | v projection) holds its share of each part, in order.
"""

from __future__ import annotations

from dataclasses import dataclass

from forkpoint.config import ModelConfig


@dataclass(frozen=True)
class Pieces:
    """The ranges [start, stop) along `dim` of the full tensor that a rank holds, concatenated in order.
    `first_rank_only`: the tensor is whole on rank 0 and zero elsewhere (a row-parallel layer's bias,
    added once by the all-reduce)."""

    dim: int = 0
    ranges: tuple[tuple[int, int], ...] = ()
    first_rank_only: bool = False


def share(total: int, rank: int, world: int, offset: int = 0) -> tuple[int, int]:
    """Rank `rank`'s contiguous share [start, stop) of `total` elements that begin at `offset`."""
    return offset + rank * total // world, offset + (rank + 1) * total // world


def kv_rows(config: ModelConfig, rank: int, world: int) -> tuple[int, int]:
    """The k_proj / v_proj rows of rank `rank`: its share of the KV heads, or, with fewer KV heads than
    ranks, the one KV head its query heads read (replicated world / HKV times)."""
    heads, kv, dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    if kv >= world:
        return share(kv * dim, rank, world)
    head = rank * (heads // world) // (heads // kv)
    return head * dim, (head + 1) * dim
