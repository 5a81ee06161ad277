"""KV-transfer faults through the router and real processes: Redis, two prefill workers,
one decode worker and the router on loopback (RELIABILITY rows 1, 3, 4, 6).

- a prefill worker stalls mid-send (paused after layer 0, then SIGSTOPped): the decode
  worker's other stream keeps streaming meanwhile (tokens arrive during the stall), the
  request is retried on the other prefill worker with the right tokens; after SIGCONT the
  broken channel is rebuilt and the next request on that pair succeeds (rows 3, 6);
- every prefill worker killed mid-prefill in turn: retried on the second, then
  ``UNAVAILABLE`` well within the deadline (row 1);
- the decode worker killed before it received the KV: the prefill worker unpins and
  frees everything (row 4; last: it leaves the cluster without a decode worker).

Every test ends with the leak check on every live worker (``Cluster.assert_no_leaks``).
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from cluster.pause_points import ENV as PAUSE_ENV
from cluster.pause_points import PauseDir
from engine.kvcache.block_hash import compute_block_hashes
from pdserve.client import Client, PdserveError
from router.routing import affinity_key, rendezvous_order
from tests.e2e.cluster import Cluster
from tests.processes import wait_until

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
PREFILLS = ("prefill-0", "prefill-1")


CLUSTER = {"num_prefill": 2, "num_decode": 1, "decode_tp": 1}


def _router_log(cluster: Cluster) -> str:
    assert cluster.router is not None
    return cluster.router.log_path.read_text(errors="replace")


def _prompt_to(worker_id: str, num_tokens: int, salt: int) -> list[int]:
    """A prompt whose prefill affinity (both prefill workers idle) is ``worker_id``."""
    for extra in range(200):
        prompt = [5 + (13 * i + 31 * salt + extra) % 600 for i in range(num_tokens)]
        key = affinity_key(compute_block_hashes(prompt, 16), prompt)
        if rendezvous_order(key, list(PREFILLS))[0] == worker_id:
            return prompt
    raise AssertionError("no prompt routes there")


def _greedy(client: Client, prompt: list[int], request_id: str | None = None) -> list[int]:
    result = client.complete(prompt_token_ids=prompt, max_tokens=4, temperature=0,
                             ignore_eos=True, timeout=TIMEOUT_S, request_id=request_id)
    return list(result.token_ids)


class Streamed:
    """A long stream read on its own thread; ``count`` tokens so far."""

    def __init__(self, client: Client, prompt: str) -> None:
        self.count = 0
        self.error: BaseException | None = None
        self._stream = client.generate(prompt, max_tokens=600, ignore_eos=True,
                                       timeout=TIMEOUT_S * 2)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for chunk in self._stream:
                self.count += len(chunk.token_ids)
        except BaseException as exc:  # asserted by the test
            self.error = exc

    def finish(self) -> None:
        self._thread.join(TIMEOUT_S * 2)
        assert not self._thread.is_alive() and self.error is None, self.error


# ------------------------------------------------------------------------ rows 3 and 6

def test_a_stalled_transfer_leaves_other_streams_alone_and_its_channel_is_rebuilt(
        cluster: Cluster, client: Client) -> None:
    stalled, stalled_pause = cluster.prefill[0], PauseDir(cluster.pause_dir(0))
    prompt = _prompt_to("prefill-0", 60, salt=1)
    expected = _greedy(client, prompt)  # healthy first: the reference, and a channel
    again = _prompt_to("prefill-0", 60, salt=2)
    expected_again = _greedy(client, again)
    # 1. a long stream runs on the decode worker
    other = Streamed(client, "keep streaming " * 4)
    wait_until(lambda: other.count >= 3, TIMEOUT_S, "the other stream to start")
    # 2. a request's transfer stalls: its prefill worker paused after layer 0, then hung
    stalled_pause.arm("kv.layer_sent", layer=0)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_greedy, client, prompt, "stalled")
        stalled_pause.wait_paused("kv.layer_sent", TIMEOUT_S)
        stalled.proc.send_signal(signal.SIGSTOP)
        stalled_pause.release("kv.layer_sent")  # takes effect at SIGCONT
        try:
            # 3. the other stream keeps streaming during the stall ...
            during = other.count
            wait_until(lambda: other.count >= during + 20, TIMEOUT_S,
                       "tokens of the other stream during the stall")
            # 4. ... and the stalled request is retried on the other prefill worker
            assert future.result(TIMEOUT_S) == expected
        finally:
            stalled.proc.send_signal(signal.SIGCONT)
    assert future.done()
    assert any("request_id=stalled" in line and "prefilled on prefill-1" in line
               for line in _router_log(cluster).splitlines())
    other.finish()
    # 5. the prefill worker resumes: its stale transfer fails; once it serves again the
    #    next request on the same pair opens a new channel and succeeds
    wait_until(lambda: "worker prefill-0 is serving" in
               _router_log(cluster).rpartition("worker prefill-0 is not serving")[2],
               TIMEOUT_S, "the router to route to prefill-0 again")
    wait_until(lambda: cluster.info(stalled).pending_transfers == 0, 30.0,
               "the stale transfer to end")
    wait_until(lambda: _greedy(client, again, "after-the-stall") == expected_again
               and "prefilled on prefill-0" in _router_log(cluster).rpartition(
                   "request_id=after-the-stall")[2].splitlines()[0], TIMEOUT_S,
               "a request prefilled on prefill-0 again", period_s=1.0)
    assert cluster.info(stalled).open_kv_channels >= 1


# ------------------------------------------------------------------------ row 1

def test_prefill_workers_killed_mid_prefill_retry_then_unavailable(
        cluster: Cluster, client: Client) -> None:
    # each prefill worker pauses once it computed layer 0 of the request and is
    # SIGKILLed there: the request is retried on the other, then fails UNAVAILABLE
    # well before its deadline; the decode worker frees the reservations
    pauses = [PauseDir(cluster.pause_dir(i)) for i in range(2)]
    for pause in pauses:
        pause.arm("kv.layer_sent", layer=0)
    start = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_greedy, client, _prompt_to("prefill-0", 40, salt=3), "doomed")
        killed: set[int] = set()
        for _ in range(2):
            index = _wait_any_paused(pauses, killed, future, cluster)
            cluster.prefill[index].stop(sig=signal.SIGKILL)
            killed.add(index)
        with pytest.raises(PdserveError) as excinfo:
            future.result(TIMEOUT_S)
    took = time.monotonic() - start
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE, excinfo.value
    assert took < TIMEOUT_S / 2, took
    log = [line for line in _router_log(cluster).splitlines() if "request_id=doomed" in line]
    assert sum("blocks reserved on decode-0" in line for line in log) >= 2, log
    cluster.assert_no_leaks(cluster.decode)
    # both come back (the next tests need them)
    cluster.prefill.clear()
    for i, pause in enumerate(pauses):
        (pause.path / "kv.layer_sent.paused").unlink(missing_ok=True)  # of the dead
        cluster.start_worker("prefill", i, env={PAUSE_ENV: str(cluster.pause_dir(i))})
    for worker in cluster.prefill:
        worker.wait_ready()
    wait_until(lambda: all(f"worker prefill-{i} is serving" in
                           _router_log(cluster).rpartition(f"prefill-{i} is not serving")[2]
                           for i in range(2)), TIMEOUT_S, "both prefill workers routable")


def _wait_any_paused(pauses: list[PauseDir], skip: set[int], request: Future[Any],
                     cluster: Cluster) -> int:
    """The index of a prefill worker (not in ``skip``) paused at ``kv.layer_sent``
    while ``request`` runs (if it ends first, the test fails with how it ended)."""
    found: list[int] = []

    def any_paused() -> bool:
        for i, pause in enumerate(pauses):
            if i not in skip and (pause.path / "kv.layer_sent.paused").exists():
                found.append(i)
                return True
        if request.done():
            raise AssertionError(f"the request ended before it paused: {request.exception()!r}"
                                 f"\n{_router_log(cluster)[-4000:]}")
        return False

    try:
        wait_until(any_paused, TIMEOUT_S, "a prefill worker paused mid-prefill")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{_router_log(cluster)[-4000:]}") from None
    return found[0]


# ------------------------------------------------------------------------ row 4 (last)

def test_the_decode_worker_killed_before_receiving_the_prefill_worker_unpins(
        cluster: Cluster, client: Client) -> None:
    pauses = [PauseDir(cluster.pause_dir(i)) for i in range(2)]
    failed_before = [cluster.info(p).num_failed_transfers for p in cluster.prefill]
    for pause in pauses:  # wherever the router sends it (a restarted worker may be suspect)
        pause.arm("kv.layer_sent", layer=0)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(_greedy, client, _prompt_to("prefill-0", 60, salt=4), "orphan")
        index = _wait_any_paused(pauses, set(), future, cluster)
        pauses[1 - index].disarm("kv.layer_sent")
        sender, pause = cluster.prefill[index], pauses[index]
        # 1. the request's KV is being computed on the prefill worker (its blocks held); its
        #    decode worker dies before receiving it
        cluster.decode[0].stop(sig=signal.SIGKILL)
        pause.release("kv.layer_sent")
        # 2. the client is told (no decode worker is left)
        with pytest.raises(PdserveError) as excinfo:
            future.result(TIMEOUT_S)
    assert excinfo.value.code == grpc.StatusCode.UNAVAILABLE, excinfo.value
    # 3. the prefill worker's transfer failed and it holds nothing: no pin, no block
    cluster.assert_no_leaks(cluster.prefill)
    assert cluster.info(sender).num_failed_transfers > failed_before[index]
