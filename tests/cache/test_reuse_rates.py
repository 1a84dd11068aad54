"""The measured costs (cache/reuse_rates.py): decayed ratios of sums, a step's fitted fixed and
per-token cost, and a restore step's excess over it."""

from __future__ import annotations

import pytest

from forkpoint.cache.reuse_rates import MeasuredCost, ReuseRates, StepCost
from forkpoint.step.plan import DiskRestore, Restore, Segment, SegmentKind, StepPlan, Verify


def test_a_cost_is_unknown_until_observed_then_a_decayed_ratio_of_sums():
    cost = MeasuredCost(decay=0.5)
    assert cost.per_unit is None
    cost.observe(0.0, 0)  # no units: ignored
    assert cost.per_unit is None
    cost.observe(2.0, 100)  # 0.02 s/unit
    assert cost.per_unit == pytest.approx(0.02)
    cost.observe(1.0, 100)  # (2 * 0.5 + 1) / (100 * 0.5 + 100)
    assert cost.per_unit == pytest.approx(2.0 / 150)
    for _ in range(40):  # the old observations fade
        cost.observe(1.0, 100)
    assert cost.per_unit == pytest.approx(0.01)


def test_a_prior_counts_as_observations_already_made():
    cost = MeasuredCost(seconds=10.0, units=1.0, decay=0.5)
    assert cost.per_unit == 10.0
    cost.observe(0.0, 1.0)
    assert cost.per_unit == pytest.approx(5.0 / 1.5)


@pytest.mark.parametrize("kwargs", [dict(seconds=-1.0), dict(units=-1.0), dict(decay=0.0), dict(decay=1.5)])
def test_bad_costs_are_refused(kwargs):
    with pytest.raises(ValueError):
        MeasuredCost(**kwargs)
    with pytest.raises(ValueError):
        MeasuredCost().observe(-1.0, 1)


def test_a_step_cost_fits_a_fixed_part_and_a_per_token_part():
    cost = StepCost(decay=1.0)
    assert cost.fit() is None and cost.predict(10) is None
    cost.observe(0.0, 0)  # no tokens: ignored
    cost.observe(0.12, 10)  # a single size: through the origin
    assert cost.fit() == pytest.approx((0.0, 0.012))
    cost.observe(1.02, 100)  # 0.02 s + 0.01 s per token, exactly
    cost.observe(0.52, 50)
    fixed, per_token = cost.fit()
    assert fixed == pytest.approx(0.02) and per_token == pytest.approx(0.01)
    assert cost.predict(1000) == pytest.approx(10.02)
    unphysical = StepCost(decay=1.0)  # more tokens, less time: a slope <= 0 is not a cost; through the origin
    unphysical.observe(1.0, 10)
    unphysical.observe(0.5, 100)
    assert unphysical.fit() == pytest.approx((0.0, (10 * 1.0 + 100 * 0.5) / (100 + 10_000)))
    assert StepCost.per_token_prior(2e-5).per_token == pytest.approx(2e-5)
    with pytest.raises(ValueError):
        StepCost(weight=-1.0)


def test_a_restore_step_charges_its_excess_over_the_fitted_step_to_the_tiers():
    rates = ReuseRates(step=StepCost(decay=1.0), host_restore=MeasuredCost(decay=1.0),
                       disk_restore=MeasuredCost(decay=1.0))
    rates.observe_step(0.5, tokens=10, host_bytes=100)  # no step cost yet: not used
    assert rates.host_restore.per_unit is None
    rates.observe_step(1.02, tokens=100)
    rates.observe_step(0.52, tokens=50)  # 0.02 s + 0.01 s per token
    # 100 tokens (1.02 s fitted), then 0.3 s more for 3000 bytes: 1000 from the host, 2000 from disk
    rates.observe_step(1.32, tokens=100, host_bytes=1000, disk_bytes=2000)
    assert rates.host_restore.per_unit == pytest.approx(1e-4) and rates.disk_restore.per_unit == pytest.approx(1e-4)
    assert rates.step.fit() == pytest.approx((0.02, 0.01))  # a step with restores does not count in the fit
    rates.observe_step(0.5, tokens=100, host_bytes=1000)  # faster than fitted: no excess
    assert rates.host_restore.per_unit == pytest.approx(0.1 / 2000)
    assert set(rates.values()) == {"reuse_step_fixed_s", "reuse_prefill_s_per_token", "reuse_host_restore_s_per_byte",
                                   "reuse_disk_restore_s_per_byte"}


def _segment(kind: SegmentKind, start: int, end: int) -> Segment:
    return Segment(request_id=f"r{start}", start=start, end=end, token_ids=list(range(end - start)), block_table=[1],
                   initial_slot=1, dest_slots=(1,), kind=kind, phase=1, samples=True)


def test_a_plan_counts_its_tokens_and_restored_bytes():
    rates = ReuseRates(step=StepCost.per_token_prior(0.01, decay=1.0), host_restore=MeasuredCost(decay=1.0),
                       disk_restore=MeasuredCost(decay=1.0))
    plan = StepPlan(segments=(_segment(SegmentKind.PREFILL, 10, 59), _segment(SegmentKind.DECODE, 7, 8)),
                    writes=(Restore(0, 5, (1, 2)), DiskRestore(6, (3,), bytearray(300))))
    # 50 tokens: 0.5 s; host: 100 + 2 * 50 = 200 bytes, disk: 300
    rates.observe_plan(plan, 1.0, slot_bytes=100, block_bytes=50)
    assert rates.host_restore.per_unit == pytest.approx(0.5 / 500) and rates.host_restore.units == 200
    assert rates.disk_restore.units == 300
    rates.observe_plan(StepPlan(segments=plan.segments, verifies=(Verify("r10", 59, (1,)),)), 9.0, 100, 50)
    assert rates.step.weight == 1.0  # speculative steps are not used


def test_a_cost_aged_by_declines_counts_as_unmeasured_until_observed_again():
    cost = MeasuredCost(seconds=1.0, units=1.0)  # a prior: one observation
    ages = 0
    while cost.per_unit is not None:
        cost.age()
        ages += 1
    assert ages == 14  # 0.8 ** 14 < MIN_WEIGHT = 0.05 <= 0.8 ** 13
    cost.observe(0.5, 1.0)  # re-measured: counts again, the old sums still in it
    assert cost.per_unit == pytest.approx(1.3 / 1.8)
