"""The rates the restore-versus-recompute rule (cache/reuse_rule.py) weighs, measured as the engine runs.

Each rate is a `MeasuredCost`: seconds per unit (a prompt token, a decode, a byte), the ratio of
exponentially decayed sums of observed seconds and units (each new observation multiplies both sums
by `decay` first), so recent steps count most and a large observation counts more than a small one.
It has no value (`per_unit` is None) until something was observed: a fresh engine measures nothing and
the rule then reuses as before it existed.

Re-probing: a tier whose cost makes the rule decline is never used, so never measured again, and one
slow outlier would keep it out for good. Each decline therefore ages that tier's cost (`age`: its
weight, the decayed count of its observations, times `decay`); once the weight falls below
`MIN_WEIGHT` the cost counts as unmeasured again, the next hit is restored and measured afresh (with
decay 0.8, after about 14 declines in a row for a cost of one observation, 21 for a steady one).

What is measured, and where (the engine sees a step's device work end only when its result is back:
the plan's writes, restores included, run before its forward, in one enqueued step):

- `prefill` (s/token): a step without restores that computed prompt tokens: its seconds, less its
  decodes at `decode`'s cost, per prompt token computed. Fixed per-step costs and the step's other
  writes (spills, saves) count in, so it errs high: recomputing looks dearer, restoring wins more often.
- `decode` (s/decode): a step of decodes only, no prompt tokens, no restores: its seconds per decode.
- `host_restore`, `disk_restore` (s/byte): a step with restores (`Restore` from the host tier,
  `DiskRestore` of a verified file): its seconds less its prompt tokens and decodes at the costs above
  (its excess, at least 0), split between the two tiers by their bytes. With no prefill cost measured
  yet the step is not used (its excess cannot be told apart).
- `disk_read` (s/byte): a checkpoint file read and verified (cache/disk_tier.py times the read where
  it runs, on the reader thread for a read ahead).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from forkpoint.step.plan import DiskRestore, Restore, SegmentKind, StepPlan

DEFAULT_DECAY = 0.8  # each observation keeps 0.8 of the weight of those before it (about 5 recent ones)
MIN_WEIGHT = 0.05  # a cost aged below this weight counts as unmeasured (re-probing, above)


@dataclass
class MeasuredCost:
    """Seconds per unit: decayed `seconds` over decayed `units` (both >= 0; `decay` in (0, 1]); `weight`:
    the decayed count of observations (a prior given as seconds and units counts as one). A cost can be
    given as a prior (seconds and units already observed), e.g. from an earlier measurement."""

    seconds: float = 0.0
    units: float = 0.0
    decay: float = DEFAULT_DECAY
    weight: float = 1.0

    def __post_init__(self) -> None:
        if self.seconds < 0 or self.units < 0 or self.weight < 0:
            raise ValueError(f"a measured cost needs seconds, units and weight >= 0, got {self.seconds}, "
                             f"{self.units}, {self.weight}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must lie in (0, 1], got {self.decay}")

    def observe(self, seconds: float, units: float) -> None:
        """`units` took `seconds` (both >= 0; an observation of no units is ignored)."""
        if seconds < 0 or units < 0:
            raise ValueError(f"an observation needs seconds >= 0 and units >= 0, got {seconds}, {units}")
        if units == 0:
            return
        self.weight = (self.weight * self.decay if self.units else 0.0) + 1.0
        self.seconds = self.seconds * self.decay + seconds
        self.units = self.units * self.decay + units

    def age(self) -> None:
        """The rule declined what this cost prices: its weight fades (re-probing, module docstring)."""
        self.weight *= self.decay

    @property
    def per_unit(self) -> float | None:
        """Seconds per unit, None until some units were observed or once aged below MIN_WEIGHT."""
        return self.seconds / self.units if self.units > 0 and self.weight >= MIN_WEIGHT else None


@dataclass
class ReuseRates:
    """The engine's measured costs (see the module docstring); one per registry, updated on the engine
    thread only."""

    prefill: MeasuredCost = field(default_factory=MeasuredCost)  # seconds per prompt token computed
    decode: MeasuredCost = field(default_factory=MeasuredCost)  # seconds per decode
    host_restore: MeasuredCost = field(default_factory=MeasuredCost)  # seconds per byte restored from the host
    disk_read: MeasuredCost = field(default_factory=MeasuredCost)  # seconds per byte of file read and verified
    disk_restore: MeasuredCost = field(default_factory=MeasuredCost)  # seconds per byte of verified file restored

    def observe_step(self, seconds: float, prompt_tokens: int, decodes: int, host_bytes: int = 0,
                     disk_bytes: int = 0) -> None:
        """A step took `seconds` from its launch until its result was back: it computed `prompt_tokens`
        prompt tokens and `decodes` single-token decodes, after restoring `host_bytes` from the host tier
        and `disk_bytes` of verified files."""
        decode_cost = self.decode.per_unit or 0.0
        moved = host_bytes + disk_bytes
        if not moved:
            if prompt_tokens:
                self.prefill.observe(max(seconds - decodes * decode_cost, 0.0), prompt_tokens)
            else:
                self.decode.observe(seconds, decodes)
            return
        prefill_cost = self.prefill.per_unit
        if prefill_cost is None:
            return
        excess = max(seconds - prompt_tokens * prefill_cost - decodes * decode_cost, 0.0)
        self.host_restore.observe(excess * host_bytes / moved, host_bytes)
        self.disk_restore.observe(excess * disk_bytes / moved, disk_bytes)

    def observe_plan(self, plan: StepPlan, seconds: float, slot_bytes: int, block_bytes: int) -> None:
        """`observe_step` for a plan that ran in `seconds`: its prefill segments' tokens, its decodes,
        its `Restore`s (a state row of `slot_bytes` and KV blocks of `block_bytes` each: the host entry's
        bytes) and its `DiskRestore`s (their payloads). A speculative step (verifies) is not used."""
        if plan.verifies:
            return
        prompt_tokens = sum(s.end - s.start for s in plan.segments if s.kind is SegmentKind.PREFILL)
        decodes = sum(1 for s in plan.segments if s.kind is SegmentKind.DECODE)
        host_bytes = sum(slot_bytes + len(w.blocks) * block_bytes for w in plan.writes if isinstance(w, Restore))
        disk_bytes = sum(len(w.payload) for w in plan.writes if isinstance(w, DiskRestore))
        self.observe_step(seconds, prompt_tokens, decodes, host_bytes, disk_bytes)

    def values(self) -> dict[str, float]:
        """The costs measured so far, for metrics (a cost not yet measured is left out)."""
        costs = {"prefill_s_per_token": self.prefill, "decode_s_per_decode": self.decode,
                 "host_restore_s_per_byte": self.host_restore, "disk_read_s_per_byte": self.disk_read,
                 "disk_restore_s_per_byte": self.disk_restore}
        return {f"reuse_{name}": cost.per_unit for name, cost in costs.items() if cost.per_unit is not None}
