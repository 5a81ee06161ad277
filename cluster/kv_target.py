"""``KVTarget``: where a request's KV goes — the one shape of it in the tree, torch-free.

A receiving (decode) worker answers a Reserve with it; the router hands it, unchanged, to
the sending (prefill) worker's Prefill. ``kv_address`` is the receiving worker's
rendezvous store (``host:port``, as it advertises it), ``transfer_id`` the transfer the
router chose (unique per router, random across routers, never 0), and
``tensor_parallel_size`` the receiving worker's (the sender re-shards heads to it; for
information: the store tells the sender the same), and ``num_cached_blocks`` the leading
prompt blocks the receiving worker already holds (its prefix cache): the sender sends
only the blocks after them, always at least the last prompt token's.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVTarget:
    """Where one transfer's KV goes (see the module docstring)."""

    transfer_id: int
    kv_address: str
    tensor_parallel_size: int
    num_cached_blocks: int = 0

    def host_port(self) -> tuple[str, int]:
        """``kv_address`` split; ``ValueError`` unless it is ``host:port`` and the transfer
        id is set."""
        host, _, port = self.kv_address.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or self.transfer_id == 0:
            raise ValueError(f"bad KV target {self.kv_address!r} / transfer {self.transfer_id}")
        return host, int(port)
