"""``LoadBook``: the router's load on each worker — requests in flight and prompt tokens it
has them compute, its own and (as last read, ``cluster.router_loads``) the other routers'
— and the prefill rates workers reported. ``WorkerPool`` is one; placement reads it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from router.policy import relative_speeds


class LoadBook:
    """See the module doc. Used from the router's asyncio loop only."""

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._tokens: dict[str, int] = {}  # see ``busy``
        self._others: dict[str, tuple[int, int]] = {}  # see ``others_loads``
        self._rates: dict[str, float] = {}  # worker id -> the prefill rate it last reported

    def inflight(self, worker_id: str) -> int:
        return self._inflight.get(worker_id, 0)

    def queued_tokens(self, worker_id: str) -> int:
        """Prompt tokens the router's requests in flight on ``worker_id`` have it compute."""
        return self._tokens.get(worker_id, 0)

    def own_loads(self) -> dict[str, tuple[int, int]]:
        """(requests in flight, prompt tokens) of this router on each worker it uses."""
        return {w: (n, self._tokens.get(w, 0)) for w, n in self._inflight.items()}

    def others_loads(self, loads: dict[str, tuple[int, int]]) -> None:
        """The other routers' figures (``cluster.router_loads``), as last read."""
        self._others = loads

    def cluster_inflight(self, worker_id: str) -> int:
        """Requests in flight on ``worker_id``: this router's and, as last read, the
        other routers'."""
        return self.inflight(worker_id) + self._others.get(worker_id, (0, 0))[0]

    def cluster_tokens(self, worker_id: str) -> int:
        """``queued_tokens`` of every router, as ``cluster_inflight``."""
        return self.queued_tokens(worker_id) + self._others.get(worker_id, (0, 0))[1]

    @contextmanager
    def busy(self, worker_id: str, tokens: int = 0) -> Iterator[None]:
        """Counts one request of the router's in flight on ``worker_id`` while inside,
        and the ``tokens`` it has the worker compute."""
        self._inflight[worker_id] = self._inflight.get(worker_id, 0) + 1
        self._tokens[worker_id] = self._tokens.get(worker_id, 0) + tokens
        try:
            yield
        finally:
            left = self._inflight[worker_id] - 1
            if left:
                self._inflight[worker_id] = left
                self._tokens[worker_id] -= tokens
            else:
                del self._inflight[worker_id]
                del self._tokens[worker_id]

    @contextmanager
    def prefilling(self, worker_id: str, tokens: int) -> Iterator[None]:
        """Counts ``tokens`` more that ``worker_id`` computes for the router while inside
        (a local attempt's prompt on its decode worker, until its first token); only
        within ``busy`` on the same worker."""
        self._tokens[worker_id] = self._tokens.get(worker_id, 0) + tokens
        try:
            yield
        finally:
            if worker_id in self._tokens:
                self._tokens[worker_id] -= tokens

    def note_rate(self, worker_id: str, prefill_tokens_per_s: float) -> None:
        """A reply of ``worker_id`` reported its prefill rate (ignored unless > 0)."""
        if prefill_tokens_per_s > 0.0:
            self._rates[worker_id] = prefill_tokens_per_s

    def reported_rates(self) -> dict[str, float]:
        """The prefill rate (prompt tokens per second) each worker last reported."""
        return dict(self._rates)

    def prefill_speeds(self, worker_ids: Iterable[str]) -> dict[str, float]:
        """``router.policy.relative_speeds`` of ``worker_ids`` by their reported rates."""
        return relative_speeds(list(worker_ids), self._rates)

    @property
    def total_inflight(self) -> int:
        return sum(self._inflight.values())
