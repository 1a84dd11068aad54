"""The restore-versus-recompute rule: take a checkpoint from the host or disk tier only when moving it
back costs no more than twice computing the tokens it saves (issue 32; DECLINE_MARGIN below).

Inputs (all measured, cache/reuse_rates.py; seconds, bytes, tokens):

- `tier`: where the candidate checkpoint is (`Tier.HOST` or `Tier.DISK`);
- `num_bytes`: what moves: a host entry's bytes (state row and KV blocks), or a file's bytes;
- `tokens_saved`: the prompt tokens the candidate saves over the best alternative that needs no move
  (the longest READY device checkpoint below it the request may read, or nothing): its state position
  less the alternative's (less 0);
- `read_done`: a disk candidate whose read ahead has finished (its read is paid already).

Formula, with c_x the measured seconds per unit of `ReuseRates` (a cost not measured yet counts 0;
c_prefill: the fitted marginal seconds per token of a step, `ReuseRates.step.per_token`)::

    restore_s   = num_bytes * c_host_restore                                    (host tier)
                = num_bytes * ((0 if read_done else c_disk_read) + c_disk_restore)   (disk tier)
    recompute_s = tokens_saved * c_prefill
    restore  <=>  c_prefill unmeasured  or  restore_s <= DECLINE_MARGIN * recompute_s

So a fresh engine (nothing measured) restores every hit as before the rule existed, and a tier is
declined only when what is measured of its cost exceeds twice the compute it saves. The margin guards
the restore side's noise: it is a step's excess over the fitted step time (cache/reuse_rates.py), so a
slow step (a collection pause, a spill in the same step) counts as restore time, and a few such steps
would otherwise decline restores that save thousands of tokens, each decline costing the whole
recompute. Where a tier is really slower (a slow disk under a short prefix) the costs differ by far
more than 2x, and the rule still declines.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from forkpoint.cache.reuse_rates import ReuseRates

DECLINE_MARGIN = 2.0  # a hit is declined only when moving it costs more than this times the recompute


class Tier(enum.Enum):
    HOST = "host"
    DISK = "disk"


@dataclass(frozen=True)
class ReuseEstimate:
    """The rule's two sides in seconds (`recompute_s` None: no prefill cost measured yet)."""

    restore_s: float
    recompute_s: float | None

    @property
    def restore(self) -> bool:
        return self.recompute_s is None or self.restore_s <= DECLINE_MARGIN * self.recompute_s


def estimate(rates: ReuseRates, tier: Tier, num_bytes: int, tokens_saved: int, *,
             read_done: bool = False) -> ReuseEstimate:
    """The cost of moving `num_bytes` back from `tier` against computing `tokens_saved` tokens."""
    if num_bytes < 0 or tokens_saved < 0:
        raise ValueError(f"a reuse estimate needs num_bytes >= 0 and tokens_saved >= 0, got {num_bytes}, "
                         f"{tokens_saved}")
    if tier is Tier.HOST:
        per_byte = rates.host_restore.per_unit or 0.0
    else:
        per_byte = (0.0 if read_done else rates.disk_read.per_unit or 0.0) + (rates.disk_restore.per_unit or 0.0)
    prefill = rates.step.per_token
    return ReuseEstimate(num_bytes * per_byte, None if prefill is None else tokens_saved * prefill)
