"""``worker.loop.EngineLoop``'s own pacing: work that the engine can schedule none of (its
blocks held for KV on its way, say) waits for a command or the next poll as an idle loop
does, not in a spin of empty steps. The engine is a stand-in: this is the loop's own
bookkeeping (the loop with real engines: tests/worker/test_streams.py and tests/e2e)."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

from worker.loop import IDLE_POLL_S, EngineLoop
from worker.metrics import WorkerMetrics


class StuckCore:
    """Unfinished work of which no step schedules anything."""

    last_step_chunks = 0
    last_step_prompt_tokens = 0
    config = SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=32))

    def __init__(self) -> None:
        self.steps = 0

    def has_unfinished(self) -> bool:
        return True

    def step(self) -> list[Any]:
        self.steps += 1
        return []

    def shutdown(self) -> None:
        pass


class Loop(EngineLoop):
    ROLE = "decode"  # the hooks are the base's: it holds no request


def test_work_that_cannot_be_scheduled_waits_instead_of_spinning() -> None:
    core = StuckCore()
    loop = Loop("test-loop", core, None, WorkerMetrics("m", "decode", "w"))  # type: ignore[arg-type]
    loop.figures = SimpleNamespace(due=lambda idle: False, settled=False,  # type: ignore[assignment]
                                   step=lambda prefill: core.step())
    loop.start()
    try:
        time.sleep(0.3)
    finally:
        loop.stop(5.0)
    # one step per poll period at most (a spin of empty steps made tens of thousands)
    assert 0 < core.steps <= 0.3 / IDLE_POLL_S * 1.5, core.steps
