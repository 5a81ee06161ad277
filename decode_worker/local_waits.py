"""The queue waits of the prompts a decode worker prefills itself (colocated, or a short
tail): ``pdserve:prefill_queue_seconds``, as a prefill worker's are, so that a planner
sees a colocated cluster's prompts queue (``planner.observe``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any


class LocalPrefillWaits:
    """Each local prompt's wait from when it came (``came``) to the start of the step that
    ran its first chunk, given to ``observe`` (the histogram's) once that step ended;
    ``dropped``: aborted before, not counted. Engine loop thread only."""

    def __init__(self, observe: Callable[[float], None]) -> None:
        self._observe = observe
        self._queued: dict[str, float] = {}  # request id -> monotonic time it came
        self._step_at = 0.0

    def came(self, request_id: str) -> None:
        self._queued[request_id] = time.monotonic()

    def dropped(self, request_id: str) -> None:
        self._queued.pop(request_id, None)

    def step_starts(self) -> None:
        self._step_at = time.monotonic()

    def step_ended(self, requests: Mapping[str, Any]) -> None:
        """``requests``: the scheduler's, by id (one missing ended in its first step)."""
        for request_id, came in list(self._queued.items()):
            request = requests.get(request_id)
            if request is None or request.num_computed_tokens:  # its first chunk ran
                del self._queued[request_id]
                self._observe(max(0.0, self._step_at - came))
