"""What the ``pdserve up --ray`` driver knows of each of its actors, and how it learns it.

``Member`` owns one actor's life as the driver sees it: its latest ``ChildStatus``, whether
it is ready, how often Ray restarted it, and whether it was reported down. ``poll`` asks
every member at once; ``Member.follow`` turns what came back into progress lines ("decode-0
is down ...; Ray restarts it", "decode-0 ready at ... (restart 1)") or ``ChildExited`` when a
process is gone for good. Ray is imported only inside the functions that call it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from deploy.children import quote_log
from deploy.ray.connect import quietly
from deploy.ray.plan import NAMESPACE, ChildStatus
from deploy.spec import ChildExited, ClusterError

STATUS_TIMEOUT_S = 5.0


@dataclass
class Member:
    """One actor of the cluster (a worker, the router or Redis).

    States, for a ``restartable`` worker: ready (``down`` False) → down (its actor is
    unreachable, its child exited, or a new incarnation is starting: ``restarts`` counts
    new incarnations) → ready again. The router and Redis are never restarted: their child
    exiting, or their actor dying, is ``ChildExited``.
    """

    name: str
    actor: Any  # a Ray actor handle
    restartable: bool
    status: ChildStatus | None = None
    ready: dict[str, Any] | None = None
    restarts: int = 0
    down: bool = False  # reported down, not yet ready again
    plan: Any = None  # a worker's ``WorkerPlan`` (what a restart or a new actor starts)

    def learn(self, ref: Any, deadline: float) -> ChildStatus | None:
        """The status ``ref`` (a ``status()`` call) brings; None while the actor is
        unreachable (Ray restarts it). ``ChildExited`` when the actor is dead for good."""
        import ray
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError

        try:
            status = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except (ActorUnavailableError, GetTimeoutError):
            return None
        except ActorDiedError as exc:
            why = ("and Ray will not restart it again" if self.restartable
                   else "(it is not restarted)")
            raise ChildExited(self.name, f"{self.name}'s actor died {why}: "
                                         f"{first_line(exc)}; {quote(self.status)}") from None
        if self.status is not None and status.actor_pid != self.status.actor_pid:
            self.restarts += 1
            self.ready = None
        self.status = status
        return status

    def follow(self, status: ChildStatus | None, progress: Callable[[str], None]) -> None:
        """Reports a worker going down and coming back; raises ``ChildExited`` when the
        router or Redis exited, or a restarted worker failed before it was ready."""
        if not self.restartable:
            if status is not None and status.exit is not None:
                raise ChildExited(self.name, f"{self.name} exited unexpectedly "
                                             f"({status.exit}); {quote(status)}")
            return
        if status is not None and status.exit is None and status.ready is not None:
            if self.down:
                self.ready, self.down = status.ready, False
                progress(self.describe_ready() + f" (restart {self.restarts})")
            return
        if not self.down:
            self.down = True
            progress(f"{self.name} is down ({_down_reason(status)}); Ray restarts it")
        if status is not None and status.exit is not None and status.ready is None:
            raise ChildExited(self.name, f"{self.name} exited before it was ready after a "
                                         f"restart ({status.exit}); {quote(status)}")

    def describe_ready(self) -> str:
        ready = self.ready or {}
        address = ready.get("grpc_address") or ready.get("address") or "?"
        node = self.status.node_ip if self.status is not None else "?"
        kv = f", KV {ready['kv_address']}" if ready.get("kv_address") else ""
        return f"{self.name} ready at {address} (node {node}{kv})"


def poll(members: Sequence[Member]) -> list[ChildStatus | None]:
    """Every member's status, asked of all at once (``Member.learn`` for each)."""
    refs = [member.actor.status.remote() for member in members]
    deadline = time.monotonic() + STATUS_TIMEOUT_S
    return [member.learn(ref, deadline) for member, ref in zip(members, refs, strict=True)]


def _down_reason(status: ChildStatus | None) -> str:
    if status is None:
        return "its actor is unreachable"
    return status.exit or "restarted"


def quote(status: ChildStatus | None) -> str:
    """The end of a child's log, for an error message."""
    if status is None:
        return "no log yet"
    return quote_log(status.log_path, status.log_tail or "(log not read)",
                     where=f" on {status.node_ip}")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def wait_ready(members: Sequence[Member], timeout_s: float, poll_s: float,
               progress: Callable[[str], None]) -> None:
    """Until every member's child is ready (each reported through ``progress``);
    ``ChildExited`` when one exits first, ``ClusterError`` past ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    pending = list(members)
    while pending:
        for member, status in zip(list(pending), poll(pending), strict=True):
            if status is not None and status.exit is not None:
                raise ChildExited(member.name, f"{member.name} exited before it was "
                                               f"ready ({status.exit}); {quote(status)}")
            if status is not None and status.ready is not None:
                member.ready = status.ready
                pending.remove(member)
                progress(member.describe_ready())
        if pending and time.monotonic() > deadline:
            names = ", ".join(m.name for m in pending)
            raise ClusterError(f"not ready within {timeout_s:.0f}s: {names}; "
                               f"{quote(pending[0].status)}")
        if pending:
            time.sleep(poll_s)


def stop_tier(members: Sequence[Member], grace_s: float) -> None:
    """Stop every member's child at once (SIGTERM, SIGKILL after ``grace_s``), then kill
    the actors (never restarted)."""
    if not members:
        return
    import ray

    refs = [m.actor.stop.remote(grace_s) for m in members]
    quietly(ray.wait, refs, num_returns=len(refs), timeout=grace_s + 10.0)
    for member in members:
        quietly(ray.kill, member.actor, no_restart=True)


def new_actor(cluster_name: str, cls: type, name: str, args: tuple[Any, ...],
              **options: Any) -> Any:
    """A new actor of ``cls(*args)`` named for cluster ``cluster_name`` (its handle);
    ``ClusterError`` when the name is taken."""
    import ray

    remote: Any = ray.remote(cls).options(name=f"pdserve-{cluster_name}-{name}",
                                          namespace=NAMESPACE, max_task_retries=0, **options)
    try:
        return remote.remote(*args)
    except ValueError as exc:  # the name is taken
        raise ClusterError(f"{name}: {first_line(exc)} (is another pdserve up --ray "
                           f"with --cluster {cluster_name} running on this Ray?)") from None


def retry_while_taken(spawn: Callable[[], Member], timeout_s: float, poll_s: float) -> Member:
    """``spawn()``, again while a removed actor's name is still taken (for ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return spawn()
        except ClusterError:
            if time.monotonic() > deadline:
                raise
            time.sleep(poll_s)


def get_within(ref: Any, name: str, timeout_s: float, poll_s: float) -> Any:
    """``ray.get`` in short steps (Ctrl-C stays responsive); a failed actor, or none
    within ``timeout_s`` → ``ClusterError``."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return ray.get(ref, timeout=poll_s)
        except GetTimeoutError:
            if time.monotonic() > deadline:
                raise ClusterError(f"{name} did not start within {timeout_s:.0f}s") from None
        except RayActorError as exc:
            raise ClusterError(f"{name} could not start: {first_line(exc)}") from None
