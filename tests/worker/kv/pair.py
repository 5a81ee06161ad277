"""Factories for KV-transfer scenarios: a sending engine and a receiving engine, each with
the KV rank plugin, wired together in one test process (TP ranks > 0 are real processes),
and the drive loop and leak check every scenario ends with.

``ReceiveDriver`` plays the decode loop's part around ``KVReceiveLeader`` (reserve the
blocks in the engine, announce the transfer, admit with the trailer that arrived, free on
abort), so the scenarios exercise the leaders and the ranks' senders and receivers
directly."""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cluster.fingerprint import fingerprint_model_dir
from cluster.kv_target import KVTarget
from engine import SamplingParams
from engine.config import (
    CacheConfig,
    EngineConfig,
    ParallelConfig,
    SchedulerConfig,
    load_model_config,
)
from engine.core.engine_core import EngineCore, RequestOutput
from engine.sampling_params import SamplingParams as Params
from engine.text.tokenizer import load_tokenizer
from engine.tp.distributed import LOOPBACK, StoreAddress
from kvtransfer.wire.protocol import Trailer
from tests.worker.kv.faults import SPEC as FAULT_SPEC
from worker.kv.config import KVPlaneConfig
from worker.kv.messages import RankStats, stats_request
from worker.kv.rank import PLUGIN
from worker.kv.receiving import Arrival, KVReceiveLeader
from worker.kv.sending import KVSendLeader, SendOutcome

TIMEOUT_S = 10.0
NUM_KV_BLOCKS = 64
MAX_BATCHED_TOKENS = 32  # small, so that long prompts are prefilled in several chunks


class ReceiveDriver:
    """The decode loop's part of a KV transfer, over the engine and its ``KVReceiveLeader``."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.leader = KVReceiveLeader(core, TIMEOUT_S)
        self.address = self.leader.address
        self._arrived: dict[str, Trailer] = {}

    def reserve(self, rid: str, prompt: Sequence[int], params: Params, transfer_id: int,
                timeout_s: float | None = None) -> KVTarget | None:
        reserved = self.core.reserve_for_kv(rid, prompt, params)
        if reserved is None:
            return None
        try:
            return self.leader.expect(rid, transfer_id, len(prompt), reserved.block_ids,
                                      timeout_s)
        except BaseException:
            self.core.abort_request(rid)
            raise

    def poll(self) -> list[Arrival]:
        arrivals = self.leader.poll()
        for arrival in arrivals:
            if arrival.ok and arrival.trailer is not None:
                self._arrived[arrival.request_id] = arrival.trailer
            else:
                self.core.abort_request(arrival.request_id)  # no rank writes them any more
        return arrivals

    def admit(self, rid: str) -> RequestOutput:
        trailer = self._arrived.pop(rid, None)
        if trailer is None:
            raise ValueError(f"request {rid!r} has no arrived KV")
        return self.core.admit_with_kv(rid, trailer.first_token_id, trailer.num_cached_tokens)

    def abort(self, rid: str) -> bool:
        pending = self.leader.abort(rid)  # every rank stops writing before the blocks go
        arrived = self._arrived.pop(rid, None) is not None
        self.core.abort_request(rid)
        return pending or arrived

    @property
    def num_pending(self) -> int:
        return self.leader.num_pending + len(self._arrived)


def rank_stats(core: EngineCore) -> list[RankStats]:
    return [RankStats.decode(r) for r in core.call_ranks(stats_request())]


@dataclass
class Pair:
    prefill: EngineCore
    decode: EngineCore
    p: KVSendLeader
    d: ReceiveDriver

    def shutdown(self) -> None:
        self.prefill.shutdown()
        self.decode.shutdown()


def _config(model_dir: Path, tp: int, plugin_config: str) -> EngineConfig:
    return EngineConfig(
        model=load_model_config(model_dir), cache=CacheConfig(num_kv_blocks=NUM_KV_BLOCKS),
        parallel=ParallelConfig(tensor_parallel_size=tp),
        scheduler=SchedulerConfig(max_num_batched_tokens=MAX_BATCHED_TOKENS),
        rank_plugin=PLUGIN, rank_plugin_config=plugin_config)


def make_pair(model_dir: Path, prefill_tp: int, decode_tp: int) -> Pair:
    """Prefill engine (its senders corrupt transfer ``CORRUPT_TRANSFER_ID``) and decode
    engine (its rank 0's store on a loopback port it binds itself)."""
    fingerprint = fingerprint_model_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    d_cfg = KVPlaneConfig(fingerprint, timeout_s=TIMEOUT_S, bind_host=LOOPBACK)
    p_cfg = KVPlaneConfig(fingerprint, timeout_s=TIMEOUT_S, fault_hook=FAULT_SPEC)
    decode = EngineCore(_config(model_dir, decode_tp, d_cfg.to_json()), tokenizer)
    try:
        prefill = EngineCore(_config(model_dir, prefill_tp, p_cfg.to_json()), tokenizer)
    except BaseException:
        decode.shutdown()
        raise
    try:
        return Pair(prefill, decode, KVSendLeader(prefill, TIMEOUT_S), ReceiveDriver(decode))
    except BaseException:
        prefill.shutdown()
        decode.shutdown()
        raise


_ids = itertools.count(1)


def new_ids() -> tuple[str, int]:
    n = next(_ids)
    return f"req-{n}", n


def poll_results(pair: Pair, request_ids: set[str], timeout_s: float = 2 * TIMEOUT_S
                 ) -> dict[str, Arrival]:
    """Decode-side poll until every one of ``request_ids`` reported its result."""
    results: dict[str, Arrival] = {}
    deadline = time.monotonic() + timeout_s
    while not request_ids <= results.keys():
        assert time.monotonic() < deadline, f"no KV status for {request_ids - results.keys()}"
        results.update({r.request_id: r for r in pair.d.poll()})
        time.sleep(0.01)
    return results


def poll_until(pair: Pair, request_ids: set[str], timeout_s: float = 2 * TIMEOUT_S
               ) -> dict[str, tuple[bool, str]]:
    """Decode-side poll until every one of ``request_ids`` reported (ok, reason)."""
    results = poll_results(pair, request_ids, timeout_s)
    return {rid: (r.ok, r.reason) for rid, r in results.items()}


def finish_prefills(pair: Pair, step: bool = True, timeout_s: float = 2 * TIMEOUT_S
                    ) -> dict[str, SendOutcome]:
    """Step the prefill engine to the end (``step``), sending each finished request's
    trailer, then poll its senders until every transfer reported its result."""
    results: dict[str, SendOutcome] = {}
    while step and pair.prefill.has_unfinished():
        for out in pair.prefill.step():
            finished = pair.p.finish(out) if out.finished else None
            if finished is not None:
                results[out.request_id] = finished
    deadline = time.monotonic() + timeout_s
    while pair.p.num_sending:
        assert time.monotonic() < deadline, "prefill transfers not reported"
        results.update({r.request_id: r for r in pair.p.poll()})
        time.sleep(0.005)
    return results


def dest(target: KVTarget) -> StoreAddress:
    """Where a sender sends ``target``'s KV."""
    return StoreAddress(*target.host_port())


def run_transfers(pair: Pair, prompts: Sequence[list[int]],
                  params: Sequence[SamplingParams]) -> list[list[int]]:
    """The router's part: reserve on decode, prefill, admit (with the first token that
    arrived with the KV), decode to the end. Returns each request's tokens (first token
    included)."""
    rids = []
    for prompt, p in zip(prompts, params, strict=True):
        rid, tid = new_ids()
        target = pair.d.reserve(rid, prompt, p, tid)
        assert target is not None, "decode side out of blocks"
        pair.p.submit(rid, prompt, p, tid, dest(target))
        rids.append(rid)
    sent = finish_prefills(pair)
    assert all(r.ok and r.trailer is not None for r in sent.values()), sent
    assert all(ok for ok, _ in poll_until(pair, set(rids)).values())
    tokens: dict[str, list[int]] = {rid: [] for rid in rids}
    for rid in rids:
        first = pair.d.admit(rid).new_token_ids
        trailer = sent[rid].trailer
        assert trailer is not None and first == [trailer.first_token_id]
        tokens[rid] += first
    while pair.decode.has_unfinished():
        for out in pair.decode.step():
            tokens[out.request_id] += out.new_token_ids
    return [tokens[rid] for rid in rids]


def assert_no_leaks(pair: Pair) -> None:
    """Every block free or cached on both engines, nothing pending on any rank, channels
    within their bound."""
    for core in (pair.prefill, pair.decode):
        core.check_integrity()
        usage = core.kv_usage()
        assert (usage.in_use, usage.pinned) == (0, 0), usage
        assert not core.has_unfinished()
    assert (pair.p.num_pending, pair.d.num_pending) == (0, 0)
    counts = [(s.pending_sent + s.pending_received, s.channels_sending, s.channels_receiving,
               s.max_channels) for s in [*rank_stats(pair.prefill), *rank_stats(pair.decode)]]
    for pending, sending, receiving, max_channels in counts:  # one tuple per rank
        assert pending == 0 and max(sending, receiving) <= max_channels, counts
