"""Structured outputs (``SamplingParams.structured``) through llguidance: compiling what a
request asks for into a grammar, once per distinct request (an LRU cache), and a matcher
per request that says which tokens may come next and follows the tokens that came.

Why llguidance (over xgrammar): a self-contained wheel with no dependencies, where
xgrammar's pulls in triton (a GPU compiler) and transformers on every Linux install;
JSON Schema, regex and Lark grammars in one engine; masks computed in microseconds per
token on small vocabularies; a grammar it rejects comes with a message a client can read.
Torch-free: the router validates with it, the engines (``engine.core.constrain``) apply
the masks. Every process compiles the same request to the same grammar, so the first
token (sampled where the prompt ran) and the rest (on a decode worker, whose matcher is
advanced over the tokens that came before) follow one grammar state.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING

import llguidance

from engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept per process
DEFAULT_COMPILE_LIMIT_S = 5.0


# JSON as ``json.dumps`` writes it: ", " and ": ", no other whitespace. A model left free to
# emit whitespace between tokens may never stop (a schema's "x-guidance" overrides this).
JSON_LAYOUT: JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A structured output the library rejects (its message), or one too slow to compile."""


class Grammars:
    """Compiles ``StructuredOutput``s for one tokenizer and vocabulary, each once (LRU,
    ``cache_size``); thread-safe (the router compiles on its text threads)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Sequence[int],
                 *, cache_size: int = DEFAULT_CACHE_SIZE,
                 compile_limit_s: float | None = DEFAULT_COMPILE_LIMIT_S) -> None:
        """``compile_limit_s``: a grammar that takes longer to compile is refused (None: no
        limit). ``ValueError`` / ``RuntimeError`` from llguidance for a tokenizer it cannot
        use (e.g. more tokens than ``vocab_size``)."""
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size,
            eos_token=list(eos_token_ids) if eos_token_ids else None)
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self.compile_limit_s = compile_limit_s
        self._compiled: OrderedDict[StructuredOutput, str] = OrderedDict()
        self._templates: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()  # by grammar
        self._lock = threading.Lock()

    def grammar(self, structured: StructuredOutput) -> str:
        """The checked llguidance grammar of ``structured`` (``GrammarError`` naming why it
        is refused)."""
        with self._lock:
            found = self._compiled.get(structured)
            if found is not None:
                self._compiled.move_to_end(structured)
                return found
        started = time.monotonic()
        grammar = _grammar_text(structured)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"the {structured.kind} of structured outputs is invalid: "
                               f"{error[:500]}")
        elapsed = time.monotonic() - started
        if self.compile_limit_s is not None and elapsed > self.compile_limit_s:
            raise GrammarError(f"the {structured.kind} of structured outputs took "
                               f"{elapsed:.1f}s to compile, over the limit of "
                               f"{self.compile_limit_s:g}s")
        with self._lock:
            self._compiled[structured] = grammar
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        return grammar

    def matcher(self, structured: StructuredOutput) -> llguidance.LLMatcher:
        """A fresh matcher of ``structured`` at the start of the output: a copy of one kept
        per grammar (LRU, as the grammars are; a copy costs a microsecond, a new matcher
        hundreds of times that)."""
        grammar = self.grammar(structured)
        with self._lock:
            template = self._templates.get(grammar)
            if template is not None:
                self._templates.move_to_end(grammar)
        if template is None:
            template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
            with self._lock:
                self._templates[grammar] = template
                if len(self._templates) > self.cache_size:
                    self._templates.popitem(last=False)
        return template.deep_copy()


def advance(matcher: llguidance.LLMatcher, token_ids: Sequence[int]) -> bool:
    """Follows ``token_ids`` (sampled under the matcher's masks, here or elsewhere); False
    if the grammar rejects one (the matcher is then in error)."""
    return all(matcher.consume_token(t) for t in token_ids)


def _grammar_text(structured: StructuredOutput) -> str:
    kind, spec = structured.kind, structured.spec
    try:
        if kind == "json":
            json.loads(spec)
            return llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_LAYOUT)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}',
                                                                 defaults=JSON_LAYOUT)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec)
        if kind == "choice":
            choices = json.loads(spec)
            if (not isinstance(choices, list) or not choices
                    or not all(isinstance(c, str) and c for c in choices)):
                raise GrammarError("the choice of structured outputs must be a non-empty list "
                                   "of non-empty strings")
            return llguidance.LLMatcher.grammar_from_lark(
                "start: " + " | ".join(json.dumps(c) for c in choices))
        return llguidance.LLMatcher.grammar_from_lark(spec)
    except GrammarError:
        raise
    except (ValueError, RuntimeError, TypeError) as exc:  # the library's, or bad JSON
        raise GrammarError(f"the {kind} of structured outputs is invalid: "
                           f"{str(exc)[:500]}") from None
