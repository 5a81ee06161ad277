"""pdserve's KV data plane: moves a request's KV cache from a prefill worker's ranks to a
decode worker's ranks over ``torch.distributed`` point-to-point operations.

Roles (each module's docstring says who owns what, when):

- ``KVSender`` (``sender``; each transfer's state machine in ``outgoing``, the routes'
  lanes in ``send_lane``) — one per prefill rank. ``send()`` queues
  layers of a request's KV (callable from the layer hook, layer by layer); on rank 0,
  ``finish()`` queues the transfer's ``Trailer`` (first token, cached-token count)
  behind them for decode rank 0; ``wait()`` returns (``done()`` says, without
  blocking, whether it would) once the decode ranks verified it all. The blocks stay
  the caller's to pin until then.
- ``KVReceiver`` (``receiver``; each transfer's state machine in ``incoming``, the
  channels' readers in ``recv_channel``) — one per decode rank; rank 0 hosts the
  worker's rendezvous store. ``expect()`` says which blocks a transfer fills (and, on
  rank 0, that a trailer completes it); ``wait()`` returns (the trailer, if any) once
  every part arrived, verified, in those blocks.
- The transport beneath them: ``channel`` (two-rank groups from
  ``engine.tp.distributed.make_group``, opened on demand through the receiver's store;
  gloo for CPU tensors, gloo + nccl for CUDA tensors), ``pool`` (a bound on open
  channels, least recently used idle ones closed), ``protocol`` (typed wire and
  rendezvous messages), ``packing`` (paged blocks <-> contiguous parts), ``checksum``,
  and ``plan`` (head re-sharding between TP sizes); what must match is ``engine.kvcache.layout``.

Both directions speak one state vocabulary (``states.TransferState``). ``import kvtransfer``
and its ``protocol``, ``config``, ``states`` and ``plan`` modules do not import
torch; the roles load lazily on first access. May import ``engine`` (distributed groups,
sharding rules) and nothing above it.
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
    from kvtransfer.receiver import KVReceiver
    from kvtransfer.sender import KVSender

_LAZY = {
    "KVSender": "kvtransfer.sender",
    "KVReceiver": "kvtransfer.receiver",
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
