"""``planner.scaling`` through ``Planner.decide``: with ``max_workers`` the planner adds a
worker when that gains more than switching roles can, removes one that is not needed, and
does neither beyond its bounds, within its dwell, or back and forth (I/O-free, fake clock)."""

from __future__ import annotations

import dataclasses

import pytest

from planner.capacity import Traffic
from planner.policy import Planner, PlannerConfig, RoleChange
from planner.scaling import ScaleChange
from tests.planner.test_policy import CHAT, LONG, _Clock, _model, _observe

SCALING = PlannerConfig(ttft_slo_s=0.5, tpot_slo_s=0.01, dwell_s=30, min_prefill=1,
                        min_workers=2, max_workers=6)
LIGHT = Traffic(rate=2, prompt_tokens=200, output_tokens=100)  # any split of 2+ serves it


def _one(decisions: list[object]) -> ScaleChange:
    [change] = decisions
    assert isinstance(change, ScaleChange)
    return change


def test_a_worker_is_added_where_no_switch_can_serve_the_load() -> None:
    planner = Planner(SCALING, _model(), _Clock())
    # 1P+1D under prefill-heavy traffic: the bounds leave nothing to switch; a second
    # prefill worker is predicted to serve it
    add = _one(planner.decide(_observe(1, LONG, n=2)))
    assert (add.action, add.role, add.worker_id) == ("add", "prefill", None)
    assert (add.num_prefill, add.num_decode) == (2, 1)
    assert add.predicted_after > add.predicted_before + SCALING.min_gain
    assert "1P+1D" in add.reason and "2P+1D" in add.reason
    # decode-heavy on 1P+2D: every split of 3 fails; a third decode worker serves it
    grow = _one(Planner(SCALING, _model(), _Clock()).decide(_observe(1, CHAT, n=3)))
    assert (grow.action, grow.role, grow.num_prefill, grow.num_decode) == ("add", "decode", 1, 3)


def test_a_switch_comes_before_a_removal_and_an_idle_worker_goes() -> None:
    # 1P+3D under prefill-heavy traffic: 2P+1D would do, but first the split moves
    [switch] = Planner(SCALING, _model(), _Clock()).decide(_observe(1, LONG, n=4))
    assert isinstance(switch, RoleChange) and switch.to_role == "prefill"
    # light traffic on 2P+3D: one worker fewer loses nothing; the least-held decode goes
    planner = Planner(SCALING, _model(), _Clock())
    remove = _one(planner.decide(_observe(2, LIGHT, n=5, held={"w2": 3, "w3": 0, "w4": 1})))
    assert (remove.action, remove.role, remove.worker_id) == ("remove", "decode", "w3")
    assert (remove.num_prefill, remove.num_decode) == (2, 2)
    # no traffic at all: a worker holding nothing goes, down to min_workers, not below
    idle = Traffic(0.0, 0, 0)
    clock = _Clock()
    planner = Planner(SCALING, _model(), clock)
    gone = _one(planner.decide(_observe(1, idle, n=3)))
    assert (gone.action, gone.role, gone.worker_id) == ("remove", "decode", "w1")
    clock.t = 100.0
    assert planner.decide(_observe(1, idle, n=2)) == [] and planner.held == "no_traffic"
    busy = Planner(SCALING, _model(), _Clock())  # a decode worker still streams: it stays
    assert busy.decide(_observe(1, idle, n=3, held={"w1": 1, "w2": 2})) == []


def test_an_added_worker_is_not_removed_while_the_load_stays_and_steps_wait_the_dwell() -> None:
    clock = _Clock()
    planner = Planner(SCALING, _model(), clock)
    assert _one(planner.decide(_observe(1, LONG, n=2))).action == "add"
    clock.t = SCALING.dwell_s + 1
    for i in range(10):  # 2P+1D serves it; fewer would not and more gains < min_gain
        assert planner.decide(_observe(2, LONG, n=3)) == [], i
    assert planner.held == "gain"
    planner = Planner(SCALING, _model(), clock)  # a fresh planner: its own dwell
    clock.t = 200.0
    assert _one(planner.decide(_observe(1, CHAT, n=3))).action == "add"
    clock.t = 210.0  # within the dwell: it waits
    assert planner.decide(_observe(1, CHAT, n=3)) == [] and planner.held == "scaling"
    assert planner.desired is not None and planner.desired.num_decode == 3
    assert planner.wanted == (1, 3)
    clock.t = 260.0  # past the dwell, the new worker still not seen: no second step
    assert planner.decide(_observe(1, CHAT, n=3)) == [] and planner.held == "scaling"
    clock.t = 200.0 + SCALING.scale_timeout_s  # given up on: it may ask again
    assert _one(planner.decide(_observe(1, CHAT, n=3))).action == "add"


def test_bounds_hold_and_bad_bounds_are_refused() -> None:
    capped = dataclasses.replace(SCALING, max_workers=2)
    assert Planner(capped, _model(), _Clock()).decide(_observe(1, LONG, n=2)) == []
    fixed = dataclasses.replace(SCALING, min_workers=None, max_workers=None)
    assert Planner(fixed, _model(), _Clock()).decide(_observe(2, LIGHT, n=5)) == []
    with pytest.raises(ValueError, match="min_workers needs max_workers"):
        PlannerConfig(ttft_slo_s=1, tpot_slo_s=0.1, min_workers=2)
    with pytest.raises(ValueError, match="max_workers \\(1\\) must be at least"):
        PlannerConfig(ttft_slo_s=1, tpot_slo_s=0.1, min_prefill=1, max_workers=1)
    with pytest.raises(ValueError, match="at least min_prefill"):
        PlannerConfig(ttft_slo_s=1, tpot_slo_s=0.1, min_prefill=1, min_workers=1,
                      max_workers=3)
    with pytest.raises(ValueError, match="below min_gain"):
        PlannerConfig(ttft_slo_s=1, tpot_slo_s=0.1, max_workers=3, scale_down_slack=0.05)



def test_a_split_below_its_floors_is_repaired_and_a_cluster_below_its_minimum_grows() -> None:
    # the only prefill worker is gone (an autoscaler took the highest ordinal): a decode
    # worker switches, whatever the traffic says
    planner = Planner(SCALING, _model(), _Clock())
    [fix] = planner.decide(_observe(0, LIGHT, n=3, held={"w0": 4, "w1": 0, "w2": 2}))
    assert isinstance(fix, RoleChange) and (fix.worker_id, fix.to_role) == ("w1", "prefill")
    assert "outside the roles' bounds" in fix.reason and planner.wanted == (1, 2)
    roomy = dataclasses.replace(SCALING, min_workers=4)  # 2 run, 4 at least: it adds
    grow = _one(Planner(roomy, _model(), _Clock()).decide(_observe(1, LIGHT, n=2)))
    assert grow.action == "add" and grow.num_prefill + grow.num_decode == 3


def test_the_wanted_split_follows_an_idle_cluster_down() -> None:
    clock = _Clock()
    planner = Planner(SCALING, _model(), clock)
    idle = Traffic(0.0, 0, 0)
    assert _one(planner.decide(_observe(1, idle, n=4))).worker_id == "w1"
    assert planner.wanted == (1, 2)  # what the gauges (and an HPA) read
    clock.t = 40.0  # the removal not seen yet: the size it asked for still stands
    assert planner.decide(_observe(1, idle, n=4)) == [] and planner.wanted == (1, 2)


def test_each_roles_cap_bounds_the_splits_the_switches_and_the_size() -> None:
    # decode-heavy on 1P+2D: uncapped, a third decode worker is added; with max_decode 2
    # no split of any size the caps allow serves it better, so nothing is added
    capped = dataclasses.replace(SCALING, max_decode=2)
    assert capped.size_bounds(3) == (2, 6)
    assert list(capped.prefill_counts(5)) == [3, 4]  # at most 2 decode, at least 1 prefill
    planner = Planner(capped, _model(), _Clock())
    decisions = planner.decide(_observe(1, CHAT, n=3))
    assert not any(isinstance(d, ScaleChange) and d.role == "decode" for d in decisions)
    assert all(o.num_decode <= 2 for o in planner.predictions(_observe(1, CHAT, n=3), 5))
    # prefill-heavy on 1P+1D with max_prefill 1: the size is capped at 1 + max_decode
    both = dataclasses.replace(SCALING, max_prefill=1, max_decode=2)
    assert both.size_bounds(2) == (2, 3)
    held = Planner(both, _model(), _Clock())
    assert held.decide(_observe(1, LONG, n=2)) == []  # uncapped, a prefill worker is added
    assert held.desired is not None and held.desired.num_prefill == 1
    # a split over a cap (a worker was switched by hand) is switched back within it
    over = Planner(dataclasses.replace(SCALING, max_prefill=1), _model(), _Clock())
    [fix] = over.decide(_observe(3, LIGHT, n=4))
    assert isinstance(fix, RoleChange) and (fix.from_role, fix.to_role) == ("prefill", "decode")
    assert "outside the roles' bounds" in fix.reason
    with pytest.raises(ValueError, match="max_decode"):
        dataclasses.replace(SCALING, max_decode=0)
    with pytest.raises(ValueError, match="max_prefill \\+ max_decode"):
        dataclasses.replace(SCALING, min_workers=5, max_prefill=1, max_decode=2)


def test_a_cluster_larger_than_the_caps_allow_sheds_a_worker_of_the_role_over_its_cap() -> None:
    # 2P+3D with caps 1 + 2 (an autoscaler added workers): no switch can fix it, so a
    # prefill worker goes (the least held), then, once that is seen, a decode worker
    config = dataclasses.replace(SCALING, max_prefill=1, max_decode=2)
    clock = _Clock()
    planner = Planner(config, _model(), clock)
    first = _one(planner.decide(_observe(2, LIGHT, n=5, held={"w0": 2, "w1": 0})))
    assert (first.action, first.role, first.worker_id) == ("remove", "prefill", "w1")
    assert "prefill 1..1" in first.reason and (first.num_prefill, first.num_decode) == (1, 3)
    assert planner.decide(_observe(2, LIGHT, n=5)) == [] and planner.held == "scaling"
    clock.t = 1.0
    second = _one(planner.decide(_observe(1, LIGHT, n=4)))
    assert (second.action, second.role) == ("remove", "decode")
    # without max_workers the planner does not size the cluster: it holds
    fixed = Planner(dataclasses.replace(config, min_workers=None, max_workers=None), _model(),
                    _Clock())
    assert fixed.decide(_observe(2, LIGHT, n=5)) == [] and fixed.held == "bounds"


def test_a_switch_worth_its_gain_comes_before_an_add_and_the_gauges_ask_one_step() -> None:
    """A switch takes effect at once, a new worker in minutes (or never, where the
    launcher cannot place it): where switching gains ``min_gain``, the switch comes first
    and the add is weighed again from the split it leaves. The wanted split (what the
    gauges, and an autoscaler, read) is the step's: one worker more, not the largest size."""
    config = dataclasses.replace(SCALING, max_workers=8)
    heavy = Traffic(rate=38, prompt_tokens=2000, output_tokens=32)
    clock = _Clock()
    planner = Planner(config, _model(), clock)
    # 1P+3D fails it; 2P+2D serves 0.4 of it, and 5 workers or more almost all
    [switch] = planner.decide(_observe(1, heavy, n=4))
    assert isinstance(switch, RoleChange) and switch.to_role == "prefill"
    clock.t = config.dwell_s + 1
    add = _one(planner.decide(_observe(2, heavy, n=4)))  # no switch gains: a worker comes
    assert add.action == "add" and add.num_prefill + add.num_decode == 5
    assert planner.wanted == (add.num_prefill, add.num_decode)
    clock.t += 10  # not seen yet: the gauges still ask for that one worker more
    assert planner.decide(_observe(2, heavy, n=4)) == [] and planner.held == "scaling"
    assert planner.wanted == (add.num_prefill, add.num_decode)


def test_a_cluster_below_its_minimum_with_a_role_under_its_floor_grows_that_role() -> None:
    """1P+1D where min_decode is 2 and min_workers 3 (a decode worker gone, not back): no
    switch can lift the decode floor (prefill is at its own), so a decode worker is added
    (it held "bounds" for ever)."""
    config = dataclasses.replace(SCALING, min_decode=2, min_workers=3, max_workers=5)
    clock = _Clock()
    planner = Planner(config, _model(), clock)
    add = _one(planner.decide(_observe(1, LIGHT, n=2)))
    assert (add.action, add.role, add.num_prefill, add.num_decode) == ("add", "decode", 1, 2)
    assert "under" in add.reason and planner.wanted == (1, 2)
    clock.t = 10.0  # not seen yet: no second step
    assert planner.decide(_observe(1, LIGHT, n=2)) == [] and planner.held == "scaling"
