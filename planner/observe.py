"""A window of the real cluster as the planner sees it: two scrapes of every worker's
metrics (``worker.metrics``), ``seconds`` apart, become one ``Observation``. Pure: the
scraping is ``planner.service``'s.

From the workers' counters and histograms, summed over the window whatever role each
worker had (a role may change within it):

- arrivals per second: the prompts prefilled (``vllm:request_success_total`` with
  ``finished_reason="prefilled"``) or the requests finished, whichever is more;
- the mean prompt: prompt tokens computed (``vllm:prompt_tokens_total``; the prefix
  cache's hits cost nothing) per prompt; the mean output: tokens generated per prompt, so
  that rate × output is the window's decode demand as generated. (Per *finished* request
  it read 0 in a window where outputs outlast the window and nothing finished, and many
  times the demand while a burst's requests were still decoding.)
- the mean inter-token latency and TTFT (``vllm:inter_token_latency_seconds``,
  ``vllm:time_to_first_token_seconds``: sum over count);
- per worker, the mean prefill queue wait (``pdserve:prefill_queue_seconds``) and the
  requests it holds (its registration's running and waiting counts).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.capacity import Traffic
from planner.policy import Observation, WorkerState

PREFILLED = "vllm:request_success_total{finished_reason=prefilled}"
FINISHED = ("vllm:request_success_total{finished_reason=stop}",
            "vllm:request_success_total{finished_reason=length}")
PROMPT_TOKENS = "vllm:prompt_tokens_total{}"
GENERATED = "vllm:generation_tokens_total{}"
ITL = "vllm:inter_token_latency_seconds"
TTFT = "vllm:time_to_first_token_seconds"
QUEUE = "pdserve:prefill_queue_seconds"
# the counters read (a histogram's sum and count only grow too): one that went down says
# the worker restarted under the same id (a pod's name, a Ray slot's) since ``before``
COUNTERS = (PREFILLED, *FINISHED, PROMPT_TOKENS, GENERATED,
            *(f"{h}_{part}{{}}" for h in (ITL, TTFT, QUEUE) for part in ("sum", "count")))


@dataclass(frozen=True)
class WorkerSample:
    """One scrape of one worker: its role and held requests (from its registration) and
    its metric samples (``name{label=value,...}`` → value, labels sorted, ``model_name``
    left out)."""

    worker_id: str
    role: str
    held: int
    metrics: Mapping[str, float]


def observation(before: Sequence[WorkerSample], after: Sequence[WorkerSample],
                seconds: float) -> Observation:
    """The window between two scrapes (a worker missing from ``before`` counts from 0:
    it just joined, as does one whose counters went down: it restarted; one missing from
    ``after`` is left out: it left)."""
    if seconds <= 0:
        raise ValueError(f"a window lasts more than 0 seconds, got {seconds}")
    was = {s.worker_id: s.metrics for s in before}
    for s in after:
        old = was.get(s.worker_id)
        if old is not None and any(s.metrics.get(c, 0.0) < old.get(c, 0.0) for c in COUNTERS):
            del was[s.worker_id]  # restarted: everything it counted is the window's

    def delta(sample: WorkerSample, name: str) -> float:
        return max(0.0, sample.metrics.get(name, 0.0) - was.get(sample.worker_id, {}).get(name, 0.0))

    def total(name: str) -> float:
        return sum(delta(s, name) for s in after)

    def mean_of(histogram: str, samples: Sequence[WorkerSample]) -> float | None:
        count = sum(delta(s, f"{histogram}_count{{}}") for s in samples)
        return sum(delta(s, f"{histogram}_sum{{}}") for s in samples) / count if count else None

    prefilled, finished = total(PREFILLED), sum(total(name) for name in FINISHED)
    prompts = max(prefilled, finished)
    traffic = Traffic(prompts / seconds, total(PROMPT_TOKENS) / prompts if prompts else 0.0,
                      total(GENERATED) / prompts if prompts else 0.0)
    workers = tuple(WorkerState(s.worker_id, s.role, s.held, mean_of(QUEUE, [s]) or 0.0)
                    for s in after)
    return Observation(workers, traffic, itl_s=mean_of(ITL, after), ttft_s=mean_of(TTFT, after))
