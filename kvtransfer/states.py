"""The one vocabulary of a KV transfer's state, on both sides and in every report of it.

Torch-free. ``kvtransfer.receive.incoming`` and ``kvtransfer.send.outgoing`` move a transfer through
these states; the workers' rank plugins report them to their leaders in the same terms
(``worker.rank_calls``).
"""

from __future__ import annotations

import enum


class TransferState(enum.IntEnum):
    PENDING = 0  # under way: the data plane may still read (sender) or write (receiver) its blocks
    DONE = 1  # complete: every part verified by the receiver (and acknowledged to the sender)
    FAILED = 2  # ended without its KV: never use the receiver's blocks; a reason says why

    @property
    def is_final(self) -> bool:
        return self is not TransferState.PENDING
