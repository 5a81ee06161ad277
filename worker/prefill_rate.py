"""``PrefillRate``: how fast this worker drains a backlog of prompt tokens, measured on its
own steps, reported in its Prefill and Reserve replies.

Only steps that computed at least ``min_tokens`` tokens count (the loop passes half its
step token budget): a backlog is computed in such steps, while a lone short prompt's step
is mostly fixed cost, and would make a worker that happened to serve short prompts look
slow. Routers compare the figures of the workers they know (``router.policy``). Torch-free.
"""

from __future__ import annotations

DEFAULT_HALF_LIFE_S = 10.0


class PrefillRate:
    """Tokens per second of the steps that computed a prompt chunk and at least
    ``min_tokens`` tokens in all (prompt and any decode tokens batched with them: the
    step's cost): the tokens they computed over their time, each step's weight halving
    with every ``half_life_s`` of such steps after it. ``tokens_per_s`` is 0.0 until a step
    was measured; written by the engine loop's thread, read by any (one float, replaced
    whole)."""

    def __init__(self, min_tokens: int = 1, half_life_s: float = DEFAULT_HALF_LIFE_S) -> None:
        if half_life_s <= 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.min_tokens = max(1, min_tokens)
        self.half_life_s = half_life_s
        self._tokens = 0.0
        self._seconds = 0.0
        self.tokens_per_s = 0.0

    def add(self, prompt_tokens: int, tokens: int, seconds: float) -> None:
        """One step that computed ``tokens``, ``prompt_tokens`` of them prompt tokens, in
        ``seconds`` (skipped without prompt tokens, or below ``min_tokens``)."""
        if prompt_tokens <= 0 or tokens < self.min_tokens or seconds <= 0.0:
            return
        keep = 0.5 ** (seconds / self.half_life_s)
        self._tokens = self._tokens * keep + tokens
        self._seconds = self._seconds * keep + seconds
        self.tokens_per_s = self._tokens / self._seconds
