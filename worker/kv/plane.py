"""``KVPlane``: both directions of one worker's KV data plane, as its engine loop holds them.

Every worker can send (``sending``, always there: its ranks build their senders at the
first send) and, once ``start_receiving`` ran, receive (``receiving``: rank 0 then hosts
the rendezvous store others send to). ``num_pending`` and ``num_failed`` count both
directions; ``rank_totals`` asks every rank for its figures (``STATS``), by direction.
"""

from __future__ import annotations

from engine.core.engine_core import EngineCore
from worker.kv.receiving import KVReceiveLeader
from worker.kv.reports import RankTotals, rank_totals
from worker.kv.sending import KVSendLeader


class KVPlane:
    """A worker's KV leaders (engine-loop thread only). ``timeout_s``: how long a
    transfer may take (a sent one unacknowledged, a received one incomplete)."""

    def __init__(self, core: EngineCore, timeout_s: float) -> None:
        self.core = core
        self.timeout_s = timeout_s
        self.sending = KVSendLeader(core, timeout_s)
        self._receiving: KVReceiveLeader | None = None

    def start_receiving(self) -> KVReceiveLeader:
        """Receive from now on (idempotent): starts rank 0's store and every rank's receiver."""
        if self._receiving is None:
            self._receiving = KVReceiveLeader(self.core, self.timeout_s)
        return self._receiving

    @property
    def receiving(self) -> KVReceiveLeader:
        if self._receiving is None:
            raise RuntimeError("this worker does not receive KV (start_receiving first)")
        return self._receiving

    @property
    def num_pending(self) -> int:
        """Transfers this worker's leader still follows, both directions."""
        received = self._receiving.num_pending if self._receiving is not None else 0
        return self.sending.num_pending + received

    @property
    def num_failed(self) -> int:
        """Transfers that failed since the start, both directions."""
        received = self._receiving.num_failed if self._receiving is not None else 0
        return self.sending.num_failed + received

    def rank_totals(self) -> RankTotals:
        """The ranks' data-plane figures, summed."""
        return rank_totals(self.core.call_ranks)
