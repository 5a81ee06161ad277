"""pdserve's KV data plane: moves a request's KV cache from a sending worker's ranks to a
receiving worker's ranks over ``torch.distributed`` point-to-point operations.

Rooms (each module's docstring says who owns what, when):

- ``send/`` — ``KVSender`` (``send.sender``; each transfer's state machine in
  ``send.outgoing``, the routes' lanes in ``send.send_lane``), one per sending rank.
  ``send()`` queues layers of a request's KV (callable from the layer hook, layer by
  layer); on rank 0, ``finish()`` queues the transfer's ``Trailer`` (first token,
  cached-token count) behind them for the receiver's rank 0; ``wait()`` returns
  (``done()`` says, without blocking, whether it would) once the receiving ranks verified
  it all. The blocks stay the caller's to pin until then.
- ``receive/`` — ``KVReceiver`` (``receive.receiver``; each transfer's state machine in
  ``receive.incoming``, accepting channels in ``receive.accept``, the channels' readers in
  ``receive.recv_channel``), one per receiving rank; rank 0 hosts the worker's rendezvous
  store. ``expect()`` says which blocks a transfer fills (and, on rank 0, that a trailer
  completes it); ``wait()`` returns (the trailer, if any) once every part arrived,
  verified, in those blocks.
- ``transport/`` — ``channel`` (two-rank groups from ``engine.tp.distributed.make_group``,
  opened on demand through the receiver's store; gloo for CPU tensors, gloo + nccl for
  CUDA tensors), ``pool`` (a bound on open channels, least recently used idle ones
  closed), ``buffers`` (reused staging buffers).
- ``wire/`` — ``protocol`` (typed wire and rendezvous messages), ``packing`` (paged blocks
  <-> contiguous parts), ``checksum``.
- Beside them: ``plan`` (head re-sharding between TP sizes), ``config``, ``errors``,
  ``states`` (the one state vocabulary of both directions), ``stats``. What must match
  for two workers to exchange KV is ``engine.kvcache.layout``.

``import kvtransfer`` and its ``wire.protocol``, ``config``, ``states`` and ``plan`` modules
do not import torch; the roles load lazily on first access. May import ``engine``
(distributed groups, sharding rules) and nothing above it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.kvcache.layout import KVLayout
from kvtransfer.config import TransferConfig

if TYPE_CHECKING:
    from kvtransfer.errors import (
        ChannelClosed,
        ChannelError,
        ChecksumMismatch,
        LayoutMismatch,
        TransferError,
        TransferRejected,
        TransferTimeout,
    )
    from kvtransfer.receive.receiver import KVReceiver
    from kvtransfer.send.sender import KVSender

_LAZY = {
    "KVSender": "kvtransfer.send.sender",
    "KVReceiver": "kvtransfer.receive.receiver",
    **{name: "kvtransfer.errors" for name in (
        "TransferError", "TransferTimeout", "ChannelError", "ChannelClosed",
        "ChecksumMismatch", "LayoutMismatch", "TransferRejected")},
}

__all__ = ["KVLayout", "KVReceiver", "KVSender", "TransferConfig",
           "TransferError", "TransferTimeout", "ChannelError", "ChannelClosed",
           "ChecksumMismatch", "LayoutMismatch", "TransferRejected"]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtransfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
