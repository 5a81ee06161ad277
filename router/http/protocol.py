"""The request bodies of the HTTP API, and their mapping to the router's ``ClientRequest``.

Field names and defaults are OpenAI's, plus vLLM's sampling extensions (``top_k``,
``ignore_eos``, ``stop_token_ids``, ``request_id``). Types are checked strictly (a string
is not a number); integers are bounded to what the gRPC API can carry, and everything else
is checked by ``router.validation`` with the same messages the gRPC API sends.

Unknown fields are ignored, as vLLM does, with two exceptions that get a 400 naming the
field: parameters pdserve does not implement, set to anything but their default
(``UNSUPPORTED``: never silently ignored), and names of pdserve's internal fields
(``INTERNAL_FIELDS``: a client cannot set them on either API).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.sampling_params import MAX_LOGPROBS
from router.http.errors import ApiError
from router.validation import ClientRequest

INT64 = Field(ge=-(1 << 63), le=(1 << 63) - 1)
Int64 = Annotated[int, INT64]
Int32 = Annotated[int, Field(ge=-(1 << 31), le=(1 << 31) - 1)]
# vLLM takes any int64, -1 meaning unseeded; the gRPC API's seed is a uint64, which another
# negative seed is mapped to (its two's complement bit pattern)
Seed = Annotated[int, Field(ge=-(1 << 63), le=(1 << 64) - 1)]
M = TypeVar("M", bound=BaseModel)

# parameter -> the values that mean "not used" (anything else: 400)
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "suffix": ("",),
    "top_logprobs": (),  # chat's (a field there); completions take logprobs (an integer)
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "use_beam_search": (False,),
    # vLLM's own extensions pdserve does not implement
    "include_stop_str_in_output": (False,), "skip_special_tokens": (True,),
    "spaces_between_special_tokens": (True,), "allowed_token_ids": ([],),
    "bad_words": ([],), "truncate_prompt_tokens": (), "continue_final_message": (False,),
}
# vLLM's older names of structured outputs -> the kind they set
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}
INTERNAL_FIELDS = ("transfer_id", "attempt_id", "worker_id", "target", "kv_address",
                   "kv_target", "first_token_id", "num_cached_tokens", "model_fingerprint",
                   "lease", "prefill_worker", "decode_worker", "prompt_token_ids")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk (not implemented)


class SamplingRequest(BaseModel):
    """What both endpoints share: the model, sampling, streaming; extras are kept (and
    checked by ``check_extras``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    max_tokens: Annotated[int, INT64] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    seed: Seed | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool = False
    min_p: float | None = None
    min_tokens: Annotated[int, INT64] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as JSON's string key) -> bias
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    n: Annotated[int, INT64] | None = None  # choices (the router caps it: --max-n)
    prompt_logprobs: Annotated[int, INT64] | None = None  # vLLM's: the prompt's, non-streamed
    return_token_ids: bool = False  # vLLM's: every choice carries its token ids
    resume_token_ids: list[Int64] | None = None  # with Last-Event-ID: the ids received
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, ignored
    request_id: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_extras(self) -> None:
        """400 for an internal field or an unsupported parameter not at its default."""
        extras = self.model_extra or {}
        internal = sorted(name for name in extras if name in INTERNAL_FIELDS)
        if internal:
            raise ApiError.invalid(f"fields {internal} are not part of the public API "
                                   "(internal fields cannot be set by clients)", internal[0])
        for name, defaults in UNSUPPORTED.items():
            value = extras.get(name)
            if value is not None and not _is_default(value, defaults):
                shown = json.dumps(value)[:60]
                hint = f"; leave it unset or {json.dumps(defaults[0])}" if defaults else ""
                raise ApiError.invalid(f"{name} is not supported by pdserve (got {shown}){hint}",
                                       name, code="unsupported_parameter")
        if self.stream_options is not None and not self.stream:
            raise ApiError.invalid("stream_options can only be given with stream=true",
                                   "stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise ApiError.invalid("stream_options.continuous_usage_stats is not supported by "
                                   "pdserve (usage comes in the last chunk with include_usage)",
                                   "stream_options", code="unsupported_parameter")

    def logprobs_asked(self) -> int | None:
        """How many alternatives per token the request's logprobs ask for (None: none)."""
        return None

    def prompt_logprobs_asked(self) -> int | None:
        """How many alternatives per prompt token its prompt's logprobs ask for (None:
        none); 400 with ``stream`` (as vLLM: they are not streamed)."""
        if self.prompt_logprobs is not None and self.stream:
            raise ApiError.invalid("prompt_logprobs are not available with stream=true",
                                   "prompt_logprobs")
        return _logprobs_count(self.prompt_logprobs, "prompt_logprobs")

    def client_request(self, *, request_id: str, max_tokens: int | None,
                       text: str | None = None,
                       token_ids: tuple[int, ...] | None = None) -> ClientRequest:
        """The ``ClientRequest`` of this body with the given prompt."""
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return ClientRequest(
            request_id=request_id, model=self.model or "", text=text, token_ids=token_ids,
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
            top_k=self.top_k,
            seed=None if self.seed in (None, -1) else self.seed & ((1 << 64) - 1),
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()), ignore_eos=self.ignore_eos,
            min_p=self.min_p, min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty, logit_bias=self._logit_bias(),
            logprobs=self.logprobs_asked(), prompt_logprobs=self.prompt_logprobs_needed(),
            structured=self.structured_asked(), n=self.n)

    def prompt_logprobs_needed(self) -> int | None:
        """What the workers compute of the prompt's logprobs (``prompt_logprobs_asked``,
        or what ``echo`` with ``logprobs`` shows)."""
        return self.prompt_logprobs_asked()

    def structured_asked(self) -> tuple[str, str] | None:
        """The (kind, spec) of the structured output the body asks for, wherever it asks
        (None: free text); 400 naming the field for a malformed one, or for two."""
        found: list[tuple[str, str, str]] = []  # (field, kind, spec)
        if self.response_format is not None:
            found += _response_format(self.response_format)
        if self.structured_outputs is not None:
            for kind, value in self.structured_outputs.items():
                if kind not in _STRUCTURED_KINDS:
                    raise ApiError.invalid(f"structured_outputs.{kind} is not a kind of "
                                           f"structured output (one of "
                                           f"{sorted(_STRUCTURED_KINDS)})", "structured_outputs")
                if value is not None and value is not False:
                    found.append(("structured_outputs",
                                  *_structured_spec(kind, value, "structured_outputs")))
        for name, kind in GUIDED.items():
            value = getattr(self, name)
            if value is not None:
                found.append((name, *_structured_spec(kind, value, name)))
        if len(found) > 1:
            raise ApiError.invalid(f"give one structured output, got {found[0][0]} "
                                   f"({found[0][1]}) and {found[1][0]} ({found[1][1]})",
                                   found[1][0])
        return (found[0][1], found[0][2]) if found else None

    def _logit_bias(self) -> tuple[tuple[int, float], ...]:
        """``logit_bias`` with its keys as token ids (400 naming it for a key that is not
        an integer)."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token_id = int(key)
            except ValueError:
                raise ApiError.invalid(f"logit_bias keys must be token ids, got "
                                       f"{json.dumps(key)[:40]}", "logit_bias") from None
            pairs.append((token_id, bias))
        return tuple(pairs)


class CompletionRequest(SamplingRequest):
    """``POST /v1/completions``: one prompt, as text or token ids (a batch of one is
    accepted too: ``["text"]``, ``[[1, 2, 3]]``)."""

    prompt: str | list[Int64] | list[str] | list[list[Int64]]
    logprobs: Annotated[int, INT64] | None = None  # the legacy API's: alternatives per token
    echo: bool = False  # the prompt leads each choice's text (and its logprobs, if asked)

    def logprobs_asked(self) -> int | None:
        return _logprobs_count(self.logprobs, "logprobs")

    def prompt_logprobs_needed(self) -> int | None:
        asked, shown = self.prompt_logprobs_asked(), self.logprobs_asked()
        if self.echo and shown is not None:
            return shown if asked is None else max(asked, shown)
        return asked

    def prompt_parts(self) -> tuple[str | None, tuple[int, ...] | None]:
        """(text, token ids): exactly one is not None; 400 for a batch of several."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return prompt, None
        if prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ApiError.invalid(f"prompt: a batch of {len(prompt)} prompts is not "
                                       "supported; send one prompt per request", "prompt")
            first = prompt[0]
            return (first, None) if isinstance(first, str) else (None, tuple(first))
        return None, tuple(p for p in prompt if isinstance(p, int))


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    """One message; fields beyond role and content reach the chat template as given."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[TextPart] | None = None

    def content_chars(self) -> int:
        """Characters of its content (text parts summed)."""
        if isinstance(self.content, list):
            return sum(len(part.text or "") for part in self.content)
        return len(self.content or "")

    def for_template(self, index: int) -> dict[str, Any]:
        """The message as the template sees it (text parts joined into one string)."""
        message = {**(self.model_extra or {}), "role": self.role, "content": self.content}
        if isinstance(self.content, list):
            for j, part in enumerate(self.content):
                if part.type != "text" or part.text is None:
                    raise ApiError.invalid(f"messages[{index}].content[{j}]: only text parts "
                                           f"are supported, got type {part.type!r}",
                                           "messages", code="unsupported_parameter")
            message["content"] = "".join(part.text or "" for part in self.content)
        return message


class ChatCompletionRequest(SamplingRequest):
    """``POST /v1/chat/completions``: ``max_completion_tokens`` wins over ``max_tokens``;
    vLLM's ``add_generation_prompt`` and ``chat_template_kwargs`` reach the template."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, INT64] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, INT64] | None = None
    echo: bool | None = None  # vLLM's (the last message's text first): not implemented

    def check_extras(self) -> None:
        super().check_extras()
        if self.echo:
            raise ApiError.invalid("echo is not supported by pdserve on chat completions "
                                   "(got true); leave it unset or false", "echo",
                                   code="unsupported_parameter")

    def logprobs_asked(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise ApiError.invalid("top_logprobs needs logprobs=true", "top_logprobs")
            return None
        return _logprobs_count(self.top_logprobs or 0, "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template(i) for i, m in enumerate(self.messages)]

    def content_chars(self) -> int:
        """Characters of every message's content (what a template renders at least)."""
        return sum(m.content_chars() for m in self.messages)

    def token_bound(self, context_length: int) -> int:
        """A cheap upper bound of the prompt's tokens before the template renders it (a
        byte-level BPE makes at most a token per byte; the template adds a few per
        message), capped at the context length (a longer prompt is refused later)."""
        per_message = 16  # role markers and separators of a chat template
        return min(4 * self.content_chars() + per_message * len(self.messages), context_length)


def parse(model: type[M], body: bytes) -> M:
    """``model`` from a JSON body; 400 naming the first offending field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = [str(part) for part in first["loc"] if not _is_union_branch(part)]
        where = ".".join(loc)
        message = f"{where}: {first['msg']}" if where else f"request body: {first['msg']}"
        raise ApiError.invalid(message, loc[0] if loc else None) from None


def _is_union_branch(part: object) -> bool:
    """pydantic names the member of a union in an error's location (``str``, ``list[int]``)."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool")
                                      or part.startswith(("list[", "dict[")))


def _is_default(value: Any, defaults: tuple[Any, ...]) -> bool:
    """Whether ``value`` is one of ``defaults`` (``True`` is not ``1``)."""
    return any(value == d and isinstance(value, bool) == isinstance(d, bool) for d in defaults)


def _logprobs_count(value: int | None, name: str) -> int | None:
    """``value`` (alternatives per token) checked against the engine's cap (400 naming
    ``name``)."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ApiError.invalid(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}", name)
    return value


_STRUCTURED_KINDS = frozenset({"json", "json_object", "regex", "choice", "grammar"})


def _response_format(value: dict[str, Any]) -> list[tuple[str, str, str]]:
    """OpenAI's ``response_format``: ``text`` (nothing), ``json_object``, or
    ``json_schema`` with its ``schema`` (``strict`` accepted: the schema is always held)."""
    kind = value.get("type")
    if kind == "text":
        return []
    if kind == "json_object":
        return [("response_format", "json_object", "")]
    if kind == "json_schema":
        spec = value.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ApiError.invalid("response_format.json_schema.schema must be a JSON Schema "
                                   "object", "response_format")
        return [("response_format", "json", json.dumps(schema))]
    raise ApiError.invalid(f"response_format.type must be text, json_object or json_schema, "
                           f"got {json.dumps(kind)[:40]}", "response_format")


def _structured_spec(kind: str, value: Any, field: str) -> tuple[str, str]:
    """(kind, spec) of one structured output given as ``value`` in ``field``."""
    if kind == "json" and isinstance(value, dict | str):
        return kind, value if isinstance(value, str) else json.dumps(value)
    if kind == "json_object" and value is True:
        return kind, ""
    if kind in ("regex", "grammar") and isinstance(value, str):
        return kind, value
    if kind == "choice" and isinstance(value, list) and all(isinstance(c, str) for c in value):
        return kind, json.dumps(value)
    wanted = {"json": "a JSON Schema (object or text)", "json_object": "true",
              "regex": "a string", "grammar": "a string", "choice": "a list of strings"}[kind]
    raise ApiError.invalid(f"{field}: {kind} must be {wanted}", field)
