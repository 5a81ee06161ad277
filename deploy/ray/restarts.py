"""Restarts in place of ``pdserve up --ray`` (SIGHUP): ``RayLauncher``'s ``restart`` and
``rolling_restart``, kept apart from its start and stop steps."""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

from deploy.ray.connect import quietly
from deploy.ray.members import Member, retry_while_taken
from deploy.spec import ClusterError, ClusterSpec

RESTART_SETTLE_S = 2.0  # after each restart: the routers see the process back


class RayRestarts:
    """The restarts of a ``RayLauncher`` (a mixin: it uses the launcher's members and how
    it spawns them)."""

    spec: ClusterSpec
    routers: list[Member]
    workers: list[Member]
    poll_s: float
    progress: Callable[[str], None]
    _changing: threading.Lock  # held by a scale step too: the two never interleave
    can_restart = True

    @property
    @abstractmethod
    def placement_groups(self) -> list[Any]: ...
    @abstractmethod
    def _spawn_router(self, index: int, extra: Sequence[str] = ()) -> Member: ...
    @abstractmethod
    def _spawn_worker(self, plan: Any, group: Any) -> Member: ...
    @abstractmethod
    def _wait_ready(self, members: Sequence[Member]) -> None: ...

    def rolling_restart(self, settle_s: float = RESTART_SETTLE_S) -> None:
        """Restarts every router, then every worker in start order (the ones the planner
        added last), one at a time (``restart``), waiting ``settle_s`` after each. A worker
        a scale step drained meanwhile is skipped."""
        for name in [*self.spec.router_names, *(m.name for m in self.workers)]:
            if self.restart(name, missing_ok=True) is not None:
                time.sleep(settle_s)

    def restart(self, name: str, missing_ok: bool = False) -> Member | None:
        """Replaces process ``name`` in place: its child drains (SIGTERM: a router's
        streams resume on the other routers, a decode worker's move), its actor is
        removed, and a new one starts in the same placement group — a router on the ports
        it had — until ready. A scale step running first is waited for, the others'
        health checked meanwhile (``check``); then none starts until this is done. None
        (with ``missing_ok``) when there is no such process (a step drained it)."""
        while not self._changing.acquire(timeout=self.poll_s):
            self.check()
        try:
            members = {m.name: m for m in [*self.routers, *self.workers]}
            if name in members:
                return self._restart(name, members)
            if missing_ok:
                return None
            raise ClusterError(f"no process named {name!r} (there are "
                               f"{', '.join(sorted(members))})")
        finally:
            self._changing.release()

    @abstractmethod
    def check(self) -> None: ...

    def _restart(self, name: str, members: dict[str, Member]) -> Member:
        import ray

        old = members[name]
        self.progress(f"restarting {name} ...")
        quietly(ray.get, old.actor.stop.remote(self.spec.stop_grace_s),
                timeout=self.spec.stop_grace_s + 10.0)
        quietly(ray.kill, old.actor, no_restart=True)
        if old in self.routers:
            index = self.routers.index(old)
            self.routers[index] = new = retry_while_taken(lambda: self._spawn_router(
                index, _ports_of(old.ready)), self.spec.start_timeout_s, self.poll_s)
        else:
            index = self.workers.index(old)
            self.workers[index] = new = retry_while_taken(lambda: self._spawn_worker(
                old.plan, self.placement_groups[index]), self.spec.start_timeout_s,
                self.poll_s)
        self._wait_ready([new])
        return new


def _ports_of(ready: dict[str, Any] | None) -> list[str]:
    """The options that keep a restarted router on the ports it had (none if unknown)."""
    if ready is None:
        return []
    ports = ["--port", str(ready["grpc_address"]).rpartition(":")[2]]
    if "http_address" in ready:
        ports += ["--http-port", str(ready["http_address"]).rpartition(":")[2]]
    return ports
