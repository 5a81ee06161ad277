"""``worker.prefill_rate``: the prompt tokens per second a worker reports to routers."""

from __future__ import annotations

import pytest

from worker.prefill_rate import PrefillRate


def test_the_rate_is_the_full_steps_tokens_over_their_time_lately_weighted() -> None:
    rate = PrefillRate(min_tokens=50, half_life_s=1.0)
    assert rate.tokens_per_s == 0.0  # nothing measured yet
    rate.add(0, 80, 0.5)  # a decode-only step says nothing of prefill
    rate.add(20, 20, 0.1)  # a short prompt's step: mostly fixed cost, not counted
    assert rate.tokens_per_s == 0.0
    rate.add(100, 100, 0.1)
    assert rate.tokens_per_s == pytest.approx(1000.0)
    rate.add(50, 60, 0.1)  # a mixed step counts all it computed
    assert rate.tokens_per_s == pytest.approx(800.0, rel=0.05)
    for _ in range(100):  # 10 s at half the speed: the old figure has faded
        rate.add(50, 50, 0.1)
    assert rate.tokens_per_s == pytest.approx(500.0, rel=0.01)
    with pytest.raises(ValueError):
        PrefillRate(half_life_s=0.0)
