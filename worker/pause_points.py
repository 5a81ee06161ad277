"""Test-only pause points and event records in worker processes (torch-free).

Off unless the environment variable ``PDSERVE_TEST_PAUSE_DIR`` names a directory when
the process starts; set it only in tests (spawned rank processes inherit it). Off, every
call is one attribute check. On, the directory is a small file protocol between a test
and the processes it started:

- ``pause(point, **fields)``: if the test armed ``point`` (file ``<point>.arm``: a JSON
  object whose every key equals the call's field of that name), one process claims the
  arm (renames it: one shot), writes ``<point>.paused`` (the call's fields and its pid)
  and blocks until ``<point>.release`` exists (then removes both), at most
  ``PAUSE_LIMIT_S`` (then it logs and goes on). Unarmed: one ``stat``.
- ``record(point, **fields)``: appends the fields as one JSON line to ``<point>.jsonl``.

Points the workers call (every field is an int):

- ``prefill.layer_sent`` (pause and record; transfer_id, layer, rank): in a prefill
  rank's layer hook, once layer ``layer`` of the transfer's KV is computed and queued
  for sending, before the next layer is computed.
- ``decode.layer_received`` (record; transfer_id, layer, rank): layer ``layer`` of the
  transfer is complete and verified in a decode rank's blocks.
- ``prefill.before_step`` (pause; held): the prefill engine loop is about to step while
  it holds ``held`` requests; paused there, new requests queue up behind it.

``PauseDir`` is the test's side of the same protocol.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from cluster.files import write_json_atomic

log = logging.getLogger(__name__)

ENV = "PDSERVE_TEST_PAUSE_DIR"
PAUSE_LIMIT_S = 60.0
POLL_S = 0.005

_dir: Path | None = Path(os.environ[ENV]) if os.environ.get(ENV) else None


def enabled() -> bool:
    return _dir is not None


def pause(point: str, **fields: int) -> None:
    """Block here while the test holds ``point`` (see the module docstring)."""
    if _dir is None:
        return
    arm = _dir / f"{point}.arm"
    if not arm.exists() or not _matches(arm, fields):
        return
    claimed = arm.with_name(f"{arm.name}.{os.getpid()}")
    try:
        os.rename(arm, claimed)  # one process wins the arm
    except OSError:
        return
    claimed.unlink()
    release = _dir / f"{point}.release"
    release.unlink(missing_ok=True)  # left over from an earlier pause that timed out
    write_json_atomic(_dir / f"{point}.paused", {**fields, "pid": os.getpid()})
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not release.exists():
        if time.monotonic() > deadline:
            log.warning("pause point %s: not released in %.0fs; going on", point, PAUSE_LIMIT_S)
            break
        time.sleep(POLL_S)
    for path in (release, _dir / f"{point}.paused"):
        path.unlink(missing_ok=True)


def record(point: str, **fields: int) -> None:
    """Append ``fields`` to the point's event log (one ``write``: lines stay whole)."""
    if _dir is None:
        return
    line = json.dumps({**fields, "pid": os.getpid()}) + "\n"
    with open(_dir / f"{point}.jsonl", "a") as f:
        f.write(line)


def _matches(arm: Path, fields: dict[str, int]) -> bool:
    try:
        want = json.loads(arm.read_text() or "{}")
    except (OSError, ValueError):
        return False  # gone (claimed meanwhile) or half written
    return all(fields.get(key) == value for key, value in want.items())


class PauseDir:
    """A test's handle on a pause directory (pass ``env()`` to the processes)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        return {ENV: str(self.path)}

    def arm(self, point: str, **fields: int) -> None:
        write_json_atomic(self.path / f"{point}.arm", fields)

    def wait_paused(self, point: str, timeout_s: float) -> dict[str, int]:
        """The fields of the process paused at ``point``; ``TimeoutError`` if none is."""
        path, deadline = self.path / f"{point}.paused", time.monotonic() + timeout_s
        while True:
            try:
                data: dict[str, int] = json.loads(path.read_text())
                return data
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing paused at {point} in {timeout_s}s") from None
                time.sleep(POLL_S)

    def release(self, point: str) -> None:
        (self.path / f"{point}.release").touch()

    def disarm(self, point: str) -> None:
        (self.path / f"{point}.arm").unlink(missing_ok=True)

    def records(self, point: str) -> list[dict[str, int]]:
        try:
            lines = (self.path / f"{point}.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.endswith("}")]
