"""Which role an engine loop takes new work for, torch-free (``worker.loop`` derives from
``RoleState``; the loop thread changes it on ``SetRole``)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import grpc

from worker.commands import WorkerError

log = logging.getLogger(__name__)


class RoleState:
    """A loop class that serves a role names it in ``ROLE``; one derived from several
    such classes serves each of their roles (``roles``). ``role`` is the one new work is
    taken for now; ``role_listeners`` are called with the new role after a switch, off the
    loop thread (the registration, the metrics' label)."""

    ROLE = ""

    def __init__(self, role: str = "") -> None:
        self.role = role or self.ROLE
        if self.role not in self.roles:
            raise ValueError(f"this loop serves {' or '.join(self.roles)}, not {self.role!r}")
        self.role_listeners: list[Callable[[str], object]] = []
        # whether another decode worker serves, to move decoding requests to (off the loop
        # thread; the registration's, None without a registry: nothing known to move to)
        self.move_targets: Callable[[], bool] | None = None
        self.draining = False  # set once at drain: no new work of any role

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles this loop can serve (its classes' ``ROLE``s, most derived first)."""
        return tuple(dict.fromkeys(c.__dict__["ROLE"] for c in type(self).__mro__
                                   if c.__dict__.get("ROLE")))

    def set_role(self, role: str) -> str:
        """Take new work of ``role`` from now on (loop thread); returns the role before.
        ``WorkerError`` (INVALID_ARGUMENT) for a role this loop cannot serve."""
        if role not in self.roles:
            raise WorkerError(grpc.StatusCode.INVALID_ARGUMENT,
                              f"this worker cannot serve {role!r}: it serves "
                              f"{' or '.join(self.roles)} (start it with `pdserve worker` to "
                              "switch between prefill and decode)")
        previous, self.role = self.role, role
        if previous != role:
            log.info("role: %s -> %s (what is held of either role goes on to its end)",
                     previous, role)
        return previous

    def refuse_unless(self, role: str, what: str) -> None:
        """``WorkerError`` (RESOURCE_EXHAUSTED: busy, so the router goes elsewhere) unless
        the loop serves ``role`` now and is not draining; ``what`` names the refused work."""
        if self.draining:
            raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"busy: this worker is draining, it takes no {what}")
        if self.role != role:
            raise WorkerError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"busy: this worker serves {self.role} now, it takes no {what}")
