"""What crosses into a worker's engine loop (``worker.loop``), torch-free: the typed
commands every worker answers (``Abort``, ``AbortAll``, ``Info``), their base ``Command[T]``
(the reply type is in the type; each worker kind adds its own commands), and
``WorkerError``, a failure reported to a gRPC caller with its status."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import grpc

from engine.kvcache import KVCacheUsage

T = TypeVar("T")


class WorkerError(Exception):
    """A failure reported to a gRPC caller: ``code`` is the status, ``message`` its text."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


CALL_TIMEOUT_S = 30.0  # a command the loop does not answer in this long: UNAVAILABLE


@dataclass(frozen=True)
class Command(Generic[T]):
    """Base of the typed commands a loop accepts; ``T`` is the reply type."""


@dataclass(frozen=True)
class Abort(Command[bool]):
    """Stop a request wherever it is and release what it holds; False if unknown.
    ``call_ended``: posted because a call that held the attempt ended (a planned move's
    parked request outlives its stream's call: ``role_worker.moves``)."""

    attempt_id: str
    reason: str = "aborted"
    call_ended: bool = False


@dataclass(frozen=True)
class SetRole(Command[str]):
    """Serve ``role`` from now on; the reply is the role served before. New work of the
    new role is taken at once, new work of the old one refused as busy; what the worker
    holds of either role goes on to its end. ``WorkerError`` (INVALID_ARGUMENT) names
    why a role this loop cannot serve is refused."""

    role: str


@dataclass(frozen=True)
class OfferMoves(Command[int]):
    """Park every decoding request whose stream is open and end that stream with the move
    offer (``cluster.moves``), each parked at most ``wait_s`` for the router's move; with
    ``draining`` (a drain), take no new work from now on (else: a switch away from
    decode). Returns how many were offered (``role_worker.moves``)."""

    wait_s: float
    draining: bool = True


@dataclass(frozen=True)
class MovesPending(Command[int]):
    """Requests parked for a move, or moving (their KV not yet acknowledged), and while
    draining, every decoding request not parked yet (it may be offered once it runs)."""


@dataclass(frozen=True)
class AbortAll(Command[int]):
    reason: str = "the worker is shutting down"


@dataclass(frozen=True)
class Info(Command["LoopInfo"]):
    pass


@dataclass(frozen=True)
class LoopInfo:
    """A worker's state for ``Info`` and the leak checks."""

    kv: KVCacheUsage
    pending_transfers: int  # the leaders' open transfers + every rank's pending transfers
    open_kv_channels: int  # summed over ranks
    running: int
    waiting: int
    num_preemptions: int = 0  # since the worker started
    num_expired: int = 0  # dropped at their deadline before any compute, since the start
    num_started: int = 0  # requests whose prompt the engine started computing
    num_failed_transfers: int = 0  # KV transfers that failed, since the start
    attempt_ids: tuple[str, ...] = ()  # the attempts held (the engine's request ids)
    watched_leases: int = 0  # leases of held attempts the worker watches
    queued_commands: int = 0  # commands not yet picked up
    num_lease_aborts: int = 0  # attempts freed because their lease was gone
    num_expired_commands: int = 0  # commands dropped unrun: their caller's deadline passed
    num_unexpected_acks: int = 0  # KV acknowledgements counted and ignored (prefill ranks)
