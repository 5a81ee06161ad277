"""The planner process (``pdserve planner``): one per cluster decides, the others wait.

Every ``--interval`` seconds each planner competes for the cluster's lock
(``cluster.election``); the leader reads the registry (every worker's role and held
requests), scrapes every worker's ``/metrics``, and once it has a window
(``--window`` seconds; right after it took over, at least half of that) hands
``planner.observe.observation`` of it to ``planner.policy.Planner``. A role change the
policy decides is made with ``SetRole`` on that worker (``cluster.worker_control``),
logged with its reason and counted (``planner.metrics``); its time is noted on the lock
(``Election.leave_note``), so a planner that takes over keeps the dwell it started. A scale step (``--max-workers``)
is written as the cluster's scale target (``cluster.scale``) for the launcher that adds and
removes workers to act on. Draining workers (leaving) are left out. A round in which a
registered worker's ``/metrics`` (scraped at once, ``SCRAPE_THREADS`` at a time, so that
a round's samples are of one moment and a hung worker costs one timeout, not one each)
did not answer (or answered what could not be parsed)
decides nothing and is not kept in the window: the policy would read that worker as gone
(its role short of a worker, its counters from nothing at the next round). A switch a
worker refuses is logged and counted, and the policy's dwell time still applies. A round
that fails in any other way is logged, and the next goes on. SIGTERM/SIGINT: resign the
lock (the next planner takes over at its next tick) and exit 0.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import sys
import threading
import time
import urllib.request
import uuid
from collections import deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import prometheus_client
from prometheus_client.parser import text_string_to_metric_families

from cluster.election import Election
from cluster.files import write_json_atomic
from cluster.internal_tls import InternalTLS, internal_tls
from cluster.records import WorkerRecord
from cluster.registry import Registry, RegistryError
from cluster.scale import ScaleTarget
from cluster.token import ClusterToken, load_cluster_token
from cluster.worker_control import RoleSwitchError, set_role
from planner.capacity import CapacityModel, StepCosts
from planner.metrics import PlannerMetrics
from planner.observe import WorkerSample, observation
from planner.policy import ROLES, Decision, Planner, PlannerConfig, RoleChange
from planner.scaling import ADD, ScaleChange

log = logging.getLogger(__name__)
SCRAPE_TIMEOUT_S = 2.0
SCRAPE_THREADS = 16
KEEP_DECISIONS = 1000  # the policy's own record of its changes, the newest kept
LOCK_NAME = "planner"


def scrape(address: str, timeout_s: float = SCRAPE_TIMEOUT_S) -> dict[str, float]:
    """A ``/metrics`` endpoint's samples: ``name{label=value,...}`` (labels sorted,
    ``model_name`` left out) → value."""
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s).read()
    values = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())
                              if k != "model_name")
            values[f"{sample.name}{{{labels}}}"] = sample.value
    return values


class PlannerService:
    """The leader's loop around one ``Planner`` (see the module doc); ``tick`` is one round."""

    def __init__(self, planner: Planner, registry: Registry, election: Election,
                 metrics: PlannerMetrics, *, window_s: float,
                 token: ClusterToken | None = None, tls: InternalTLS | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time) -> None:
        self.planner = planner
        self.registry = registry
        self.election = election
        self.metrics = metrics
        self.window_s = window_s
        self._token, self._tls, self._clock, self._wall = token, tls, clock, wall
        self._history: deque[tuple[float, list[WorkerSample]]] = deque()
        self._leading = False  # the desired gauges hold this term's figures

    def tick(self) -> list[Decision]:
        """Lead (or wait), sample, and decide once there is a window; the changes made."""
        if not self.election.lead():
            self._step_down()
            return []
        try:
            # a draining worker is leaving: neither capacity nor one to switch
            records = [r for r in self.registry.list_workers() if not r.draining]
        except RegistryError as exc:
            log.warning("cannot read the registry: %s", exc)
            return []
        new_term = not self._leading
        for role in ROLES:
            count = sum(1 for r in records if r.role == role)
            self.metrics.workers.labels(role).set(count)
            if new_term:  # until it decides, it wants what there is
                self.metrics.desired.labels(role).set(count)
        if new_term:
            self._take_over()
        # leading only once the desired gauges say so: an autoscaler reading them where
        # the leader is 1 must never see zeros (or a former term's figures)
        self._leading = True
        self.metrics.leader.set(1)
        now, samples = self._clock(), self._sample(records)
        if samples is None:
            return []
        self._history.append((now, samples))
        while len(self._history) > 2 and now - self._history[1][0] >= self.window_s:
            self._history.popleft()
        start, first = self._history[0]
        if now - start < self.window_s / 2 or not samples:  # too short a window to judge
            return []
        changes = self.planner.decide(observation(first, samples, now - start))
        del self.planner.decisions[:-KEEP_DECISIONS]  # the log has them all; a service runs for months
        self._record()
        if changes and not self.election.lead():  # the round outlasted the lock: not ours
            log.warning("lost the planner lock during this round; %d change(s) not made",
                        len(changes))
            self._step_down()
            return []
        if changes:
            self._leave_note()
        by_id = {r.worker_id: r for r in records}
        for change in changes:
            if isinstance(change, RoleChange):
                self._switch(by_id[change.worker_id], change)
            else:
                self._scale(change)
        return changes

    def _take_over(self) -> None:
        """A new term: the dwell runs from the cluster's last change, which the former
        leader noted on the lock (wall-clock time: planners on hosts whose clocks differ
        by seconds shift it by as much), not from this planner's own last change."""
        raw = self.election.note()
        try:
            changed_at = float(json.loads(raw)["last_change_at"]) if raw else None
        except (ValueError, KeyError, TypeError):
            log.warning("the planner lock's note is not one of ours: %r", raw[:200] if raw else raw)
            return
        if changed_at is not None:
            at = self.planner.clock() - max(0.0, self._wall() - changed_at)
            self.planner.last_change_at = max(self.planner.last_change_at, at)

    def _leave_note(self) -> None:
        """The policy's last change, in wall-clock time, for the next leader's dwell."""
        age = self.planner.clock() - self.planner.last_change_at
        self.election.leave_note(json.dumps({"last_change_at": self._wall() - age}))

    def _step_down(self) -> None:
        self.metrics.leader.set(0)
        self._leading = False
        self._history.clear()  # a leader again later starts a fresh window

    def _sample(self, records: list[WorkerRecord]) -> list[WorkerSample] | None:
        """Every registered worker's scrape, or None when one did not answer."""
        samples, missing = [], []
        pool = ThreadPoolExecutor(max_workers=max(1, min(SCRAPE_THREADS, len(records))),
                                  thread_name_prefix="pdserve-scrape")
        scrapes = [pool.submit(scrape, r.metrics_address) if r.metrics_address else None
                   for r in records]
        # the socket timeout bounds each read, not a reply that trickles in: the round
        # waits for them all at most this long (a scrape still going is not waited for)
        rounds = -(-len(records) // SCRAPE_THREADS)
        futures.wait([s for s in scrapes if s is not None],
                     timeout=rounds * SCRAPE_TIMEOUT_S + 1.0)
        pool.shutdown(wait=False, cancel_futures=True)
        for record, scraped in zip(records, scrapes, strict=True):
            try:
                if scraped is not None and not scraped.done():
                    raise TimeoutError(f"no whole reply within {SCRAPE_TIMEOUT_S} s")
                metrics = scraped.result() if scraped is not None else {}
            except Exception as exc:  # noqa: BLE001 - unreachable, cut short or unparsable
                missing.append(f"{record.worker_id} ({exc})")
                continue
            samples.append(WorkerSample(record.worker_id, record.role,
                                        record.num_running + record.num_waiting, metrics))
        if missing:
            log.info("no decision this round: /metrics did not answer from %s",
                     ", ".join(missing))
            return None
        return samples

    def _record(self) -> None:
        planner = self.planner
        if planner.held:
            self.metrics.decisions.labels("hold", planner.held).inc()
        if planner.current is not None:
            self.metrics.predicted.set(planner.current.attainment)
        if planner.wanted is not None:
            self.metrics.desired.labels("prefill").set(planner.wanted[0])
            self.metrics.desired.labels("decode").set(planner.wanted[1])

    def _switch(self, record: WorkerRecord, change: RoleChange) -> None:
        try:
            asyncio.run(set_role(record.grpc_address, change.to_role, token=self._token,
                                 tls=self._tls, move_decoding=True))  # its streams move
        except RoleSwitchError as exc:
            if exc.switched_to != change.to_role:
                self.metrics.decisions.labels("failed", "refused" if exc.refused
                                              else "unreachable").inc()
                log.warning("%s -> %s not made: %s (%s)", change.worker_id, change.to_role,
                            exc, change.reason)
                return
            # made: the requests not offered a move decode on where they are
            self.metrics.decisions.labels("failed", "moves").inc()
            log.warning("%s -> %s made, but its decoding requests did not move: %s",
                        change.worker_id, change.to_role, exc)
        self.metrics.decisions.labels("switch", f"to_{change.to_role}").inc()
        log.info("switched %s: %s -> %s: %s", change.worker_id, change.from_role,
                 change.to_role, change.reason)

    def _scale(self, change: ScaleChange) -> None:
        target = ScaleTarget(change.action, change.role, change.worker_id or "",
                             change.num_prefill, change.num_decode, change.reason,
                             written_at=time.time())
        try:
            self.registry.set_scale_target(target.to_json())
        except RegistryError as exc:
            self.metrics.decisions.labels("failed", "unreachable").inc()
            log.warning("scale target %dP+%dD not written: %s", target.num_prefill,
                        target.num_decode, exc)
            return
        self.metrics.decisions.labels(change.action, change.role).inc()
        what = f"a {change.role} worker" if change.action == ADD else change.worker_id
        log.info("scale: %s %s (now %dP+%dD wanted): %s", change.action, what,
                 change.num_prefill, change.num_decode, change.reason)


def main(args: Any, costs: StepCosts, *, block_size: int, handoff_s: float) -> int:
    """``pdserve planner`` with the profile's ``costs`` at the workers' TP size; returns
    the exit code (2: unusable options)."""
    try:
        if not args.redis_url:
            raise ValueError("--redis-url (or $PDSERVE_REDIS_URL) is required")
        config = PlannerConfig(ttft_slo_s=args.ttft_slo_ms / 1000,
                               tpot_slo_s=args.tpot_slo_ms / 1000, dwell_s=args.dwell,
                               min_gain=args.min_gain, min_prefill=args.min_prefill,
                               min_decode=args.min_decode, max_prefill=args.max_prefill,
                               max_decode=args.max_decode, min_workers=args.min_workers,
                               max_workers=args.max_workers)
        token, tls = load_cluster_token(args.cluster_token_file), internal_tls(args)
        registry = Registry(args.redis_url, cluster=args.cluster)
        holder = args.planner_id or f"planner-{uuid.uuid4().hex[:8]}"
        election = Election(args.redis_url, cluster=args.cluster, name=LOCK_NAME,
                            holder=holder, ttl_s=args.lock_ttl)
        if not 0 < args.interval < args.lock_ttl:
            raise ValueError(f"--interval must be positive and shorter than --lock-ttl "
                             f"({args.lock_ttl:g}s), got {args.interval:g}")
    except ValueError as exc:
        print(f"pdserve planner: {exc}", file=sys.stderr)
        return 2
    model = CapacityModel(costs, max_num_batched_tokens=args.max_num_batched_tokens,
                          block_size=block_size, handoff_s=handoff_s)
    metrics = PlannerMetrics()
    service = PlannerService(Planner(config, model), registry, election, metrics,
                             window_s=args.window, token=token, tls=tls)
    server, _ = prometheus_client.start_http_server(args.metrics_port, args.host,
                                                    metrics.registry)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.ready_file:
        write_json_atomic(args.ready_file, {
            "planner_id": holder, "role": "planner",
            "metrics_address": f"{args.host}:{server.server_address[1]}"})
    log.info("planner %s: SLO TTFT %.0f ms, TPOT %.0f ms; deciding every %.1fs over %.1fs",
             holder, args.ttft_slo_ms, args.tpot_slo_ms, args.interval, args.window)
    try:
        while not stop.is_set():
            try:
                service.tick()
            except Exception:  # noqa: BLE001 - the planner outlives any bad round
                log.exception("a planner round failed; the next one goes on")
            stop.wait(args.interval)
    finally:
        election.close()
        registry.close()
        server.shutdown()
        server.server_close()
    log.info("planner %s stopped", holder)
    return 0
