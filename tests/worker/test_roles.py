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


def test_overlapping_switches_reach_the_listeners_in_the_loops_order() -> None:
    """Two SetRole calls at once take turns: the registration (a listener) ends on the
    role the loop has, even where the first call's listener is the slower one."""
    import asyncio
    import time
    from typing import Any

    from cluster.internal.v1 import worker_pb2 as pb
    from worker.servicer import LoopServicerMixin

    class Loop:
        roles = ("decode", "prefill")

        def __init__(self) -> None:
            self.role, self.heard = "decode", []
            self.role_listeners = [self.listen]

        async def acall(self, command: Any, timeout_s: float | None = None) -> str:
            previous, self.role = self.role, command.role
            return previous

        def listen(self, role: str) -> None:
            time.sleep(0.2 if role == "prefill" else 0.0)  # the first call's is slower
            self.heard.append(role)

    class Context:
        def time_remaining(self) -> float:
            return 5.0

    loop = Loop()
    servicer = LoopServicerMixin(loop, None)  # type: ignore[arg-type]

    async def both() -> None:
        await asyncio.gather(
            servicer.SetRole(pb.SetRoleRequest(role="prefill"), Context()),  # type: ignore[arg-type]
            servicer.SetRole(pb.SetRoleRequest(role="decode"), Context()))  # type: ignore[arg-type]

    asyncio.run(both())
    assert loop.role == "decode" and loop.heard == ["prefill", "decode"]


class _MovesFail:
    """A loop that switches, but whose decoding requests cannot move (another decode
    worker serves, by ``move_targets``; ``offered``: moves it was asked to offer)."""

    roles = ("decode", "prefill")
    role_listeners: list[object] = []

    def __init__(self, others_serving: bool = True) -> None:
        self.role = "decode"
        self.offered = 0
        self.move_targets = lambda: others_serving

    async def acall(self, command: object, timeout_s: float | None = None) -> str:
        from worker.commands import OfferMoves, SetRole

        if isinstance(command, OfferMoves):
            self.offered += 1
            raise WorkerError(grpc.StatusCode.UNAVAILABLE, "the move offer timed out")
        assert isinstance(command, SetRole)
        previous, self.role = self.role, command.role
        return previous


def _switch_to_prefill_moving(loop: _MovesFail) -> object:
    """``set_role(..., "prefill", move_decoding=True)`` over gRPC against the worker's
    SetRole servicer on ``loop``: the RoleSwitchError it raises."""
    import asyncio

    from cluster.internal.v1 import worker_pb2_grpc as pb_grpc
    from cluster.worker_control import RoleSwitchError, set_role
    from worker.servicer import LoopServicerMixin

    class Servicer(LoopServicerMixin, pb_grpc.DecodeWorkerServicer):
        pass

    async def switch() -> RoleSwitchError:
        server = grpc.aio.server()
        pb_grpc.add_DecodeWorkerServicer_to_server(Servicer(loop, None), server)  # type: ignore[arg-type]
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        try:
            with pytest.raises(RoleSwitchError) as failed:
                await set_role(f"127.0.0.1:{port}", "prefill", move_decoding=True,
                               timeout_s=10.0)
            return failed.value
        finally:
            await server.stop(None)

    return asyncio.run(switch())


def test_a_switch_made_whose_moves_failed_says_it_was_made() -> None:
    """Over gRPC (the worker's SetRole servicer, a loop stand-in, the planner's and the
    CLI's client): the call fails, naming the role the worker serves now, so the planner
    counts the switch it made (and the moves' failure), not a switch not made."""
    from cluster.worker_control import RoleSwitchError
    from planner import service
    from planner.metrics import PlannerMetrics
    from planner.policy import RoleChange
    from tests.router.test_workers import make_record

    loop = _MovesFail()
    error = _switch_to_prefill_moving(loop)
    assert isinstance(error, RoleSwitchError)
    assert loop.role == "prefill" and error.switched_to == "prefill" and not error.refused
    assert "cannot move" in str(error) and loop.offered == 1

    metrics = PlannerMetrics()
    planner = service.PlannerService(None, None, None, metrics,  # type: ignore[arg-type]
                                     window_s=10.0)

    async def raises(*args: object, **kwargs: object) -> None:
        raise error

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(service, "set_role", raises)
        planner._switch(make_record("decode-0", "decode", "127.0.0.1:1"),
                        RoleChange(0.0, "decode-0", "decode", "prefill", "test", 0.1, 0.9))

    def counted(action: str, reason: str) -> float | None:
        return metrics.registry.get_sample_value("pdserve:planner_decisions_total",
                                                 {"action": action, "reason": reason})

    assert counted("switch", "to_prefill") == 1 and counted("failed", "moves") == 1
    assert counted("failed", "unreachable") is None


def test_a_switch_with_moves_and_no_other_decode_worker_offers_none() -> None:
    """The last decode worker switched to prefill with moves: nothing is parked (every
    stream offered would fail, with nowhere to go); they finish where they are, and the
    switch stands, saying so."""
    from cluster.worker_control import RoleSwitchError

    loop = _MovesFail(others_serving=False)
    error = _switch_to_prefill_moving(loop)
    assert isinstance(error, RoleSwitchError) and error.switched_to == "prefill"
    assert loop.offered == 0 and "no other decode worker is serving" in str(error)
