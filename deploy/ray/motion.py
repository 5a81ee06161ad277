"""The workers a scale step adds and drains (``RayLauncher.add_worker`` and
``retire_worker``, which ``deploy.ray.scaling`` calls from a thread of its own), kept apart
from the launcher's start and stop steps.

A worker in motion is in ``_in_motion`` (an ``InMotion``) and in no checked list: an added
one joins ``workers`` once ready, a retired one leaves ``workers`` before its SIGTERM. The
stop path stops what is in motion too; ``_changing`` keeps a step and a restart apart.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deploy.ray.connect import place_workers, quietly
from deploy.ray.members import Member, stop_tier
from deploy.ray.plan import RaySpec, WorkerPlan
from deploy.spec import ClusterError, ClusterSpec


@dataclass(eq=False)
class InMotion:
    """A worker a scale step is adding or draining: not checked, but stopped on stop."""

    member: Member | None
    groups: list[Any] = field(default_factory=list)


class RayScaling:
    """``add_worker`` and ``retire_worker`` of a ``RayLauncher`` (a mixin: it uses the
    launcher's members, locks and how it spawns them)."""

    spec: ClusterSpec
    ray_spec: RaySpec
    workers: list[Member]
    poll_s: float
    _placement_groups: list[Any]
    _changing: threading.Lock
    _lists: threading.Lock  # the members' lists, against the stop path
    _in_motion: list[InMotion]
    _stopping: threading.Event

    @property
    @abstractmethod
    def placement_groups(self) -> list[Any]: ...
    @abstractmethod
    def _spawn_worker(self, plan: WorkerPlan, group: Any) -> Member: ...
    @abstractmethod
    def _wait_ready(self, members: Sequence[Member]) -> None: ...
    @abstractmethod
    def _group_name(self, name: str) -> str: ...

    def add_worker(self, plan: WorkerPlan) -> Member:
        """One more worker (``deploy.ray.scaling``), placed and ready; else ``ClusterError``
        or ``ChildExited`` with what it held removed. Unchecked until it is ready."""
        with self._changing:
            with self._lists:
                moving = self._set_in_motion(InMotion(None))
            try:
                place_workers([(plan.name, plan.bundle)], self._group_name,
                              self.ray_spec.placement_timeout_s, self.poll_s, moving.groups,
                              stop=self._stopping)
                member = self._spawn_worker(plan, moving.groups[0])
                with self._lists:
                    moving.member = member
                self._stop_if_stopping()
                self._wait_ready([member])
                with self._lists:
                    self._stop_if_stopping()
                    self._in_motion.remove(moving)
                    self.workers.append(member)
                    self._placement_groups += moving.groups
            except BaseException:
                self._end_motion(moving)
                raise
        return member

    def retire_worker(self, name: str) -> None:
        """Drains worker ``name`` (SIGTERM: a decode worker moves its streams), then removes
        its actor and placement group. It leaves the checked members first. Looked up here,
        after any restart that replaced its actor: ``ClusterError`` when there is none."""
        with self._changing:
            with self._lists:
                member = next((m for m in self.workers if m.name == name), None)
                if member is None:
                    raise ClusterError(f"{name} is not one of the workers")
                group = self.placement_groups[self.workers.index(member)]
                moving = self._set_in_motion(InMotion(member, [group]))  # not if stopping
                self.workers.remove(member)
                self._placement_groups = [g for g in self._placement_groups if g is not group]
            self._end_motion(moving)

    def _set_in_motion(self, moving: InMotion) -> InMotion:
        """(``_lists`` held) ``moving`` joins what the stop path stops."""
        self._stop_if_stopping()
        self._in_motion.append(moving)
        return moving

    def _stop_if_stopping(self) -> None:
        if self._stopping.is_set():
            raise ClusterError("the cluster is stopping")

    def _end_motion(self, moving: InMotion) -> None:
        """Stops ``moving``'s worker and removes its placement group."""
        stop_tier([moving.member] if moving.member else [], self.spec.stop_grace_s)
        remove_groups(moving.groups)
        with self._lists:
            if moving in self._in_motion:
                self._in_motion.remove(moving)


def remove_groups(groups: Sequence[Any]) -> None:
    """Removes each placement group (one already gone is no error)."""
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        quietly(remove_placement_group, group)
