"""Int8 weights through real processes: Redis, a prefill worker (TP 1) and a decode
worker (TP 2: the KV is re-sharded in transit) both started with ``--quantization int8``,
the router. Greedy and seeded streams through the SDK equal ``engine.LLM(quantization=
"int8")`` token for token (a rank quantises its shard with the whole weight's scales, so
TP 2 multiplies by the same int8 weights as TP 1), and differ from the fp32 engine's
somewhere (the weights really are int8). The module's leak check ends each test."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from pdserve import Client
from tests.factories import PROMPTS

pytestmark = pytest.mark.timeout(240)

INT8 = ("--quantization", "int8")
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 2, "prefill_args": INT8,
           "decode_args": INT8}
PARAMS = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)]


def test_int8_streams_equal_the_int8_engine(client: Client, llama_dir: Path) -> None:
    prompts = [f"{p} (int8)" for p in PROMPTS[:4]]
    with LLM(llama_dir, quantization="int8") as llm:
        int8 = [[r.token_ids for r in llm.generate(prompts, p)] for p in PARAMS]
    with LLM(llama_dir) as llm:
        fp32 = [[r.token_ids for r in llm.generate(prompts, p)] for p in PARAMS]
    got = [[list(client.complete(prompt, max_tokens=p.max_tokens, temperature=p.temperature,
                                 seed=p.seed, ignore_eos=True).token_ids) for prompt in prompts]
           for p in PARAMS]
    assert got == int8
    assert got != fp32
