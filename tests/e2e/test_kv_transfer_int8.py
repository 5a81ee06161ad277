"""KV quantised for the wire only, through real processes: Redis, a prefill worker (TP 1)
and a decode worker (TP 2: re-sharded in transit) both computing in fp32 and started with
``--kv-transfer-dtype int8``, the router.

- Greedy and seeded streams through the SDK equal what ``engine`` gives for the same
  handoff done by hand: the prompt prefilled in fp32 (chunked as the workers chunk it),
  its KV quantised and dequantised as the wire does (``engine.attention.kv_quant``), then
  decoded in fp32 from there. The first token, sampled by the prefill worker, is fp32's.
- The KV the prefill worker sent is exactly the int8 slots' bytes (``head_dim + 4`` per
  token, head and K/V, where fp32 takes ``4 head_dim``).
- A prompt sent again is served from the decode worker's lossy blocks (its prefix cache
  keys them apart from blocks it computes itself: tests/engine/core/test_engine_core.py),
  with the same tokens, fewer blocks sent.

(A worker whose transfer dtype differs from the cluster's is refused at registration
naming ``kv_transfer_dtype``: tests/worker/test_join.py.) The module's leak check ends
each test."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.attention.kv_quant import dequantize, quantize
from engine.config import load_model_config
from engine.core.engine_core import EngineCore
from pdserve import Client
from tests.e2e.cluster import Cluster, scrape_metrics
from tests.factories import PROMPTS

pytestmark = pytest.mark.timeout(240)

WIRE_INT8 = ("--kv-transfer-dtype", "int8")
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 2, "prefill_args": WIRE_INT8,
           "decode_args": WIRE_INT8}
PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)]
SENT = "pdserve:kv_transfer_bytes_total{direction=sent}"
REUSED = "pdserve:kv_blocks_reused_total{}"


def handed_off(prefill: LLM, decode: EngineCore, prompt: list[int], params: SamplingParams
               ) -> list[int]:
    """The tokens of ``prompt`` prefilled on ``prefill``, its KV through the wire's int8
    quantiser into ``decode``'s reserved blocks, decoded there."""
    prefill.core.add_request("p", prompt, params, prefill_only=True)
    outs = []
    while prefill.core.has_unfinished():
        outs += prefill.core.step()
    (out,) = outs
    reserved = decode.reserve_for_kv("d", prompt, params)
    assert reserved is not None
    src = prefill.core.executor.runner.kv_cache[:, :, list(out.block_ids)]
    decode.executor.runner.kv_cache[:, :, reserved.block_ids] = dequantize(quantize(src))
    prefill.core.release_pinned("p")
    tokens = list(decode.admit_with_kv("d", out.new_token_ids[0]).new_token_ids)
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    return tokens


def _settled(address: str) -> dict[str, float]:
    """The worker's metrics once two reads agree (its snapshot of its ranks' totals is
    taken as its loop goes idle, just after a transfer ends)."""
    last = scrape_metrics(address)
    for _ in range(40):
        time.sleep(0.05)
        now = scrape_metrics(address)
        if now.get(SENT) == last.get(SENT) and now.get(REUSED) == last.get(REUSED):
            break
        last = now
    return last


def test_kv_quantised_for_the_wire_streams_as_the_same_handoff_by_hand(
        client: Client, cluster: Cluster, llama_dir: Path) -> None:
    # each round's prompts share no block with another's: every block is sent, whole
    rounds = [[f"Round {k}: {p} (KV int8 on the wire)" for p in PROMPTS[:3]] for k in range(2)]
    with LLM(llama_dir, max_num_batched_tokens=32) as prefill:
        cache = dataclasses.replace(prefill.config.cache, kv_transfer_dtype="int8")
        decode = EngineCore(dataclasses.replace(prefill.config, cache=cache), prefill.tokenizer)
        try:
            expected = [[handed_off(prefill, decode, prefill.encode(prompt), p)
                         for prompt in prompts] for prompts, p in zip(rounds, PARAMS, strict=True)]
            plain = [prefill.generate([prompt], PARAMS[0])[0].token_ids for prompt in rounds[0]]
        finally:
            decode.shutdown()
        lengths = [[len(prefill.encode(prompt)) for prompt in prompts] for prompts in rounds]
    blocks = sum(-(-n // 16) for row in lengths for n in row)
    assert [e[0] for e in expected[0]] == [t[0] for t in plain]  # the prefill's first token
    prefill_metrics = cluster.prefill[0].ready["metrics_address"]
    decode_metrics = cluster.decode[0].ready["metrics_address"]
    before = _settled(prefill_metrics).get(SENT, 0.0)

    def complete(prompt: str, p: SamplingParams) -> list[int]:
        return list(client.complete(prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                                    seed=p.seed, ignore_eos=True).token_ids)

    got = [[complete(prompt, p) for prompt in prompts]
           for prompts, p in zip(rounds, PARAMS, strict=True)]
    assert got == expected
    model = load_model_config(llama_dir)
    slot = model.head_dim + 4  # bytes of one token's K (or V) of one KV head: fp32 takes 4x
    per_block = model.num_layers * 2 * 16 * model.num_kv_heads * slot
    sent = _settled(prefill_metrics)[SENT]
    assert sent - before == blocks * per_block
    # again: the decode worker's lossy blocks serve the prompt's full blocks (never the
    # last token's), the prefill worker sends the rest
    reused = _settled(decode_metrics).get(REUSED, 0.0)
    assert complete(rounds[0][0], PARAMS[0]) == expected[0][0]
    n = lengths[0][0]
    assert _settled(decode_metrics)[REUSED] - reused == (n - 1) // 16 > 0
    assert _settled(prefill_metrics)[SENT] - sent == (-(-n // 16) - (n - 1) // 16) * per_block
