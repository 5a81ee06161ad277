"""The words of a planned move, shared by the router and the workers, torch-free.

A draining decode worker (SIGTERM with another decode worker in the cluster; or one
switched to prefill with ``SetRoleRequest.move_decoding``) parks each
decoding request with its KV and ends the request's Generate stream with UNAVAILABLE
and ``MOVE_OFFER`` in the details, after every token it produced. The router then
reserves the continuation on another decode worker and asks the draining worker for it
with a Prefill naming the old attempt (``PrefillRequest.moved_from``): the draining
worker ships the request's KV there (``engine.core.parking``) instead of a prefill
worker recomputing it. A move refused or failed falls back to the replay migration.
"""

from __future__ import annotations

# the Generate stream's status details
MOVE_OFFER = ("moving: its decode worker stops decoding (draining, or switched to prefill); "
              "the request is parked with its KV, which can move")


def is_move_offer(details: str | None) -> bool:
    """Whether a Generate stream's failure details offer a move."""
    return details is not None and MOVE_OFFER in details
