"""The words of a prefill worker's queue refusal, shared by the router and the workers,
torch-free.

Conditional disaggregation has the decode worker prefill a prompt itself when every
prefill worker's queue, with what it lacks of the prompt, would take longer than that
(``router.lifecycle.conditional``). A router
judges the queues from its own requests and, as last exchanged, the other routers'
(``cluster.router_loads``), a view that lags when requests arrive together at several
routers. So a Prefill may carry the most prompt tokens the router would have it wait
behind (``PrefillRequest.max_queued_tokens``); the prefill worker, which holds every
router's requests, refuses it over that with RESOURCE_EXHAUSTED and ``QUEUE_REFUSAL`` in
the details, holding nothing, and the router prefills the prompt on the decode worker.

The router also bounds a Prefill by what its view assumed of that worker's queue
(``router.policy.queue_bounds``): a worker refused only for that may be asked again
with the decode worker's side of the limit alone, so a refusal says how much it holds.
"""

from __future__ import annotations

import re

# the Prefill's status details start with it
QUEUE_REFUSAL = "queue: longer than the caller's limit"


def queue_refusal(queued_tokens: int, limit: int) -> str:
    """The details of a refusal of a Prefill with ``limit`` by a worker with
    ``queued_tokens`` to compute."""
    return (f"{QUEUE_REFUSAL} ({queued_tokens} prompt tokens to compute here, the limit "
            f"{limit})")


_QUEUED = re.compile(r"\((\d+) prompt tokens to compute here")


def refused_queue(details: str | None) -> int | None:
    """The prompt tokens a queue refusal (``details``) says its worker has to compute, or
    None for other details."""
    found = _QUEUED.search(details or "") if is_queue_refusal(details) else None
    return int(found.group(1)) if found else None


def is_queue_refusal(details: str | None) -> bool:
    """Whether a Prefill's failure details are a queue refusal."""
    return details is not None and details.startswith(QUEUE_REFUSAL)
