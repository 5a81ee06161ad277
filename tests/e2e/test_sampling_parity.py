"""Penalties, ``min_p``, ``min_tokens`` and ``logit_bias`` give one answer everywhere: the
disaggregated cluster (the first token sampled on the prefill worker, the rest on the
decode worker), the colocated one (``--local-prefill always``: all on the decode worker),
the HTTP API through the official ``openai`` SDK (chat and completions) and ``engine.LLM``
— greedy and seeded. Real processes: one prefill and one decode worker, two routers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from engine import LLM, SamplingParams
from pdserve import Client
from tests.e2e.cluster import Cluster
from tests.factories import PROMPTS

pytestmark = pytest.mark.timeout(300)

TIMEOUT_S = 60.0
CLUSTER = {"num_prefill": 1, "num_decode": 1, "decode_tp": 1}
# values exact in float32 (the API carries them as 32-bit floats)
CASES: dict[str, dict[str, Any]] = {
    "repetition": {"repetition_penalty": 1.75},
    "presence-frequency": {"presence_penalty": 1.5, "frequency_penalty": 0.75},
    "bias-min-tokens": {"logit_bias": {7: 100.0, 12: -100.0}, "min_tokens": 4},
    "everything": {"presence_penalty": -0.5, "frequency_penalty": 1.25,
                   "repetition_penalty": 1.25, "min_p": 0.125, "logit_bias": {3: 8.0}},
}
SAMPLING = {"greedy": {"temperature": 0.0}, "seeded": {"temperature": 0.25, "seed": 17}}


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> Iterator[LLM]:
    with LLM(llama_dir) as engine:
        yield engine


@pytest.fixture(scope="module")
def colocated(cluster: Cluster) -> Iterator[Client]:
    router = cluster.start_router("--local-prefill", "always", name="router-colocated")
    with Client(router.address) as client:
        yield client
    router.stop()
    cluster.routers.remove(router)


def _params(case: str, sampling: str) -> SamplingParams:
    return SamplingParams(max_tokens=20, ignore_eos=True, **SAMPLING[sampling],
                          **CASES[case])


@pytest.mark.parametrize("sampling", sorted(SAMPLING))
@pytest.mark.parametrize("case", sorted(CASES))
def test_disaggregated_equals_colocated_equals_the_engine(
        cluster: Cluster, colocated: Client, llm: LLM, case: str, sampling: str) -> None:
    p = _params(case, sampling)
    prompt = f"{PROMPTS[4]} {case}"
    expected = llm.generate([prompt], p)[0]
    plain = llm.generate([prompt], SamplingParams(max_tokens=20, ignore_eos=True,
                                                  **SAMPLING[sampling]))[0]
    assert expected.token_ids != plain.token_ids  # the parameters change the output
    kwargs = dict(max_tokens=20, ignore_eos=True, timeout=TIMEOUT_S, **SAMPLING[sampling],
                  **CASES[case])
    with Client(cluster.address) as disaggregated:
        got = disaggregated.complete(prompt, **kwargs)
    assert list(got.token_ids) == expected.token_ids
    assert got.text == expected.text
    assert list(colocated.complete(prompt, **kwargs).token_ids) == expected.token_ids
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    bias = {str(k): v for k, v in CASES[case].get("logit_bias", {}).items()}
    extra = {k: v for k, v in CASES[case].items()
             if k not in ("logit_bias", "presence_penalty", "frequency_penalty")}
    standard = {k: v for k, v in CASES[case].items()
                if k in ("presence_penalty", "frequency_penalty")}
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        http = oai.completions.create(model="", prompt=prompt, max_tokens=20,
                                      extra_body={"ignore_eos": True, **extra},
                                      **({"logit_bias": bias} if bias else {}),
                                      **SAMPLING[sampling], **standard)
        assert http.choices[0].text == expected.text
        chat = oai.chat.completions.create(
            model="", messages=[{"role": "user", "content": prompt}], max_tokens=20,
            extra_body={"ignore_eos": True, **extra}, **({"logit_bias": bias} if bias else {}),
            **SAMPLING[sampling], **standard)
        assert chat.choices[0].message.content  # the chat path takes the same parameters
        assert chat.usage is not None and chat.usage.completion_tokens == 20


def test_out_of_range_values_are_a_400_naming_the_field(cluster: Cluster) -> None:
    assert cluster.router is not None
    address = cluster.router.ready["http_address"]
    with openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0,
                       timeout=TIMEOUT_S) as oai:
        for kwargs, field in (({"presence_penalty": 3.0}, "presence_penalty"),
                              ({"logit_bias": {"999999": 1}}, "logit_bias"),
                              ({"extra_body": {"min_tokens": 50}}, "min_tokens")):
            with pytest.raises(openai.BadRequestError) as info:
                oai.completions.create(model="", prompt="hi", max_tokens=10, **kwargs)
            assert field in info.value.message
