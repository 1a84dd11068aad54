"""The restore-versus-recompute rule's arithmetic (cache/reuse_rule.py)."""

from __future__ import annotations

import pytest

from forkpoint.cache.reuse_rates import MeasuredCost, ReuseRates, StepCost
from forkpoint.cache.reuse_rule import Tier, estimate

MIB = 1 << 20


def _rates(prefill: float | None = None, **per_unit: float) -> ReuseRates:
    step = StepCost() if prefill is None else StepCost.per_token_prior(prefill)
    return ReuseRates(step=step, **{name: MeasuredCost(seconds=value, units=1.0) for name, value in per_unit.items()})


def test_nothing_measured_restores_as_before_the_rule():
    for tier in Tier:
        verdict = estimate(ReuseRates(), tier, 64 * MIB, 1)
        assert verdict.restore and verdict.restore_s == 0.0 and verdict.recompute_s is None
    # restore costs measured, the prefill's not: still restores
    assert estimate(_rates(host_restore=1.0), Tier.HOST, 64 * MIB, 1).restore


def test_host_restore_against_recompute_at_the_measured_rates():
    # 33 GB/s and 20 us per token (issue 32's H200 numbers): 61 MiB + 100 tokens of KV
    rates = _rates(host_restore=1 / 33e9, prefill=20e-6)
    short = estimate(rates, Tier.HOST, 62 * MIB, 100)
    assert short.restore_s == pytest.approx(62 * MIB / 33e9) and short.recompute_s == pytest.approx(2e-3)
    assert short.restore  # 1.97 ms to move against 2.0 ms to compute
    assert estimate(rates, Tier.HOST, 62 * MIB, 50).restore  # 1.0 ms to compute: within the margin (2x)
    fewer = estimate(rates, Tier.HOST, 62 * MIB, 49)  # 0.98 ms to compute: 1.97 > 2 x 0.98
    assert fewer.recompute_s == pytest.approx(0.98e-3) and not fewer.restore
    assert estimate(rates, Tier.HOST, 0, 0).restore  # equal costs: restore


def test_disk_adds_the_read_unless_it_is_done():
    rates = _rates(disk_read=1 / 1e9, disk_restore=1 / 10e9, prefill=20e-6)  # 1 GB/s disk, 10 GB/s upload
    verdict = estimate(rates, Tier.DISK, 10**9, 10_000)  # 1.1 s against 0.2 s
    assert verdict.restore_s == pytest.approx(1.1) and not verdict.restore
    done = estimate(rates, Tier.DISK, 10**9, 10_000, read_done=True)  # 0.1 s: the read is paid
    assert done.restore_s == pytest.approx(0.1) and done.restore
    assert not estimate(_rates(disk_read=1 / 1e9, prefill=20e-6), Tier.DISK, 10**9, 10_000).restore  # upload unmeasured


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="tokens_saved"):
        estimate(ReuseRates(), Tier.HOST, 1, -1)
