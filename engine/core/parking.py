"""Parking: a decoding request taken out of the running batch with its blocks kept, so
that its KV can move to another worker (a draining decode worker's planned move).

A request parks only between steps, while it decodes: its KV holds every token but the
last one sampled (``num_computed_tokens == num_tokens - 1``). Parked, it is never
scheduled and counts as no work (``Scheduler.has_unfinished``); ``Scheduler.finish``
(an abort) frees it as anywhere else. ``unpark_to_send`` puts it back at the head of the
batch as a prefill-only request: its next step computes its last token, samples the
token after it and ends it with its blocks pinned — exactly how a prefill's last chunk
ends — so the worker's KV sender ships its whole KV with that token as the trailer, and
nothing is recomputed. Torch-free, as the scheduler is.
"""

from __future__ import annotations

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler


def park(scheduler: Scheduler, request_id: str) -> bool:
    """Take a running request whose only uncomputed token is its last sampled one out of
    the batch (status ``PARKED``); False (nothing changed) for any other request."""
    request = scheduler.requests.get(request_id)
    if (request is None or request.status is not RequestStatus.RUNNING
            or request.prefill_only or request.num_tokens - request.num_computed_tokens != 1
            or request not in scheduler.running):
        return False
    scheduler.running.remove(request)
    request.status = RequestStatus.PARKED
    scheduler.parked[request_id] = request
    return True


def unpark_to_send(scheduler: Scheduler, request_id: str) -> Request:
    """Put a parked request back at the head of the batch as a prefill-only request (see
    the module docstring); ``KeyError`` if it is not parked."""
    request = scheduler.parked.pop(request_id)
    request.prefill_only = True
    request.status = RequestStatus.RUNNING
    scheduler.running.insert(0, request)
    return request
