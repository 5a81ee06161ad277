"""Accepting channels on a receiving rank: ``Acceptor`` answers the open requests senders
queue on the worker's rendezvous store and builds each accepted channel, then hands it to
the receiver (``adopt``), which reads it.

One accept thread per rank polls its queue (a blocking ``queue_pop`` confuses the store's
other waiters: replies and group rendezvous then time out at random). An open request
whose sender gave up waiting for the answer (it marked it abandoned) is dropped unanswered.
Another is refused when the sender's layout or TP size cannot exchange KV with this receiver
(LAYOUT_MISMATCH) or every channel slot is taken (BUSY: the sender retries); otherwise it is
ACCEPTED and a joiner thread of its own builds the channel's groups — joining blocks until
the sender joins too (at most the timeout), so a sender that dies mid-open holds up no one
else's opens. With ``TransferConfig.auth_keys`` a request without the sender's nonce is
refused (UNAUTHENTICATED), an accepted one carries this receiver's nonce and proofs, and
the joiner joins only once the sender's proof checked out (``kvtransfer.wire.auth``).
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.distributed as dist

from engine.kvcache.layout import KVLayout
from engine.tp.distributed import StoreAddress, connect_store
from kvtransfer.config import TransferConfig
from kvtransfer.errors import ChannelError
from kvtransfer.plan import check_tp_size
from kvtransfer.stats import ReceiverStats
from kvtransfer.transport.channel import (
    RECEIVER,
    Channel,
    abandoned_key,
    accept_key,
    join_channel,
    layout_refusal,
    proof_key,
    reply_key,
)
from kvtransfer.transport.pool import ChannelPool
from kvtransfer.wire import auth
from kvtransfer.wire.protocol import OpenReply, OpenRequest, OpenStatus

log = logging.getLogger(__name__)
ACCEPT_POLL_S = 0.01


class Reader(Protocol):
    """What reads an adopted channel (``kvtransfer.receive.recv_channel.RecvChannel``)."""

    def start(self) -> None: ...


class Acceptor:
    """The accept thread and the joiner threads of one receiving rank.

    ``adopt(channel_id, channel)`` is the receiver's: the reader of an established
    channel (not started: started here), or None when the receiver closed meanwhile
    (then the channel is closed here). ``closed()`` says whether to stop accepting."""

    def __init__(self, store_address: StoreAddress, *, tp_rank: int, layout: KVLayout,
                 tp_size: int, backend: str, device: torch.device, config: TransferConfig,
                 pool: ChannelPool, stats: ReceiverStats,
                 adopt: Callable[[int, Channel], Reader | None],
                 closed: Callable[[], bool]) -> None:
        self.store_address = store_address
        self.tp_rank, self.layout, self.tp_size = tp_rank, layout, tp_size
        self.backend, self.device, self.config = backend, device, config
        self.pool, self.stats = pool, stats
        self._adopt, self._closed = adopt, closed
        self._lock = threading.Lock()
        self._joiners: set[threading.Thread] = set()  # building accepted channels
        self._store: Any = connect_store(store_address, timeout_s=config.timeout_s)
        self._thread = threading.Thread(target=self._accept_loop, daemon=True,
                                        name=f"kvtransfer-accept-{tp_rank}")
        self._thread.start()

    def threads(self) -> list[threading.Thread]:
        """Its live threads (the accept thread, the joiners)."""
        with self._lock:
            found = [self._thread, *self._joiners]
        return [t for t in found if t.is_alive()]

    def join(self, timeout_s: float) -> None:
        """Wait for the accept thread to end (after ``closed()`` turned True)."""
        self._thread.join(timeout=timeout_s)
        self._store = None

    def _accept_loop(self) -> None:
        """Answer open requests until closed."""
        store = self._store
        while not self._closed():
            try:
                raw = store.queue_pop(accept_key(self.tp_rank), block=False)
            except dist.QueueEmptyError:
                time.sleep(ACCEPT_POLL_S)
                continue
            except RuntimeError:
                return  # the store went away (its host died or closed)
            try:
                request = OpenRequest.decode(raw)
            except ValueError:
                continue  # not ours to answer: without a channel id there is no reply key
            try:
                if self._abandoned(store, request.channel_id):
                    continue
            except RuntimeError:
                return  # the store went away
            reply: OpenReply | None = None
            try:
                reply = self._reply(request)
                store.set(reply_key(request.channel_id), reply.encode())
            except Exception:  # noqa: BLE001 - one request must not end the accepting
                log.exception("answering the open request of channel %d failed",
                              request.channel_id)
                if reply is not None and reply.status is OpenStatus.ACCEPTED:
                    self.pool.cancel()  # the slot its reply held
                continue
            if reply.status is OpenStatus.ACCEPTED:
                joiner = threading.Thread(
                    target=self._join_accepted, args=(request, reply.nonce), daemon=True,
                    name=f"kvtransfer-join-{self.tp_rank}/{request.channel_id}")
                with self._lock:
                    self._joiners.add(joiner)
                joiner.start()

    def _abandoned(self, store: Any, channel_id: int) -> bool:
        """Whether the sender gave up waiting for this open request's answer
        (``open_channel``): then it gets none, and no slot is held for it."""
        key = abandoned_key(channel_id)
        if not store.check([key]):
            return False
        store.delete_key(key)
        self.stats.opens_abandoned += 1
        return True

    def _reply(self, request: OpenRequest) -> OpenReply:
        """The answer to an open request (an ACCEPTED one holds a channel slot)."""
        refusal = layout_refusal(self.layout, request, self.backend)
        if refusal is None:
            try:
                check_tp_size(self.layout.num_kv_heads, request.sender_tp_size)
            except ValueError as exc:
                refusal = str(exc)
        if refusal is not None:
            self.stats.channels_refused += 1
            return OpenReply(OpenStatus.LAYOUT_MISMATCH, self.tp_size, 0, refusal)
        keys = self.config.auth_keys
        if keys and not request.nonce:
            self.stats.channels_refused += 1
            return OpenReply(OpenStatus.UNAUTHENTICATED, self.tp_size, 0,
                             "this receiver requires the cluster token (--cluster-token-file "
                             "or $PDSERVE_CLUSTER_TOKEN)")
        try:
            self.pool.reserve(0.0, wait=False)
        except ChannelError:
            self.stats.busy_replies += 1
            return OpenReply(OpenStatus.BUSY, self.tp_size, 0, "all channels in use")
        if not keys:
            return OpenReply(OpenStatus.ACCEPTED, self.tp_size, self.config.part_bytes, "")
        mine = auth.nonce()
        proofs = auth.receiver_proofs(keys, request.channel_id, request.nonce, mine)
        return OpenReply(OpenStatus.ACCEPTED, self.tp_size, self.config.part_bytes, "", mine,
                         ",".join(proofs))

    def _join_accepted(self, request: OpenRequest, receiver_nonce: str) -> None:
        """Check the sender's proof (authenticating), build an accepted channel's groups
        and hand it to the receiver (a joiner)."""
        try:  # its own store client: concurrent waits on one client confuse each other
            store = connect_store(self.store_address, timeout_s=self.config.timeout_s)
            mac = self._sender_proved(store, request, receiver_nonce)
            channel = join_channel(store, request.channel_id, RECEIVER, self.device,
                                   self.config)
            channel.mac = mac
        except (ChannelError, RuntimeError, auth.AuthError) as exc:
            self.pool.cancel()
            if isinstance(exc, auth.AuthError):
                self.stats.channels_refused += 1
            log.warning("channel %d not established: %s", request.channel_id,
                        str(exc).splitlines()[0][:300])
            self._done_joining()
            return
        # borrowed until its first message is through (the reader gives it back): idle,
        # another sender's open request could close it to make room before the sender,
        # told ACCEPTED, sent anything
        self.pool.add(request.channel_id, channel)
        reader = self._adopt(request.channel_id, channel)
        self._done_joining()  # after adopt: a closing receiver sees the reader or this thread
        if reader is None:
            self.pool.discard(channel, "receiver closed")
            return
        self.stats.channels_accepted += 1
        reader.start()

    def _sender_proved(self, store: Any, request: OpenRequest, receiver_nonce: str
                       ) -> auth.ChannelMac | None:
        """The channel's MAC once the sender proved the token (None: unauthenticated);
        ``AuthError`` when its proof is wrong, ``RuntimeError`` when none comes in time."""
        keys = self.config.auth_keys
        if not keys:
            return None
        key_name = proof_key(request.channel_id)
        store.wait([key_name], datetime.timedelta(seconds=self.config.timeout_s))
        raw = bytes(store.get(key_name))
        store.delete_key(key_name)
        key = auth.check_sender_proof(keys, raw, request.channel_id, request.nonce,
                                      receiver_nonce)
        return auth.ChannelMac(auth.channel_key(key, request.channel_id, request.nonce,
                                                receiver_nonce))

    def _done_joining(self) -> None:
        with self._lock:
            self._joiners.discard(threading.current_thread())
