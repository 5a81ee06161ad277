"""Test-only pause points: off without the environment variable; on, a process pauses
only where the test armed a matching point, until released, and records events."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from cluster import pause_points
from cluster.pause_points import PauseDir
from tests.factories import run_without_torch

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def pause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> PauseDir:
    handle = PauseDir(tmp_path / "pause")
    monkeypatch.setattr(pause_points, "_dir", handle.path)  # as if set at start-up
    return handle


def test_off_without_the_environment_variable() -> None:
    result = run_without_torch(
        "import os; os.environ.pop('PDSERVE_TEST_PAUSE_DIR', None)\n"
        "from cluster import pause_points as p\n"
        "assert not p.enabled()\n"
        "p.pause('x', a=1); p.record('x', a=1)\n"
        "print('ok')\n")
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_pauses_only_where_armed_until_released(pause: PauseDir) -> None:
    pause_points.pause("p", transfer_id=1, layer=0)  # not armed: returns at once
    pause.arm("p", transfer_id=7, layer=1)
    pause_points.pause("p", transfer_id=7, layer=0)  # armed, another layer: returns
    worker = threading.Thread(target=pause_points.pause, args=("p",),
                              kwargs=dict(transfer_id=7, layer=1))
    worker.start()
    # 1. paused at the armed point, with its fields; 2. released, it goes on
    assert pause.wait_paused("p", 10)["layer"] == 1
    worker.join(0.2)
    assert worker.is_alive()
    pause.release("p")
    worker.join(10)
    assert not worker.is_alive()
    # 3. one shot: the same point again does not pause
    pause_points.pause("p", transfer_id=7, layer=1)
    assert not list(pause.path.glob("p.*"))


def test_records_events_in_order(pause: PauseDir) -> None:
    for layer in range(3):
        pause_points.record("r", transfer_id=5, layer=layer)
    assert [e["layer"] for e in pause.records("r")] == [0, 1, 2]
    assert pause.records("other") == []


def test_apause_waits_without_blocking_its_event_loop(pause: PauseDir) -> None:
    import asyncio

    async def scenario() -> list[str]:
        events: list[str] = []
        pause.arm("a", request_id="r-1")
        await pause_points.apause("a", request_id="r-2")  # another id: no pause
        paused = asyncio.ensure_future(pause_points.apause("a", request_id="r-1"))
        await asyncio.to_thread(pause.wait_paused, "a", 10)
        for _ in range(3):  # the event loop goes on while the point is held
            await asyncio.sleep(0.01)
            events.append("tick")
        assert not paused.done()
        pause.release("a")
        await asyncio.wait_for(paused, 10)
        events.append("released")
        return events

    assert asyncio.run(scenario()) == ["tick", "tick", "tick", "released"]
    assert not list(pause.path.glob("a.*"))
