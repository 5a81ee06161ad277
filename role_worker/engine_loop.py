"""``WorkerLoop``: the prefill and the decode engine loops as one thread over one engine.

Both kinds' hooks are cooperative (``worker.loop``): each handles the requests it holds
and passes the rest on, so the combined loop only builds both sides' state. Which new
work it takes is its ``role`` (``SetRole``): a prefill worker refuses ``Reserve`` and
``Local`` as busy, a decode worker refuses ``Submit`` as busy; a request admitted under
either role runs to its end whatever the role becomes meanwhile (the engine batches a
prefill-only request with decoding ones like any other). At drain, its decoding requests
may move their KV to another decode worker (``role_worker.moves``).
"""

from __future__ import annotations

from pathlib import Path

from engine.core.engine_core import EngineCore
from role_worker.moves import MovingLoop
from worker.kv.plane import KVPlane
from worker.loop import EngineLoop
from worker.metrics import WorkerMetrics


class WorkerLoop(MovingLoop):
    """Owns ``core`` (built with the KV rank plugin) from ``start`` until ``stop``; takes
    new work of ``role``; receives KV from the start (its store is registered once, so a
    switch to decode changes no address). ``max_requests`` bounds each role's held
    requests."""

    def __init__(self, core: EngineCore, transfer_timeout_s: float, role: str,
                 max_requests: int = 1024, metrics: WorkerMetrics | None = None) -> None:
        EngineLoop.__init__(self, "pdserve-worker-loop", core, KVPlane(core, transfer_timeout_s),
                            metrics or WorkerMetrics(Path(core.config.model.model_dir).name,
                                                     role, "-"), role)
        self.init_prefill(max_requests)
        self.init_decode(transfer_timeout_s, max_requests)
        self.init_moves()
