"""``deploy.ray.scaling.Scaler`` against a real Redis and a recording pool (the launcher's
side is ``test_launcher``'s planner test, on real Ray): each new step is applied once,
within the bounds; steps from before the launcher, and malformed ones, are not."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest

from cluster.registry import Registry
from cluster.scale import ScaleTarget
from deploy.ray.members import Member
from deploy.ray.plan import RaySpec, WorkerPlan
from deploy.ray.restarts import RayRestarts
from deploy.ray.scaling import INTERVAL_S, Scaler
from deploy.redis_server import RedisServer
from deploy.spec import ClusterError, ClusterSpec


@pytest.fixture
def redis_url() -> Any:
    with RedisServer(start_timeout_s=10.0) as server:
        yield server.url


@dataclasses.dataclass
class _Pool:
    ray_spec: RaySpec
    workers: list[Member]
    lines: list[str] = dataclasses.field(default_factory=list)
    added: list[WorkerPlan] = dataclasses.field(default_factory=list)
    retired: list[str] = dataclasses.field(default_factory=list)
    fail: bool = False
    gate: threading.Event | None = None  # set: an add may finish

    def progress(self, line: str) -> None:
        self.lines.append(line)

    def add_worker(self, plan: WorkerPlan) -> Member:
        if self.gate is not None:
            assert self.gate.wait(10.0)
        if self.fail:
            raise ClusterError(f"no room for {plan.name}")
        self.added.append(plan)
        member = Member(plan.name, actor=None, restartable=True, plan=plan)
        self.workers.append(member)
        return member

    def retire_worker(self, name: str) -> None:
        if self.fail:
            raise RuntimeError(f"Ray lost {name}")
        self.workers = [m for m in self.workers if m.name != name]
        self.retired.append(name)


def _step(action: str, role: str = "decode", worker_id: str = "", size: int = 3
          ) -> ScaleTarget:
    """A step whose split, after it, has ``size`` workers."""
    return ScaleTarget(action, role, worker_id, size - 1, 1, reason=f"test {action}",
                       written_at=time.time())


def test_each_new_step_is_applied_once_within_the_bounds(redis_url: str) -> None:
    spec = RaySpec(cluster=ClusterSpec(decode_tp=2), min_workers=2, max_workers=3)
    pool = _Pool(spec, [Member(n, None, True) for n in ("prefill-0", "decode-0")])
    t = [0.0]
    registry = Registry(redis_url)
    registry.set_scale_target(_step("add").to_json())  # an earlier cluster's: not ours
    time.sleep(0.01)
    scaler = Scaler(pool, redis_url, clock=lambda: t[0])

    def tick() -> str | None:  # the next read is due
        t[0] += INTERVAL_S
        return scaler.step()

    try:
        assert tick() is None and pool.added == []
        registry.set_scale_target(_step("add").to_json())
        assert scaler.step() is None  # within the interval: not read yet
        assert tick() == "decode-1" and tick() is None  # applied once
        assert [(p.name, p.tp) for p in pool.added] == [("decode-1", 2)]
        registry.set_scale_target(_step("add", "prefill").to_json())
        assert tick() is None and len(pool.added) == 1  # 3 run: the most allowed
        assert "not adding a prefill worker: 3 run" in pool.lines[-1]
        registry.set_scale_target(_step("remove", "decode", "decode-0", size=2).to_json())
        assert tick() == "decode-0" and pool.retired == ["decode-0"]
        registry.set_scale_target(_step("remove", "prefill", "prefill-0", size=1).to_json())
        assert tick() is None and pool.retired == ["decode-0"]  # 2 run: the fewest
        assert "not removing prefill-0: 2 run, the fewest" in pool.lines[-1]
        pool.fail = True
        registry.set_scale_target(_step("add", "prefill").to_json())
        assert tick() is None
        assert pool.lines[-1].startswith("scale: prefill-1 not added: no room for prefill-1")
        registry.set_scale_target("{not json")
        assert tick() is None and tick() is None
        assert sum("cannot read the planner's step" in line for line in pool.lines) == 1
    finally:
        scaler.close()
        registry.close()


def test_a_step_is_applied_only_towards_the_size_the_planner_wanted(redis_url: str) -> None:
    spec = RaySpec(cluster=ClusterSpec(num_decode=2), max_workers=6)
    pool = _Pool(spec, [Member(n, None, True) for n in ("prefill-0", "decode-0", "decode-1")])
    t = [0.0]
    scaler = Scaler(pool, redis_url, clock=lambda: t[0])

    def tick() -> str | None:
        t[0] += INTERVAL_S
        return scaler.step()

    try:
        with Registry(redis_url) as registry:
            # decided on a window that missed a worker: the cluster has the size already
            registry.set_scale_target(_step("add", size=3).to_json())
            assert tick() is None and pool.added == []
            assert pool.lines[-1] == "scale: not adding a decode worker: 3 run, the 3 it asks for"
            registry.set_scale_target(_step("remove", "decode", "decode-1", size=3).to_json())
            assert tick() is None and pool.retired == []
            # a worker the launcher does not have (gone already, or another's): none goes
            registry.set_scale_target(_step("remove", "decode", "elsewhere-0", size=2).to_json())
            assert tick() is None and pool.retired == []
            assert pool.lines[-1] == "scale: not removing elsewhere-0: no such worker here"
    finally:
        scaler.close()


def test_poll_runs_a_step_on_a_thread_of_its_own_one_at_a_time(redis_url: str) -> None:
    """The launcher's wait loop calls ``poll``: it must return while a worker starts (the
    other processes' health checks go on), start no second step meanwhile, and report a
    step that failed."""
    spec = RaySpec(cluster=ClusterSpec(), max_workers=4)
    pool = _Pool(spec, [Member(n, None, True) for n in ("prefill-0", "decode-0")],
                 gate=threading.Event())
    t = [0.0]
    scaler = Scaler(pool, redis_url, clock=lambda: t[0])
    try:
        with Registry(redis_url) as registry:
            registry.set_scale_target(_step("add").to_json())
            t[0] += INTERVAL_S
            scaler.poll()
            assert scaler.busy and pool.added == []  # returned with the add still running
            registry.set_scale_target(_step("add", "prefill", size=4).to_json())
            t[0] += INTERVAL_S
            scaler.poll()  # busy: the newer step waits for the next poll
            assert pool.gate is not None
            pool.gate.set()
            scaler.join(10.0)
            assert not scaler.busy and [p.name for p in pool.added] == ["decode-1"]
            t[0] += INTERVAL_S
            scaler.poll()
            scaler.join(10.0)
            assert [p.name for p in pool.added] == ["decode-1", "prefill-1"]
            # a step that raises is reported, and the next one runs
            pool.fail = True
            registry.set_scale_target(_step("remove", "decode", "decode-1", size=3).to_json())
            t[0] += INTERVAL_S
            scaler.poll()
            scaler.join(10.0)
            assert pool.retired == []
            assert pool.lines[-1] == "scale: the step failed: Ray lost decode-1"
            pool.fail = False
            registry.set_scale_target(_step("remove", "decode", "decode-1", size=3).to_json())
            t[0] += INTERVAL_S
            scaler.poll()
            scaler.join(10.0)
            assert pool.retired == ["decode-1"]
    finally:
        scaler.close()


class _Restarts(RayRestarts):
    """``RayRestarts`` over recorded members: ``_restart`` records, and the first worker's
    restart stands for a scale step that drains ``decode-0`` meanwhile."""

    def __init__(self) -> None:
        self.spec = ClusterSpec()
        self.routers = [Member("router", None, False)]
        self.workers = [Member(n, None, True) for n in ("prefill-0", "decode-0")]
        self.poll_s = 0.01
        self.progress = lambda line: None
        self._changing = threading.Lock()
        self.restarted: list[str] = []
        self.checks = 0

    @property
    def placement_groups(self) -> list[Any]:
        return []

    def _spawn_router(self, index: int, extra: Any = ()) -> Member:
        raise AssertionError("not called")

    def _spawn_worker(self, plan: Any, group: Any) -> Member:
        raise AssertionError("not called")

    def _wait_ready(self, members: Any) -> None:
        raise AssertionError("not called")

    def check(self) -> None:
        self.checks += 1

    def _restart(self, name: str, members: dict[str, Member]) -> Member:
        self.restarted.append(name)
        if name == "prefill-0":
            self.workers = [m for m in self.workers if m.name != "decode-0"]
        return members[name]


def test_a_restart_waits_for_a_running_step_checking_health_and_skips_a_drained_worker(
        ) -> None:
    launcher = _Restarts()
    launcher._changing.acquire()  # a scale step runs
    threading.Timer(0.2, launcher._changing.release).start()
    assert launcher.restart("router") is not None
    assert launcher.checks >= 5  # the health checks went on while it waited
    launcher.rolling_restart(settle_s=0.0)
    assert launcher.restarted == ["router", "router", "prefill-0"]  # decode-0 drained
    assert launcher.restart("decode-0", missing_ok=True) is None
    with pytest.raises(ClusterError, match="no process named 'decode-0'"):
        launcher.restart("decode-0")
