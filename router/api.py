"""The public API's edge: ``pdserve.v1`` messages to and from the router's dataclasses.

The only router module besides the server that imports the public generated code. The
request is parsed here from raw bytes (not by gRPC), so a malformed message — invalid
UTF-8 in a string, a broken encoding, a field this API does not define — becomes
INVALID_ARGUMENT with a message, not gRPC's generic INTERNAL.
"""

from __future__ import annotations

import json

from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet

from pdserve.v1 import generate_pb2 as pb
from router.outputs import OutputChunk
from router.validation import ClientRequest, InvalidRequest, ModelLimits

OPTIONAL_SAMPLING = ("min_p", "min_tokens", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", "logprobs", "n", "prompt_logprobs")


def parse_generate_request(raw: bytes) -> ClientRequest:
    """``ClientRequest`` from a serialized ``GenerateRequest``; ``InvalidRequest`` when it
    does not parse (the message names why)."""
    try:
        message = pb.GenerateRequest.FromString(raw)
    except DecodeError as exc:
        raise InvalidRequest(f"not a valid pdserve.v1.GenerateRequest: {exc}") from None
    return to_client_request(message)


def to_client_request(message: pb.GenerateRequest) -> ClientRequest:
    s = message.sampling
    unknown = [f.field_number for f in UnknownFieldSet(message)]
    unknown += [f.field_number for f in UnknownFieldSet(s)]
    if message.HasField("token_ids"):
        unknown += [f.field_number for f in UnknownFieldSet(message.token_ids)]
    which = message.WhichOneof("prompt")
    if message.HasField("resume"):
        unknown += [f.field_number for f in UnknownFieldSet(message.resume)]
    if s.HasField("structured_outputs"):
        unknown += [f.field_number for f in UnknownFieldSet(s.structured_outputs)]
    return ClientRequest(
        request_id=message.request_id, model=message.model,
        text=message.text if which == "text" else None,
        token_ids=tuple(message.token_ids.ids) if which == "token_ids" else None,
        max_tokens=s.max_tokens if s.HasField("max_tokens") else None,
        temperature=s.temperature if s.HasField("temperature") else None,
        top_p=s.top_p if s.HasField("top_p") else None,
        top_k=s.top_k if s.HasField("top_k") else None,
        seed=s.seed if s.HasField("seed") else None,
        stop=tuple(s.stop), stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos,
        **{name: getattr(s, name) for name in OPTIONAL_SAMPLING if s.HasField(name)},
        logit_bias=tuple(sorted(s.logit_bias.items())),
        structured=_structured(s.structured_outputs) if s.HasField("structured_outputs")
        else None,
        unknown_fields=tuple(sorted(set(unknown))),
        resume_token=message.resume.token if message.HasField("resume") else None,
        resume_token_ids=tuple(message.resume.token_ids))


def _structured(message: pb.StructuredOutputs) -> tuple[str, str] | None:
    """A ``StructuredOutputs`` as (kind, spec) of ``StructuredOutput`` (None: no kind set,
    or ``json_object`` false)."""
    kind = message.WhichOneof("kind")
    if kind is None or kind == "json_object" and not message.json_object:
        return None
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        return kind, json.dumps(list(message.choice.choices))
    return kind, getattr(message, kind)


def to_response(request_id: str, chunk: OutputChunk, offset: int = 0,
                resume_token: bytes = b"") -> pb.GenerateResponse:
    """The message of ``chunk``: its first token is the stream's ``offset``-th; the
    stream resumes after it with ``resume_token`` (``router.resume``)."""
    message = pb.GenerateResponse(request_id=request_id, token_ids=chunk.token_ids,
                                  text=chunk.text, finish_reason=chunk.finish_reason or "",
                                  offset=offset, resume_token=resume_token, index=chunk.index)
    for into, found in ((message.logprobs, chunk.logprobs),
                        (message.prompt_logprobs, chunk.prompt_logprobs)):
        for lp in found:
            into.add(token_id=lp.token_id, logprob=lp.logprob, rank=lp.rank,
                     top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top])
    if chunk.usage is not None:
        message.usage.prompt_tokens = chunk.usage.prompt_tokens
        message.usage.completion_tokens = chunk.usage.completion_tokens
        message.usage.cached_tokens = chunk.usage.cached_tokens
    return message


def model_info(limits: ModelLimits, block_size: int) -> pb.ModelInfo:
    return pb.ModelInfo(model=limits.name, context_length=limits.context_length,
                        vocab_size=limits.vocab_size, eos_token_ids=limits.eos_token_ids,
                        block_size=block_size)
