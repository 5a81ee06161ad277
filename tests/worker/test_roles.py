"""``worker.roles.RoleState``: which roles a loop class serves (its classes' ``ROLE``s),
the switch and its refusals — the torch-free part of live role switching (the switch
through real processes is ``tests/e2e/test_role_switch.py``)."""

from __future__ import annotations

import grpc
import pytest

from worker.commands import WorkerError
from worker.roles import RoleState


class _Prefill(RoleState):
    ROLE = "prefill"


class _Decode(RoleState):
    ROLE = "decode"


class _Both(_Prefill, _Decode):
    pass


def test_a_class_serves_the_roles_of_the_classes_it_derives_from() -> None:
    assert _Prefill().roles == ("prefill",)
    assert _Both("decode").roles == ("prefill", "decode")
    assert _Both().role == "prefill"  # the first class's, without one given
    with pytest.raises(ValueError, match="serves prefill, not 'decode'"):
        _Prefill("decode")


def test_a_switch_returns_the_role_before_and_refuses_what_the_loop_cannot_serve() -> None:
    both = _Both("decode")
    assert both.set_role("prefill") == "decode" and both.role == "prefill"
    assert both.set_role("prefill") == "prefill"  # idempotent
    with pytest.raises(WorkerError) as refused:
        _Prefill().set_role("decode")
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "cannot serve 'decode': it serves prefill" in refused.value.message


def test_work_of_the_role_not_served_is_refused_as_busy() -> None:
    both = _Both("decode")
    both.refuse_unless("decode", "reservations")  # served: nothing raised
    with pytest.raises(WorkerError) as busy:
        both.refuse_unless("prefill", "new prefills")
    assert busy.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert busy.value.message == "busy: this worker serves decode now, it takes no new prefills"
