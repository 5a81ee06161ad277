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
