"""``pdserve up --ray --max-workers N``: the driver adds and drains worker actors for the
planner's scale steps (``cluster.scale``, written by ``pdserve planner --max-workers``),
within ``RaySpec.min_workers`` .. ``max_workers``.

Once a second (``Scaler.poll``, from the launcher's ``check``) it reads the latest step
and applies a new one once:

- **add**: a worker of the step's role (named ``ROLE-N``, a name not used before in this
  cluster, that role's TP size), in a placement group of its own wherever Ray finds room;
  the step returns once it registered. A worker that cannot be placed or started is
  reported and what it held removed; the planner's next step may ask again.
- **remove**: the worker the step names; it drains as on SIGTERM (a decode worker moves
  its streams to the others: in-flight requests are never killed), then its actor and
  placement group go.

A step is reported and skipped when it would go beyond the bounds, when the cluster
already has the size it asks for (a repeated step, or one decided on a window that missed
a worker: a step never takes the cluster past the size the planner wanted), or when it
names a worker the launcher does not have; so is a step written before the launcher
started (a Redis an earlier cluster used), and a malformed one.

From the launcher's wait loop (``poll``) a step runs on a thread of its own, one at a time:
the loop goes on checking the other processes' health while a worker starts or drains.
The launcher keeps a worker in motion out of that check and in its stop path.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Protocol

from cluster.records import RecordFormatError
from cluster.registry import Registry, RegistryError
from cluster.scale import ScaleTarget
from deploy.ray.members import Member
from deploy.ray.plan import RaySpec, WorkerPlan, worker_bundle
from deploy.spec import ChildExited, ClusterError, WorkerSlot

INTERVAL_S = 1.0  # between reads of the latest step


class WorkerPool(Protocol):
    """What the scaler needs of the launcher (``RayLauncher`` has it)."""

    ray_spec: RaySpec
    workers: list[Member]
    progress: Callable[[str], None]

    def add_worker(self, plan: WorkerPlan) -> Member: ...

    def retire_worker(self, name: str) -> None: ...


class Scaler:
    """Moves ``pool`` towards the scale target in ``redis_url`` (see the module doc)."""

    def __init__(self, pool: WorkerPool, redis_url: str, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        spec = pool.ray_spec
        assert spec.max_workers is not None
        self.pool = pool
        self.min_workers, self.max_workers = spec.min_workers or 1, spec.max_workers
        self._registry = Registry(redis_url, cluster=spec.cluster.name)
        self._clock = clock
        self._applied_at = time.time()  # steps written before this launcher are not its own
        self._next_at = 0.0
        self._used = {m.name for m in pool.workers}
        self._complained = ""
        self._thread: threading.Thread | None = None

    def close(self) -> None:
        self._registry.close()

    @property
    def busy(self) -> bool:
        """Whether a step ``poll`` started is still running."""
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> None:
        """Starts the latest step, if it is new, on a thread of its own and returns at once;
        nothing while a step runs."""
        if self.busy:
            return
        action = self._next_action()
        if action is not None:
            self._thread = threading.Thread(target=self._run, args=(action,), daemon=True,
                                            name="pdserve-scale-step")
            self._thread.start()

    def join(self, timeout_s: float) -> None:
        """Waits up to ``timeout_s`` for a running step (the launcher's stop path)."""
        if self._thread is not None:
            self._thread.join(timeout_s)

    def step(self) -> str | None:
        """Applies the latest step if it is new, here: the worker added or removed (None:
        none)."""
        action = self._next_action()
        return None if action is None else action()

    def _run(self, action: Callable[[], str | None]) -> None:
        try:
            action()
        except Exception as exc:  # a stop interrupting it, or Ray failing: reported
            self.pool.progress(f"scale: the step failed: {exc}")

    def _next_action(self) -> Callable[[], str | None] | None:
        """The latest step if it is new and within the bounds (else reported)."""
        if self._clock() < self._next_at:
            return None
        self._next_at = self._clock() + INTERVAL_S
        step = self._latest()
        if step is None or step.written_at <= self._applied_at:
            return None
        self._applied_at = step.written_at
        have, size = len(self.pool.workers), step.num_prefill + step.num_decode
        why = ""
        if step.action == "add" and have >= min(size, self.max_workers):
            why = (f"not adding a {step.role} worker: {have} run, the most --max-workers "
                   f"allows" if have >= self.max_workers else
                   f"not adding a {step.role} worker: {have} run, the {size} it asks for")
        elif step.action == "remove" and have <= max(size, self.min_workers):
            why = (f"not removing {step.worker_id}: {have} run, the fewest --min-workers "
                   f"allows" if have <= self.min_workers else
                   f"not removing {step.worker_id}: {have} run, the {size} it asks for")
        elif step.action == "remove" and step.worker_id not in {m.name for m in self.pool.workers}:
            why = f"not removing {step.worker_id}: no such worker here"
        if why:
            self.pool.progress(f"scale: {why}")
            return None
        return functools.partial(self._add if step.action == "add" else self._remove, step)

    def _latest(self) -> ScaleTarget | None:
        try:
            raw = self._registry.scale_target()
            return None if raw is None else ScaleTarget.from_json(raw)
        except (RegistryError, RecordFormatError) as exc:
            self._complain(f"scale: cannot read the planner's step: {exc}")
            return None

    def _add(self, step: ScaleTarget) -> str | None:
        spec = self.pool.ray_spec
        index = next(i for i in range(len(self._used) + 1)
                     if f"{step.role}-{i}" not in self._used)
        tp = spec.cluster.prefill_tp if step.role == "prefill" else spec.cluster.decode_tp
        slot = WorkerSlot(step.role, index, tp)
        self._used.add(slot.name)
        plan = WorkerPlan(slot, worker_bundle(tp, cpus_per_rank=spec.cpus_per_rank,
                                              gpu_resource=spec.rank_gpu_resource))
        self.pool.progress(f"scale: adding {slot.name} (TP {tp}) for the planner: "
                           f"{step.reason}")
        try:
            self.pool.add_worker(plan)
        except (ClusterError, ChildExited) as exc:
            self.pool.progress(f"scale: {slot.name} not added: {exc}")
            return None
        self.pool.progress(f"scale: {len(self.pool.workers)} workers (at most "
                           f"{self.max_workers})")
        return slot.name

    def _remove(self, step: ScaleTarget) -> str:
        name = step.worker_id
        self.pool.progress(f"scale: draining {name} for the planner: {step.reason}")
        self.pool.retire_worker(name)
        self.pool.progress(f"scale: {name} removed; {len(self.pool.workers)} workers (at "
                           f"least {self.min_workers})")
        return name

    def _complain(self, line: str) -> None:
        if line != self._complained:
            self.pool.progress(line)
            self._complained = line
