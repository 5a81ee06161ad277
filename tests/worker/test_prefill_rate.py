"""``worker.prefill_rate``: the prompt tokens per second a prefill worker reports."""

from __future__ import annotations

import pytest

from worker.prefill_rate import PrefillRate


def test_the_rate_follows_full_prompt_steps_and_shrugs_off_one_slow_step() -> None:
    rate = PrefillRate(min_tokens=50, weight=0.1)
    assert rate.tokens_per_s == 0.0  # nothing measured yet
    rate.add(0, 0.5)  # a decode-only step says nothing of prefill
    rate.add(20, 0.1)  # a short prompt's step: mostly fixed cost, not counted
    assert rate.tokens_per_s == 0.0
    rate.add(100, 0.1)
    assert rate.tokens_per_s == pytest.approx(1000.0)
    rate.add(100, 1.0)  # one step stalled 10x: the figure moves by a tenth of the gap
    assert rate.tokens_per_s == pytest.approx(910.0)
    for _ in range(100):  # many steps at half the speed: it follows them
        rate.add(50, 0.1)
    assert rate.tokens_per_s == pytest.approx(500.0, rel=0.01)
    rate.reset()
    assert rate.tokens_per_s == 0.0
    with pytest.raises(ValueError):
        PrefillRate(weight=0.0)
