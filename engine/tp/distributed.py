"""Process groups built on demand from a rendezvous store.

One helper, ``make_group``, builds every group pdserve uses — the tensor-parallel group
of a worker and (later) the KV-transfer channels between workers — directly from a
``PrefixStore`` over a ``TCPStore``, without ``init_process_group``. So a rank can hold
its TP group and any number of KV channels at once, and nothing assumes the default
(world) group. Every group binds to the address it is given and has an explicit timeout,
so a dead or hung peer becomes an error instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

LOOPBACK = "127.0.0.1"
ABORT_TAG = (1 << 31) - 1
"""A point-to-point tag no message uses: ``Group.abort`` times out a receive on it."""


@dataclass(frozen=True)
class StoreAddress:
    """Where a rendezvous ``TCPStore`` listens (advertised by the side that created it)."""

    host: str
    port: int


def create_store_server(host: str = LOOPBACK, port: int = 0, *, timeout_s: float = 60.0) -> dist.TCPStore:
    """Start a rendezvous store on ``host`` (port 0 = the OS picks; read ``store.port``).

    It listens on ``host`` only: ``TCPStore`` on its own listens on every interface,
    so the listening socket is made here and handed over (the store closes it).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(512)
        bound_port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    fd = listener.detach()
    try:
        return dist.TCPStore(
            host, bound_port, is_master=True, timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False, master_listen_fd=fd,
        )
    except BaseException:
        os.close(fd)
        raise


def connect_store(address: StoreAddress, *, timeout_s: float = 60.0) -> dist.TCPStore:
    """Connect to a rendezvous store another process started."""
    return dist.TCPStore(
        address.host, address.port, is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def free_port(host: str = LOOPBACK) -> int:
    """An ephemeral port that was free a moment ago (for tests and single-host launches)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Group:
    """A process group of ``size`` ranks; this process is ``rank``.

    A size-1 group has no backend and every collective is a no-op, so single-rank code
    paths run the same code. Operations block until done or until the group's timeout;
    after any error the group must be destroyed, never reused.
    """

    def __init__(self, pg: Any, rank: int, size: int, backend: str) -> None:
        self._pg = pg
        self.rank = rank
        self.size = size
        self.backend = backend

    @classmethod
    def single(cls) -> Group:
        return cls(None, 0, 1, "none")

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def _live(self) -> Any:
        """The backend, or None for a single rank; raises once a multi-rank group is
        destroyed (a dead group must never silently act as a single rank)."""
        if self._pg is None and self.size > 1:
            raise RuntimeError(f"this {self.backend} group of {self.size} ranks was destroyed")
        return self._pg

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the group, in place; returns it."""
        pg = self._live()
        if pg is not None:
            pg.allreduce([tensor]).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on all ranks) along ``dim``."""
        pg = self._live()
        if pg is None:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        pg.allgather([parts], [tensor]).wait()
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        pg = self._live()
        if pg is not None:
            pg.broadcast([tensor], src).wait()
        return tensor

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        assert self._pg is not None, "send on a single-rank group"
        self._pg.send([tensor], dst, tag).wait()

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        assert self._pg is not None, "recv on a single-rank group"
        self._pg.recv([tensor], src, tag).wait()
        return tensor

    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        """Start sending ``tensor``; returns the backend's work (``wait(timeout)`` on it).
        ``tensor`` must stay alive and unchanged until the work completes or the group
        is aborted."""
        assert self._pg is not None, "isend on a single-rank or destroyed group"
        return self._pg.send([tensor], dst, tag)

    def irecv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Any:
        """Start receiving into ``tensor`` (same contract as ``isend``)."""
        assert self._pg is not None, "irecv on a single-rank or destroyed group"
        return self._pg.recv([tensor], src, tag)

    def abort(self) -> None:
        """Break every connection of this group now and drop the backend.

        Operations pending here (in any thread) fail at once, and so do the peers'
        ("connection closed by peer"). Gloo has no abort that closes connections
        (``shutdown`` leaves them open until the peers time out), but an operation that
        times out makes gloo close every pair of the group: so a receive on
        ``ABORT_TAG`` is timed out after 1 ms. Idempotent.
        """
        pg, self._pg = self._pg, None
        if pg is None:
            return
        try:
            if self.backend == "gloo":
                peer = (self.rank + 1) % self.size
                pg.recv([torch.zeros(1)], peer, ABORT_TAG).wait(datetime.timedelta(milliseconds=1))
            else:
                pg.abort()
        except RuntimeError:
            pass  # the expected timeout, or the group was already broken
        try:
            pg.shutdown()
        except RuntimeError:
            pass

    def barrier(self) -> None:
        if self._pg is not None:
            self.all_reduce(torch.zeros(1, device=self._device()))

    def destroy(self) -> None:
        """Drop the backend; the group cannot be used afterwards."""
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # already broken; dropping the reference is all that is left

    def _device(self) -> torch.device:
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def backend_for(device: torch.device | str) -> str:
    """``"nccl"`` for CUDA tensors, ``"gloo"`` for CPU tensors."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def make_group(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    *,
    device: torch.device | str = "cpu",
    bind_host: str = LOOPBACK,
    timeout_s: float = 60.0,
    threads: int | None = None,
) -> Group:
    """Build a group of ``size`` ranks under ``prefix`` in ``store``; blocks until all join.

    Every member calls this with the same ``prefix`` and ``size`` and a distinct ``rank``.
    ``bind_host`` is the address this rank's gloo transport binds to (loopback in tests;
    gloo would otherwise pick an interface from the host name). ``threads``: gloo's
    worker threads for collectives (its default when None; point-to-point-only groups
    need one).
    """
    if size == 1:
        return Group.single()
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = backend_for(device)
    pg: Any
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        pg = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    else:
        gloo = dist.ProcessGroupGloo
        gloo_opts = gloo._Options()  # type: ignore[attr-defined]
        gloo_opts._timeout = timeout
        gloo_opts._devices = [gloo.create_device(hostname=bind_host)]
        if threads is not None:
            gloo_opts._threads = threads
        pg = gloo(prefixed, rank, size, gloo_opts)
    return Group(pg, rank, size, backend)
