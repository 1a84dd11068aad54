"""The measured costs (cache/reuse_rates.py): decayed ratios of sums, and a step's seconds split into
prefill, decode and restore time."""

from __future__ import annotations

import pytest

from forkpoint.cache.reuse_rates import MeasuredCost, ReuseRates
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


def test_steps_split_into_decode_prefill_and_restore_time():
    rates = ReuseRates(**{name: MeasuredCost(decay=1.0) for name in
                          ("prefill", "decode", "host_restore", "disk_read", "disk_restore")})
    rates.observe_step(0.5, prompt_tokens=0, decodes=1, host_bytes=100)  # no prefill cost yet: not used
    assert rates.host_restore.per_unit is None and rates.decode.per_unit is None
    rates.observe_step(0.04, prompt_tokens=0, decodes=4)  # 0.01 s per decode
    rates.observe_step(1.02, prompt_tokens=100, decodes=2)  # 1.0 s for 100 tokens
    assert rates.decode.per_unit == pytest.approx(0.01) and rates.prefill.per_unit == pytest.approx(0.01)
    # 100 tokens (1 s) and 2 decodes (0.02 s), then 0.3 s more for 3000 bytes: 1000 host, 2000 from disk
    rates.observe_step(1.32, prompt_tokens=100, decodes=2, host_bytes=1000, disk_bytes=2000)
    assert rates.host_restore.per_unit == pytest.approx(1e-4) and rates.disk_restore.per_unit == pytest.approx(1e-4)
    assert rates.prefill.per_unit == pytest.approx(0.01)  # a step with restores does not count as prefill
    rates.observe_step(0.5, prompt_tokens=100, decodes=0, host_bytes=1000)  # faster than predicted: no excess
    assert rates.host_restore.per_unit == pytest.approx(0.1 / 2000)
    assert set(rates.values()) == {"reuse_prefill_s_per_token", "reuse_decode_s_per_decode",
                                   "reuse_host_restore_s_per_byte", "reuse_disk_restore_s_per_byte"}


def _segment(kind: SegmentKind, start: int, end: int) -> Segment:
    return Segment(request_id=f"r{start}", start=start, end=end, token_ids=list(range(end - start)), block_table=[1],
                   initial_slot=1, dest_slots=(1,), kind=kind, phase=1, samples=True)


def test_a_plan_counts_its_prompt_tokens_decodes_and_restored_bytes():
    rates = ReuseRates(prefill=MeasuredCost(seconds=1.0, units=100.0, decay=1.0),
                       host_restore=MeasuredCost(decay=1.0), disk_restore=MeasuredCost(decay=1.0))
    plan = StepPlan(segments=(_segment(SegmentKind.PREFILL, 10, 60), _segment(SegmentKind.DECODE, 7, 8)),
                    writes=(Restore(0, 5, (1, 2)), DiskRestore(6, (3,), bytearray(300))))
    # 50 tokens: 0.5 s; the decode's cost is not measured (0); host: 100 + 2 * 50 = 200 bytes, disk: 300
    rates.observe_plan(plan, 1.0, slot_bytes=100, block_bytes=50)
    assert rates.host_restore.per_unit == pytest.approx(0.5 / 500) and rates.host_restore.units == 200
    assert rates.disk_restore.units == 300
    rates.observe_plan(StepPlan(segments=plan.segments, verifies=(Verify("r10", 60, (1,)),)), 9.0, 100, 50)
    assert rates.prefill.units == 100  # speculative steps are not used


def test_a_cost_aged_by_declines_counts_as_unmeasured_until_observed_again():
    cost = MeasuredCost(seconds=1.0, units=1.0)  # a prior: one observation
    ages = 0
    while cost.per_unit is not None:
        cost.age()
        ages += 1
    assert ages == 14  # 0.8 ** 14 < MIN_WEIGHT = 0.05 <= 0.8 ** 13
    cost.observe(0.5, 1.0)  # re-measured: counts again, the old sums still in it
    assert cost.per_unit == pytest.approx(1.3 / 1.8)
