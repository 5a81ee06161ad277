"""One outgoing transfer on a prefill rank, and every transition of its state machine.

``Outgoing`` is PENDING from its first ``KVSender.send`` until it is DONE (its routes
known, every layer queued, and every queued message — layers on each route, then the
trailer — sent and acknowledged by its receiver) or FAILED (its first ``TransferError``: a refused or
corrupted message, a broken channel, an abort, a timeout). Every transition happens
here and notifies the sender's condition (``changed``), where ``wait`` sleeps. Its blocks
are read only under ``lock`` while it is not FAILED; once ``fail`` returned, no block of
it is read again. The sender (``kvtransfer.send.sender``) keeps the set of transfers; lanes
(``kvtransfer.send.send_lane``) run its ``Job``s and report each one's end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine.tp.distributed import StoreAddress
from kvtransfer.errors import TransferError
from kvtransfer.plan import Route
from kvtransfer.states import TransferState
from kvtransfer.wire.protocol import Trailer


@dataclass(frozen=True)
class Job:
    """One message: ``route``'s heads of layers ``[layer_start, layer_end)``, or (with
    ``trailer``, no layers) the transfer's trailer."""

    record: Outgoing
    route: Route
    layer_start: int
    layer_end: int
    trailer: Trailer | None = None


@dataclass(eq=False)
class Outgoing:
    """One transfer on the sender (see module doc)."""

    transfer_id: int
    dest: StoreAddress
    kv_cache: torch.Tensor
    block_ids: torch.Tensor  # [num_blocks] int64 on kv_cache's device
    num_tokens: int
    num_blocks: int
    num_layers: int  # of the layout: all of them must be queued before it can be DONE
    changed: threading.Condition  # the sender's; notified on every transition
    receiver_tp: int = 0
    # None until the receiver's layout and TP size are known (read off the network by the
    # sender, never in the caller's thread); layers and the trailer queued before wait here
    routes: list[Route] | None = None
    deferred: list[range] = field(default_factory=list)
    deferred_trailer: Trailer | None = None
    layers_queued: set[int] = field(default_factory=set)
    trailer_queued: bool = False
    jobs_open: int = 0
    error: TransferError | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> TransferState:
        if self.error is not None:
            return TransferState.FAILED
        if self.routes is not None and self.jobs_open == 0 \
                and len(self.layers_queued) == self.num_layers:
            return TransferState.DONE
        return TransferState.PENDING

    @property
    def num_unqueued_layers(self) -> int:
        return self.num_layers - len(self.layers_queued)

    # ------------------------------------------------------------ transitions

    def queue_layers(self, layers: range) -> list[Job]:
        """Queue ``layers`` on every route: the jobs to run (none once FAILED). Raises
        ``ValueError`` for a layer queued before."""
        with self.changed:
            if self.layers_queued.intersection(layers):
                raise ValueError(f"transfer {self.transfer_id}: layers {layers} sent twice")
            self.layers_queued.update(layers)
            if self.error is not None or len(layers) == 0:
                return []
            if self.routes is None:
                self.deferred.append(layers)
                return []
            jobs = [Job(self, route, layers.start, layers.stop) for route in self.routes]
            self.jobs_open += len(jobs)
            return jobs

    def queue_trailer(self, trailer: Trailer) -> Job | None:
        """Queue the trailer for receiver rank 0, behind every layer: its job (None once
        FAILED). Raises ``ValueError`` when layers are missing or it was queued before."""
        with self.changed:
            if self.trailer_queued or self.num_unqueued_layers:
                raise ValueError(f"transfer {self.transfer_id}: trailer before every layer "
                                 f"was sent or twice (queued before: {self.trailer_queued})")
            self.trailer_queued = True
            if self.error is not None:
                return None
            if self.routes is None:
                self.deferred_trailer = trailer
                return None
            return self._trailer_job(trailer)

    def _trailer_job(self, trailer: Trailer) -> Job:
        assert self.routes is not None
        route = next(r for r in self.routes if r.receiver_rank == 0)
        self.jobs_open += 1
        return Job(self, route, 0, 0, trailer)

    def resolve(self, receiver_tp: int, routes: list[Route]) -> list[Job]:
        """The receiver is known: the jobs of everything queued meanwhile (none once
        FAILED), layers first, then the trailer."""
        with self.changed:
            self.receiver_tp, self.routes = receiver_tp, routes
            if self.error is not None:
                return []
            jobs = [Job(self, route, r.start, r.stop) for r in self.deferred for route in routes]
            self.jobs_open += len(jobs)
            if self.deferred_trailer is not None:
                jobs.append(self._trailer_job(self.deferred_trailer))
            self.deferred, self.deferred_trailer = [], None
            self.changed.notify_all()
            return jobs

    def fail(self, error: TransferError) -> bool:
        """Record the transfer's first error (→ FAILED); False if it had one. No block is
        read after this returns."""
        with self.lock:
            first = self.error is None
            if first:
                self.error = error
        with self.changed:
            self.changed.notify_all()
        return first

    def job_done(self) -> None:
        """A queued job ended (sent and acknowledged, or given up after ``fail``)."""
        with self.changed:
            self.jobs_open -= 1
            self.changed.notify_all()
