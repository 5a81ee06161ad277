"""Test-only pause points and event records in every pdserve process (torch-free: the
router and the workers use the same module).

Off unless the environment variable ``PDSERVE_TEST_PAUSE_DIR`` names a directory when
the process starts; set it only in tests (spawned rank processes inherit it). Off, every
call is one attribute check. On, the directory is a small file protocol between a test
and the processes it started:

- ``pause(point, **fields)``: if the test armed ``point`` (file ``<point>.arm``: a JSON
  object whose every key equals the call's field of that name), one process claims the
  arm (renames it: one shot), writes ``<point>.paused`` (the call's fields and its pid)
  and blocks until ``<point>.release`` exists (then removes both), at most
  ``PAUSE_LIMIT_S`` (then it logs and goes on). Unarmed: one ``stat``. ``apause`` is the
  same for an asyncio event loop: it waits with ``asyncio.sleep`` (the loop goes on
  serving everything else) and may be cancelled while paused.
- ``record(point, **fields)``: appends the fields as one JSON line to ``<point>.jsonl``.

Fields are ints or strings (``request_id``: the client's id; ``attempt_id``: the router's
id of one attempt). Points, in the order of a request's life (what pauses where):

- ``router.load_exchange`` (apause): a router is about to share its load with the other
  routers (``router.shared``, at each refresh of its view); held, its view of theirs
  stays as last read (and its view of the workers is not refreshed).
- ``router.prefix_wait`` (record; request_id): the request waits for a prompt the router
  is bringing to a decode worker that covers it but a short tail
  (``router.lifecycle.coalesce``); it has not taken its turn in the router's queue.
- ``router.queued`` (apause; request_id): the router admitted the request and it waits
  in the router's queue for its turn; nothing is held on any worker yet.
- ``router.before_prefill`` (apause; request_id, attempt_id): the attempt's decode
  reservation is held (``decode.reserved`` passed) and its lease written; the Prefill
  call has not been sent.
- ``router.before_generate`` (apause; request_id, attempt_id): the attempt's Prefill call
  is under way; its Generate stream (normally opened with it) is not opened yet, so the
  KV can arrive on the decode worker before any stream waits for it.
- ``decode.reserved`` (apause, record; request_id, attempt_id, transfer_id): the decode
  worker reserved the attempt's blocks and armed its receiver; the Reserve reply is not
  sent yet (the decode worker's event loop goes on serving other calls).
- ``worker.command`` (pause; command, attempt_id): a worker's engine loop picked up a
  command (``command``: its class name, e.g. "Reserve", "Submit"; ``attempt_id``: the
  attempt it names, "" if none) and runs it once released: its caller may time out or
  leave meanwhile (the loop thread is held).
- ``prefill.received`` (record; attempt_id): a prefill worker received the attempt's
  Prefill call and queues it for its engine loop.
- ``prefill.before_step`` (pause; held): the prefill engine loop is about to step while
  it holds ``held`` requests; paused there, new requests queue up behind it.
- ``prefill.started`` (pause, record; attempt_id, transfer_id): the first chunk of the
  attempt's prompt was computed (its KV starts to flow); the prefill engine loop thread
  is held: no other step runs meanwhile.
- ``prefill.computed`` (record; attempt_id, num_computed_tokens): after each prefill step,
  how many of each held attempt's prompt tokens are computed (one line per step).
- ``kv.layer_sent`` (pause and record; transfer_id, layer, rank): in a prefill
  rank's layer hook, once layer ``layer`` of the transfer's KV is computed and queued
  for sending, before the next layer is computed (the KV goes out during the step that
  computes the prompt's last chunk).
- ``kv.layer_received`` (record; transfer_id, layer, rank): layer ``layer`` of the
  transfer is complete and verified in a decode rank's blocks.
- ``prefill.transfer_done`` (pause, record; attempt_id, transfer_id): every decode rank
  acknowledged the attempt's KV and trailer and its blocks were unpinned into the prefix
  cache; the prefill loop thread is held before it answers the Prefill call.
- ``decode.admitted`` (pause, record; attempt_id, transfer_id): the attempt's KV arrived
  and its Generate stream is open: it enters the decode batch (the decode loop thread
  is held before its first token is streamed).
- ``kv_events.publish`` (pause; ops): a worker's KV event publisher is about to publish a
  batch of ``ops`` events (``worker.kv_events``); its thread is held, so the routers'
  indexes miss this batch and every later one until it is released.
- ``decode.token`` (pause, record; attempt_id, n): the decode loop streamed the
  attempt's ``n``-th token (1: the prefill-sampled first token); the loop thread is
  held before the next step.

``PauseDir`` is the test's side of the same protocol.
"""

from __future__ import annotations

import asyncio
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


Field = int | str


def pause(point: str, **fields: Field) -> None:
    """Block here while the test holds ``point`` (see the module docstring)."""
    if _dir is None or not _claim(_dir, point, fields):
        return
    deadline = time.monotonic() + PAUSE_LIMIT_S
    while not _released(_dir, point, deadline):
        time.sleep(POLL_S)
    _unpause(_dir, point)


async def apause(point: str, **fields: Field) -> None:
    """``pause`` for an asyncio event loop: waits without blocking it (cancellable)."""
    if _dir is None or not _claim(_dir, point, fields):
        return
    deadline = time.monotonic() + PAUSE_LIMIT_S
    try:
        while not _released(_dir, point, deadline):
            await asyncio.sleep(POLL_S)
    finally:
        _unpause(_dir, point)


def _claim(root: Path, point: str, fields: dict[str, Field]) -> bool:
    """Whether this call takes the point's arm (then it is paused there)."""
    arm = root / f"{point}.arm"
    if not arm.exists() or not _matches(arm, fields):
        return False
    claimed = arm.with_name(f"{arm.name}.{os.getpid()}")
    try:
        os.rename(arm, claimed)  # one process wins the arm
    except OSError:
        return False
    claimed.unlink()
    (root / f"{point}.release").unlink(missing_ok=True)  # left over from a timed-out pause
    write_json_atomic(root / f"{point}.paused", {**fields, "pid": os.getpid()})
    return True


def _released(root: Path, point: str, deadline: float) -> bool:
    if (root / f"{point}.release").exists():
        return True
    if time.monotonic() > deadline:
        log.warning("pause point %s: not released in %.0fs; going on", point, PAUSE_LIMIT_S)
        return True
    return False


def _unpause(root: Path, point: str) -> None:
    for path in (root / f"{point}.release", root / f"{point}.paused"):
        path.unlink(missing_ok=True)


def record(point: str, **fields: Field) -> None:
    """Append ``fields`` to the point's event log (one ``write``: lines stay whole)."""
    if _dir is None:
        return
    line = json.dumps({**fields, "pid": os.getpid()}) + "\n"
    with open(_dir / f"{point}.jsonl", "a") as f:
        f.write(line)


def _matches(arm: Path, fields: dict[str, Field]) -> bool:
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

    def arm(self, point: str, **fields: Field) -> None:
        write_json_atomic(self.path / f"{point}.arm", fields)

    def wait_paused(self, point: str, timeout_s: float) -> dict[str, Field]:
        """The fields of the process paused at ``point``; ``TimeoutError`` if none is."""
        path, deadline = self.path / f"{point}.paused", time.monotonic() + timeout_s
        while True:
            try:
                data: dict[str, Field] = json.loads(path.read_text())
                return data
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"nothing paused at {point} in {timeout_s}s") from None
                time.sleep(POLL_S)

    def release(self, point: str) -> None:
        (self.path / f"{point}.release").touch()

    def disarm(self, point: str) -> None:
        (self.path / f"{point}.arm").unlink(missing_ok=True)

    def records(self, point: str) -> list[dict[str, Field]]:
        try:
            lines = (self.path / f"{point}.jsonl").read_text().splitlines()
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines if line.endswith("}")]
