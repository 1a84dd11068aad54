"""The modules a tensor-parallel rank swaps into a model: they keep the parameter names (and so the
loading and the dummy-weight order) of the modules they replace and add the collectives.

    AllReduce                  a layer's `reduce` hook: the sum of the ranks' partial outputs
    VocabParallelEmbedding     the rank's vocab rows: masked lookup, then one all-reduce
    VocabParallelLMHead        the rank's vocab rows of the logits, all-gathered into the full vocab
    SplitGroupGatedRMSNorm     Mamba2's gated norm when the rank holds a fraction of one norm group:
                               the group's sum of squares is all-reduced
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from forkpoint.distributed.collectives import TensorParallelGroup
from forkpoint.models.mamba2 import GroupedGatedRMSNorm


def vocab_parallel_lookup(input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int,
                          group: TensorParallelGroup) -> torch.Tensor:
    """input_ids: [T] long (full vocab ids); weight: [V / N, hidden], the rows of ids vocab_start ..
    -> [T, hidden] on every rank. Ids of other ranks' shares give zero rows here, so the all-reduce
    is exact: every row is one rank's value plus zeros."""
    local = input_ids - vocab_start
    mine = (local >= 0) & (local < weight.shape[0])
    rows = F.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    hidden = torch.where(mine.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype, device=rows.device))
    return group.all_reduce(hidden)


class AllReduce(nn.Module):
    """x: [T, hidden], this rank's partial sum -> the sum over the ranks (in place)."""

    def __init__(self, group: TensorParallelGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(x.contiguous())


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding of the rank's `num_local` vocab rows from `vocab_start`; forward: [T] -> [T, dim]."""

    def __init__(self, num_local: int, dim: int, vocab_start: int, group: TensorParallelGroup) -> None:
        super().__init__(num_local, dim)
        self.vocab_start, self.group = vocab_start, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(input_ids, self.weight, self.vocab_start, self.group)


class VocabParallelLMHead(nn.Linear):
    """nn.Linear (no bias) onto the rank's vocab rows; forward: [R, hidden] -> [R, vocab], the ranks'
    shares gathered in rank order (exact: a concatenation)."""

    def __init__(self, hidden: int, num_local: int, group: TensorParallelGroup) -> None:
        super().__init__(hidden, num_local, bias=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_gather_last(super().forward(x))


class SplitGroupGatedRMSNorm(GroupedGatedRMSNorm):
    """`GroupedGatedRMSNorm` on a rank that holds `dim` channels of norm group `group_index` (of
    `num_groups`, each `group_size` channels wide, split over several ranks). The mean of squares
    is the group's: every rank puts its partial sum of squares in its group's column of a [T,
    num_groups] tensor, one all-reduce adds the ranks' columns."""

    def __init__(self, dim: int, eps: float, norm_before_gate: bool, group: TensorParallelGroup, group_index: int,
                 num_groups: int, group_size: int) -> None:
        super().__init__(dim, 1, eps, norm_before_gate)
        self.group, self.group_index, self.num_groups, self.group_size = group, group_index, num_groups, group_size

    def mean_square(self, grouped: torch.Tensor) -> torch.Tensor:
        """grouped: [T, 1, dim] fp32 -> [T, 1, 1]: the mean of squares over the whole norm group."""
        sums = grouped.new_zeros(grouped.shape[0], self.num_groups)
        sums[:, self.group_index] = grouped.pow(2).sum(dim=(1, 2))
        self.group.all_reduce(sums)
        return (sums[:, self.group_index] / self.group_size).view(-1, 1, 1)
