"""``planner``: the capacity model's predictions and the policy's decisions (hysteresis,
dwell, queue time, which worker moves), I/O-free on a fake clock. The step costs are the
simulator's test profile (``sim.profile.StepModel`` is a ``planner.capacity.StepCosts``)."""

from __future__ import annotations

import math

import pytest

from planner.capacity import CapacityModel, Traffic, effective_prefill_rate
from planner.policy import Observation, Planner, PlannerConfig, WorkerState
from tests.sim.profiles import small_profile

LONG = Traffic(rate=20, prompt_tokens=2000, output_tokens=32)  # prefill-heavy
CHAT = Traffic(rate=20, prompt_tokens=200, output_tokens=400)  # decode-heavy
CONFIG = PlannerConfig(ttft_slo_s=0.5, tpot_slo_s=0.01, dwell_s=30, min_prefill=1)


def _model() -> CapacityModel:
    return CapacityModel(small_profile().step(1), max_num_batched_tokens=512, handoff_s=0.005)


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _observe(num_prefill: int, traffic: Traffic, *, held: dict[str, int] | None = None,
             wait_s: float = 0.0, n: int = 4) -> Observation:
    held = held or {}
    workers = tuple(WorkerState(f"w{i}", "prefill" if i < num_prefill else "decode",
                                held.get(f"w{i}", 0), wait_s if i < num_prefill else 0.0)
                    for i in range(n))
    return Observation(workers, traffic)


def test_the_model_gives_each_mix_the_split_it_needs() -> None:
    model = _model()
    assert model.prefill_s(2000) > 5 * model.prefill_s(200)
    assert model.prefill_rate(2000) * model.prefill_s(2000) == pytest.approx(1.0, rel=0.2)

    def attainment(traffic: Traffic, p: int) -> float:
        return model.predict(traffic, p, 4 - p, ttft_slo_s=0.5, tpot_slo_s=0.01).attainment

    assert attainment(LONG, 1) < 0.1 < 0.9 < attainment(LONG, 2)  # one prefill worker is at rho 1
    assert attainment(CHAT, 1) > 0.9 and attainment(CHAT, 3) == 0.0  # one decode worker: overload
    assert math.isinf(model.decode_step(CHAT, 1)) and model.decode_step(CHAT, 3) < 0.01


def test_the_model_counts_the_fixed_costs_of_prefill_and_batched_steps() -> None:
    import dataclasses

    plain = small_profile().step(1)
    costs = dataclasses.replace(plain, multi_token_s=0.001, prefill_step_s=0.003)
    before, after = _model(), CapacityModel(costs, max_num_batched_tokens=512, handoff_s=0.005)
    # 1,000 tokens: two chunks, each a step of more than one token that prefills
    assert after.prefill_s(1000) == pytest.approx(before.prefill_s(1000) + 2 * 0.004)
    assert 1 / after.prefill_rate(1024) == pytest.approx(1 / before.prefill_rate(1024) + 0.008)
    # a loaded decode worker's step computes several tokens: its fixed cost is both; one
    # that holds about one stream at a time computes one token a step
    assert before.decode_step(CHAT, 3) * CHAT.rate * CHAT.output_tokens / 3 > 1
    assert after.decode_step(CHAT, 3) > before.decode_step(CHAT, 3) + 0.001
    light = Traffic(rate=0.5, prompt_tokens=200, output_tokens=100)
    assert after.decode_step(light, 3) == before.decode_step(light, 3)

    def near(batch: float) -> Traffic:  # the rate at which 3 workers hold about `batch` each
        step = before.decode_step(CHAT, 3)
        return Traffic(rate=CHAT.rate * batch / (step * CHAT.rate * CHAT.output_tokens / 3),
                       prompt_tokens=CHAT.prompt_tokens, output_tokens=CHAT.output_tokens)

    # no jump where the batch passes one: multi_token comes in over the second sequence
    assert after.decode_step(near(0.999), 3) == pytest.approx(before.decode_step(near(0.999), 3),
                                                               rel=0.01)
    assert after.decode_step(near(1.001), 3) == pytest.approx(after.decode_step(near(0.999), 3),
                                                               rel=0.01)


def test_a_measured_queue_wait_implies_the_rate_that_explains_it() -> None:
    lam, pooled = 10.0, 12.0
    wait = lam / (pooled * (pooled - lam))  # M/M/1 queue wait at rate 12
    assert effective_prefill_rate(Traffic(lam, 100, 10), 2, wait) == pytest.approx(pooled / 2)
    assert math.isinf(effective_prefill_rate(Traffic(lam, 100, 10), 2, 0.0))


def test_a_phase_shift_moves_one_worker_at_a_time_the_least_loaded_one() -> None:
    clock = _Clock()
    planner = Planner(CONFIG, _model(), clock)
    [change] = planner.decide(_observe(1, LONG, held={"w1": 5, "w2": 1, "w3": 3}))
    assert (change.worker_id, change.from_role, change.to_role) == ("w2", "decode", "prefill")
    assert change.predicted_after > change.predicted_before + CONFIG.min_gain
    assert "1P+3D" in change.reason and "2P+2D" in change.reason and "20.00 req/s" in change.reason
    clock.t = 100.0  # the mix turns decode-heavy: prefill workers go back to decode
    [back] = planner.decide(_observe(3, CHAT, held={"w0": 2, "w1": 0, "w2": 7}))
    assert (back.worker_id, back.from_role, back.to_role) == ("w1", "prefill", "decode")
    assert planner.decisions == [change, back]


def test_no_role_changes_twice_within_the_dwell_time() -> None:
    clock = _Clock()
    planner = Planner(CONFIG, _model(), clock)
    assert planner.decide(_observe(1, LONG))
    clock.t = CONFIG.dwell_s - 1  # the model still says "more prefill": it waits
    assert planner.decide(_observe(2, CHAT)) == [] and planner.decide(_observe(1, LONG)) == []
    clock.t = CONFIG.dwell_s + 1
    assert planner.decide(_observe(1, LONG))


def test_a_flickering_load_moves_nothing() -> None:
    planner = Planner(CONFIG, _model(), _Clock())
    for i in range(20):  # the rate wobbles by 15% around a split that serves both
        traffic = Traffic(rate=18 + 3 * (i % 2), prompt_tokens=2000, output_tokens=32)
        assert planner.decide(_observe(2, traffic)) == [], i
    assert planner.decide(_observe(2, Traffic(0.0, 0, 0))) == []  # no traffic: no evidence


def test_queue_time_the_model_does_not_predict_moves_a_worker() -> None:
    light = Traffic(rate=5, prompt_tokens=2000, output_tokens=32)  # rho 0.25 by the model
    assert Planner(CONFIG, _model(), _Clock()).decide(_observe(1, light)) == []
    # the prefill worker's queue says otherwise (a slower machine, a noisy neighbour)
    [change] = Planner(CONFIG, _model(), _Clock()).decide(_observe(1, light, wait_s=2.0))
    assert change.to_role == "prefill" and "prefill queue 2.00s" in change.reason


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="SLOs must be positive"):
        PlannerConfig(ttft_slo_s=0, tpot_slo_s=0.01)
    with pytest.raises(ValueError, match="min_decode"):
        PlannerConfig(ttft_slo_s=1, tpot_slo_s=0.01, min_decode=0)


def test_a_colocated_splits_observed_itl_is_judged_against_its_own_prediction() -> None:
    """Workers that prefill their own prompts (0P) stretch their decode steps by the time
    they spend prefilling: an observed ITL equal to that stretched prediction says the
    model is right (no correction), where against the bare decode step it would read as
    decoding too slow, and every split's decode costs would be scaled up."""
    model = _model()
    mix = Traffic(rate=24, prompt_tokens=2000, output_tokens=64)
    bare, stretched = model.decode_step(mix, 4), model.inter_token_s(mix, 0, 4)
    assert stretched > 1.2 * bare  # a fifth of their time and more goes to prefills
    assert model.inter_token_s(mix, 1, 3) == model.decode_step(mix, 3)  # no stretch with 1P
    config = PlannerConfig(ttft_slo_s=0.5, tpot_slo_s=0.01, min_prefill=0)
    planner = Planner(config, model, _Clock())
    observed = Observation(_observe(0, mix).workers, mix, itl_s=stretched)
    got = {p.num_prefill: p for p in planner.predictions(observed)}
    for p in (0, 1, 2):
        want = model.predict(mix, p, 4 - p, ttft_slo_s=0.5, tpot_slo_s=0.01,
                             prefill_rate=model.prefill_rate(2000))
        assert got[p].decode_step_s == pytest.approx(want.decode_step_s), p
