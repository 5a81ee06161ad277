"""``PrefillRate``: how fast this prefill worker drains a backlog of prompt tokens, measured
on its own steps, reported in its Prefill replies.

Only steps that computed at least ``min_tokens`` prompt tokens count (the loop passes half
its step token budget): a backlog is computed in such steps, while a lone short prompt's
step is mostly fixed cost, and would make a worker that happened to serve short prompts
look slow. Routers compare the figures of the workers they know (``router.policy``).
Torch-free.
"""

from __future__ import annotations

DEFAULT_WEIGHT = 0.05  # of each new step: about the last 20 steps make the figure


class PrefillRate:
    """An exponentially weighted mean of the prompt tokens per second of the steps that
    computed at least ``min_tokens`` of them (each new one ``weight``; one slow step
    moves it little). ``tokens_per_s`` is 0.0 until a step was measured, and again after
    ``reset``; written by the engine loop's thread, read by any (one float, replaced
    whole)."""

    def __init__(self, min_tokens: int = 1, weight: float = DEFAULT_WEIGHT) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"weight must be in (0, 1], got {weight}")
        self.min_tokens = max(1, min_tokens)
        self.weight = weight
        self.tokens_per_s = 0.0

    def add(self, prompt_tokens: int, seconds: float) -> None:
        """One step that computed ``prompt_tokens`` prompt tokens in ``seconds`` (skipped
        below ``min_tokens``)."""
        if prompt_tokens < self.min_tokens or seconds <= 0.0:
            return
        rate = prompt_tokens / seconds
        old = self.tokens_per_s
        self.tokens_per_s = rate if not old else old + self.weight * (rate - old)

    def reset(self) -> None:
        """Forget what was measured (the worker stopped serving prefill)."""
        self.tokens_per_s = 0.0
