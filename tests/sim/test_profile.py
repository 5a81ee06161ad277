"""The simulator's profile (``sim.profile``): the schema loads, and every wrong field is
refused naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engine.core.scheduler import ScheduledChunk, SchedulerOutput
from sim.profile import ProfileError, from_json, load
from tests.sim.profiles import profile_json


def test_a_profile_round_trips_through_its_json(tmp_path: Path) -> None:
    profile = from_json(profile_json())
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile.to_json()))
    assert load(path) == profile
    assert profile.step(2).base_s == 0.001
    assert profile.transfer_s(1_000_000) == pytest.approx(0.001 + 0.001)


def test_the_step_model_adds_up_its_parts() -> None:
    data = profile_json()
    data["steps"]["1"].update(multi_token_s=3e-4, prefill_step_s=5e-4)
    step = from_json(data).step(1)
    out = SchedulerOutput(
        decodes=[ScheduledChunk("a", (1,), 99, (), True), ScheduledChunk("b", (1,), 9, (), True)],
        prefills=[ScheduledChunk("c", tuple(range(32)), 64, (), True)])
    expected = 0.002 + 3e-4 + 5e-4 + 2e-5 * 32 + 1e-9 * 32 * (64 + 16) + 1e-4 * 2 \
        + 1e-7 * (100 + 10)
    assert step.step_s(out) == pytest.approx(expected)
    # one decode sequence alone: one token, no prefill, neither fixed cost
    one = SchedulerOutput(decodes=[ScheduledChunk("a", (1,), 99, (), True)])
    assert step.step_s(one) == pytest.approx(0.002 + 1e-4 + 1e-7 * 100)
    two = SchedulerOutput(decodes=[ScheduledChunk("a", (1,), 99, (), True),
                                   ScheduledChunk("b", (1,), 99, (), True)])
    assert step.step_s(two) == pytest.approx(0.002 + 3e-4 + 2e-4 + 2e-7 * 100)


def test_a_profile_without_the_fixed_costs_of_a_steps_kind_reads_them_as_zero() -> None:
    step = from_json(profile_json()).step(1)  # written before multi_token_s, prefill_step_s
    assert step.multi_token_s == 0.0 and step.prefill_step_s == 0.0
    broken = profile_json()
    broken["steps"]["1"]["prefill_step_s"] = -1
    with pytest.raises(ProfileError, match="steps.1.prefill_step_s must be a finite number"):
        from_json(broken)


def _broken(path: str, value: Any) -> dict[str, Any]:
    data = profile_json()
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[key]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return data


@pytest.mark.parametrize(("path", "value", "message"), [
    ("schema", "other/9", "schema is 'other/9'"),
    ("source", "guessed", "source must be one of"),
    ("model.block_size", 0, "model.block_size must be a positive integer"),
    ("steps.1.base_s", -1, "steps.1.base_s must be a finite number >= 0"),
    ("steps.1.num_kv_blocks", KeyError, "steps.1.num_kv_blocks"),
    ("transfer.bytes_per_s", 0, "transfer.bytes_per_s must be > 0"),
    ("router", KeyError, "router must be an object"),
    ("steps", {}, "steps is empty"),
])
def test_a_wrong_field_is_named(path: str, value: Any, message: str) -> None:
    with pytest.raises(ProfileError, match=message.replace("(", r"\(")):
        from_json(_broken(path, value))


def test_a_missing_tp_size_names_those_there_are(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match=r"no steps at TP 4 \(it has TP 1, 2\)"):
        from_json(profile_json()).step(4)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json: cannot read a profile"):
        load(bad)
