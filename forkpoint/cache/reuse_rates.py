"""The rates the restore-versus-recompute rule (cache/reuse_rule.py) weighs, measured as the engine runs.

What is measured, and where (the engine sees a step's device work end only when its result is back:
the plan's writes, restores included, run before its forward, in one enqueued step):

- `step` (a `StepCost`): every step without restores, its seconds against the tokens its forward
  computed (prompt tokens plus decodes), fitted as `seconds = fixed + per_token * tokens` by least
  squares over exponentially decayed sums. `per_token` is the prefill cost the rule charges a
  recomputed token (the marginal cost: a token added to a step's chunk); `fixed` is what any step
  costs (the weights' pass, the sampled rows' logits, the host's work), which a step with restores
  pays whatever it restores.
- `host_restore`, `disk_restore` (s/byte, `MeasuredCost`): a step with restores (`Restore` from the
  host tier, `DiskRestore` of a verified file): its seconds less the fitted cost of its tokens (its
  excess, at least 0), split between the two tiers by their bytes. With no step cost measured yet the
  step is not used (its excess cannot be told apart). The step's other writes (spills, saves) count in
  the excess.
- `disk_read` (s/byte, `MeasuredCost`): a checkpoint file read and verified (cache/disk_tier.py times
  the read where it runs, on the reader thread for a read ahead).

A `MeasuredCost` is the ratio of exponentially decayed sums of observed seconds and units (each new
observation multiplies both sums by `decay` first), so recent observations count most and a large one
more than a small one. Nothing has a value until something was observed: a fresh engine measures
nothing, and the rule then reuses as before it existed.

Re-probing: a tier whose cost makes the rule decline is never used, so never measured again, and one
slow outlier would keep it out for good. Each decline therefore ages that tier's cost (`age`: its
weight, the decayed count of its observations, times `decay`); once the weight falls below
`MIN_WEIGHT` the cost counts as unmeasured again, the next hit is restored and measured afresh (with
decay 0.8, after about 14 declines in a row for a cost of one observation, 21 for a steady one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from forkpoint.step.plan import DiskRestore, Restore, StepPlan

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
class StepCost:
    """A step's seconds as `fixed + per_token * tokens`, fitted by least squares over decayed sums of the
    observations (`weight`: their decayed count; `tokens`, `seconds`, `tokens_sq`, `tokens_seconds`: the
    decayed sums of x, y, x^2, x*y). When the tokens hardly vary (a single observation, or steps all of
    one size) or the fit is not physical (a slope <= 0, a negative fixed cost), the line is taken through
    the origin instead (`fixed` 0), so `per_token` then errs high."""

    weight: float = 0.0
    tokens: float = 0.0
    seconds: float = 0.0
    tokens_sq: float = 0.0
    tokens_seconds: float = 0.0
    decay: float = DEFAULT_DECAY

    def __post_init__(self) -> None:
        if min(self.weight, self.tokens, self.seconds, self.tokens_sq, self.tokens_seconds) < 0:
            raise ValueError("a step cost's sums must be >= 0")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must lie in (0, 1], got {self.decay}")

    @classmethod
    def per_token_prior(cls, seconds_per_token: float, decay: float = DEFAULT_DECAY) -> StepCost:
        """A prior of one observation: one token in `seconds_per_token` (fixed 0)."""
        return cls(1.0, 1.0, seconds_per_token, 1.0, seconds_per_token, decay)

    def observe(self, seconds: float, tokens: int) -> None:
        """A step computed `tokens` (> 0; a step of none is ignored) in `seconds` (>= 0)."""
        if seconds < 0 or tokens < 0:
            raise ValueError(f"an observation needs seconds >= 0 and tokens >= 0, got {seconds}, {tokens}")
        if tokens == 0:
            return
        d = self.decay
        self.weight = self.weight * d + 1.0
        self.tokens = self.tokens * d + tokens
        self.seconds = self.seconds * d + seconds
        self.tokens_sq = self.tokens_sq * d + tokens * tokens
        self.tokens_seconds = self.tokens_seconds * d + tokens * seconds

    def fit(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), None before any observation."""
        if self.tokens <= 0:
            return None
        spread = self.weight * self.tokens_sq - self.tokens * self.tokens
        if spread > 1e-6 * self.weight * self.tokens_sq:
            slope = (self.weight * self.tokens_seconds - self.tokens * self.seconds) / spread
            fixed = (self.seconds - slope * self.tokens) / self.weight
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, self.tokens_seconds / self.tokens_sq

    @property
    def per_token(self) -> float | None:
        fitted = self.fit()
        return None if fitted is None else fitted[1]

    def predict(self, tokens: int) -> float | None:
        """The fitted seconds of a step computing `tokens`, None before any observation."""
        fitted = self.fit()
        return None if fitted is None else fitted[0] + fitted[1] * tokens


@dataclass
class ReuseRates:
    """The engine's measured costs (see the module docstring); one per registry, updated on the engine
    thread only."""

    step: StepCost = field(default_factory=StepCost)  # a step's seconds against its tokens; per_token: prefill
    host_restore: MeasuredCost = field(default_factory=MeasuredCost)  # seconds per byte restored from the host
    disk_read: MeasuredCost = field(default_factory=MeasuredCost)  # seconds per byte of file read and verified
    disk_restore: MeasuredCost = field(default_factory=MeasuredCost)  # seconds per byte of verified file restored

    def observe_step(self, seconds: float, tokens: int, host_bytes: int = 0, disk_bytes: int = 0) -> None:
        """A step took `seconds` from its launch until its result was back: its forward computed `tokens`
        (prompt tokens and decodes), after restoring `host_bytes` from the host tier and `disk_bytes` of
        verified files."""
        moved = host_bytes + disk_bytes
        if not moved:
            self.step.observe(seconds, tokens)
            return
        predicted = self.step.predict(tokens)
        if predicted is None:
            return
        excess = max(seconds - predicted, 0.0)
        self.host_restore.observe(excess * host_bytes / moved, host_bytes)
        self.disk_restore.observe(excess * disk_bytes / moved, disk_bytes)

    def observe_plan(self, plan: StepPlan, seconds: float, slot_bytes: int, block_bytes: int) -> None:
        """`observe_step` for a plan that ran in `seconds`: its segments' tokens (a decode computes one),
        its `Restore`s (a state row of `slot_bytes` and KV blocks of `block_bytes` each: the host entry's
        bytes) and its `DiskRestore`s (their payloads). A speculative step (verifies) is not used."""
        if plan.verifies:
            return
        tokens = sum(s.end - s.start for s in plan.segments)
        host_bytes = sum(slot_bytes + len(w.blocks) * block_bytes for w in plan.writes if isinstance(w, Restore))
        disk_bytes = sum(len(w.payload) for w in plan.writes if isinstance(w, DiskRestore))
        self.observe_step(seconds, tokens, host_bytes, disk_bytes)

    def values(self) -> dict[str, float]:
        """The costs measured so far, for metrics (a cost not yet measured is left out)."""
        fitted = self.step.fit()
        values = {} if fitted is None else {"reuse_step_fixed_s": fitted[0], "reuse_prefill_s_per_token": fitted[1]}
        costs = {"host_restore_s_per_byte": self.host_restore, "disk_read_s_per_byte": self.disk_read,
                 "disk_restore_s_per_byte": self.disk_restore}
        values.update({f"reuse_{name}": cost.per_unit for name, cost in costs.items() if cost.per_unit is not None})
        return values
