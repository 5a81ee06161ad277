"""One outgoing transfer on a prefill rank, and every transition of its state machine.

``Outgoing`` is PENDING from its first ``KVSender.send`` until it is DONE (every layer
queued, and every queued message — layers on each route, then the trailer — sent and
acknowledged by its receiver) or FAILED (its first ``TransferError``: a refused or
corrupted message, a broken channel, an abort, a timeout). Every transition happens
here and notifies the sender's condition (``changed``), where ``wait`` sleeps. Its blocks
are read only under ``lock`` while it is not FAILED; once ``fail`` returned, no block of
it is read again. The sender (``kvtransfer.sender``) keeps the set of transfers; lanes
(``kvtransfer.send_lane``) run its ``Job``s and report each one's end.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from engine.distributed import StoreAddress
from kvtransfer.errors import TransferError
from kvtransfer.plan import Route
from kvtransfer.protocol import Trailer
from kvtransfer.states import TransferState


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
    routes: list[Route] = field(default_factory=list)
    layers_queued: set[int] = field(default_factory=set)
    trailer_queued: bool = False
    jobs_open: int = 0
    error: TransferError | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def state(self) -> TransferState:
        if self.error is not None:
            return TransferState.FAILED
        if self.jobs_open == 0 and len(self.layers_queued) == self.num_layers:
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
            route = next(r for r in self.routes if r.receiver_rank == 0)
            self.jobs_open += 1
            return Job(self, route, 0, 0, trailer)

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
