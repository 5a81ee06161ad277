"""Opening a send lane's channel over the connection the lane keeps to its decode
rank's rendezvous store (every new store connection costs a reverse DNS lookup on both
ends), and recovering that connection when the decode worker restarted at the same
address."""

from __future__ import annotations

import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from engine.tp.distributed import StoreAddress, connect_store
from kvtransfer.config import TransferConfig
from kvtransfer.errors import ChannelError
from kvtransfer.transport.channel import Channel, open_channel
from kvtransfer.wire.protocol import OpenReply, OpenRequest

PROBE_TIMEOUT_S = 1.0  # whether anything listens at a decode worker's address again


def open_route(store: Any, dest: StoreAddress, request: OpenRequest, device: torch.device,
               cfg: TransferConfig) -> tuple[Any, Channel, OpenReply]:
    """``open_channel`` over the lane's kept connection to ``dest``'s store (None: a new
    one), and the connection used. When the kept one turns out broken and something
    listens at ``dest`` again — a decode worker restarted at the same address — once more
    over a new connection: else its first transfer would fail. Only a connection that
    broke at once counts; a dead one's address refuses the probe at once (a new store
    connection would wait out its timeout)."""
    kept = store is not None
    if not kept:
        store = connect_store(dest, timeout_s=cfg.timeout_s)
    started = time.monotonic()
    try:
        return store, *open_channel(store, dest, request, device, cfg)
    except ChannelError as exc:
        # a connection the peer closed fails at once; a hung peer's (a socket timeout is
        # a DistNetworkError too) only after the timeout, and its address still accepts
        # connections: not tried again, which would take another timeout
        broke = isinstance(exc.__cause__, dist.DistNetworkError) \
            and time.monotonic() - started < min(PROBE_TIMEOUT_S, cfg.timeout_s / 2)
        if not (kept and broke and _listening(dest)):
            raise
    store = connect_store(dest, timeout_s=cfg.timeout_s)
    return store, *open_channel(store, dest, request, device, cfg)


def _listening(dest: StoreAddress) -> bool:
    try:
        socket.create_connection((dest.host, dest.port), timeout=PROBE_TIMEOUT_S).close()
    except OSError:
        return False
    return True
