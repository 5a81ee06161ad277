"""Incremental detokenization and stop-string matching for streamed output. Torch-free.

Streamed text never splits a multi-byte UTF-8 character: a token may carry only part
of a character's bytes (byte-level BPE, byte-fallback), so text is withheld while the
decoded window ends in U+FFFD and released once later tokens complete (or disprove) it.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers

REPLACEMENT_CHAR = "\ufffd"
# Prompt ids kept as left context for the first output tokens (some decoders, e.g.
# Metaspace, strip a leading space at the start of a decode).
NUM_PROMPT_CONTEXT_TOKENS = 5
# An incomplete UTF-8 sequence has at most 3 bytes, which decode to at most 3 U+FFFD
# (byte-fallback decoders emit one per byte; byte-level decoders one per sequence).
# U+FFFD beyond the last 3 of a trailing run are definitive and can be emitted.
MAX_PENDING_REPLACEMENT_CHARS = 3


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text deltas.

    Keeps a small window of ids ``[prefix_offset:]`` and decodes it whole on each
    ``add``; ``num_context_chars`` characters of the window's text are prompt context
    or already emitted. Ids the tokenizer does not know (e.g. ids beyond its vocabulary
    that the model's larger embedding allows) produce no text.

    Invariant: ``text`` is the concatenation of every delta returned by ``add`` and
    ``flush``; for byte-level tokenizers it equals ``tokenizer.decode(output_ids)``
    after ``flush``.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._chunks: list[str] = []
        context = self._known(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        context_text = self._decode(context)
        if context_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends mid-character; without context the output decodes on its own.
            context, context_text = [], ""
        self._ids: list[int] = context
        self._prefix_offset = 0  # window start in _ids
        self._read_offset = len(context)  # _ids[:read_offset] decode to fully emitted text
        self._num_context_chars = len(context_text)  # chars of window text emitted/context

    @property
    def text(self) -> str:
        """All output text emitted so far (withheld partial characters excluded)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append output ids; return the new text they complete (possibly '')."""
        known = self._known(token_ids)
        if not known:
            return ""
        self._ids.extend(known)
        return self._emit(final=False)

    def flush(self) -> str:
        """Emit whatever is still withheld (an incomplete trailing sequence as U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        window_text = self._decode(self._ids[self._prefix_offset :])
        stable_len = len(window_text) if final else _stable_length(window_text)
        delta = window_text[self._num_context_chars : stable_len]
        self._num_context_chars = max(self._num_context_chars, stable_len)
        if stable_len == len(window_text):
            # Nothing withheld: slide the window so decoding stays O(window) per step.
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
            self._num_context_chars = len(self._decode(self._ids[self._prefix_offset :]))
        if delta:
            self._chunks.append(delta)
        return delta

    def _decode(self, token_ids: Sequence[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(
            list(token_ids), skip_special_tokens=self._skip_special_tokens
        )

    def _known(self, token_ids: Sequence[int]) -> list[int]:
        """The ids that have a token in the tokenizer (others have no text)."""
        return [t for t in token_ids if t >= 0 and self._tokenizer.id_to_token(t) is not None]


def _stable_length(text: str) -> int:
    """Length of the prefix of ``text`` that later tokens cannot change.

    A trailing run of U+FFFD may be an incomplete character; all but its last
    ``MAX_PENDING_REPLACEMENT_CHARS`` are definitive.
    """
    run = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
    return len(text) - min(run, MAX_PENDING_REPLACEMENT_CHARS)


class TextStream:
    """Detokenized output with stop strings: what a client sees, delta by delta.

    When the text contains a stop string, it is cut just before the earliest match and
    the stream stops (vLLM's default: the stop string is not included). Text that could
    still be the beginning of a stop string is withheld until disambiguated. After the
    last ``add``, call ``flush`` to release withheld text. Invariant: the concatenation
    of all deltas equals ``text``, the final output text.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must be non-empty")
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens
        )
        self._stop = tuple(stop)
        self._pending = ""  # decoded but withheld: might begin a stop string
        # the end of the text released while no stop string was looked for (min_tokens),
        # as far as a stop string could reach back into it: a match may start there
        self._guard = ""
        self._chunks: list[str] = []
        self._stopped = False

    @property
    def stopped(self) -> bool:
        """Whether a stop string has matched; later tokens add no text."""
        return self._stopped

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def add(self, token_ids: Sequence[int], *, may_stop: bool = True) -> tuple[str, bool]:
        """Append output ids; return ``(delta, stopped)``. ``may_stop`` False (the
        request's ``min_tokens`` are not out yet, as vLLM rules): no stop string is
        looked for and nothing is withheld for one; a stop string starting in that text and
        ending after it still stops the stream (as vLLM looks back), what was sent staying
        sent."""
        if self._stopped:
            return "", True
        self._pending += self._detokenizer.add(token_ids)
        if not may_stop:
            delta, self._pending = self._pending, ""
            if delta:
                self._chunks.append(delta)
                reach = max((len(s) for s in self._stop), default=1) - 1
                self._guard = (self._guard + delta)[-reach:] if reach else ""
            return delta, False
        return self._release(final=False), self._stopped

    def flush(self) -> str:
        """Release withheld text at finish ('' when stopped)."""
        if self._stopped:
            return ""
        self._pending += self._detokenizer.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        guard = len(self._guard)
        text = self._guard + self._pending  # the guard was sent: only the rest is released
        match = self._earliest_match(text)
        if match is not None:
            delta, self._pending, self._stopped = text[guard:max(guard, match)], "", True
            self._guard = ""
        else:
            keep = 0 if final else self._partial_match_length(text)
            cut = len(text) - keep
            delta, self._pending = text[guard:max(guard, cut)], text[max(guard, cut):]
            self._guard = self._guard[cut:]  # what may still begin a stop string
        if delta:
            self._chunks.append(delta)
        return delta

    def _earliest_match(self, text: str) -> int | None:
        """Start of the earliest stop string in ``text`` (the guard, then the withheld
        text), or None.

        Emitted text never ends with a proper prefix of a stop string (but for the guard,
        searched with it), so every match lies wholly inside the text searched.
        """
        guard = len(self._guard)  # a match must end past it: one inside it was sent as is
        positions = [p for p in (text.find(s, max(0, guard - len(s) + 1)) for s in self._stop)
                     if p >= 0]
        return min(positions) if positions else None

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that begins a stop string."""
        longest = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:n]):
                    longest = n
                    break
        return longest
