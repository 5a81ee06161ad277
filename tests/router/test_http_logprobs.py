"""OpenAI's logprobs objects (``router.http.logprobs``, ``router.http.responses``): the
chat shape and the legacy completions shape, built from the router's ``TokenLogprobs``
with the model's tokenizer; a chunk of tokens whose text is held back still carries its
logprobs."""

from __future__ import annotations

from pathlib import Path

from engine.sampling_params import TokenLogprobs
from router.http.logprobs import LogprobsWriter
from router.http.responses import Shape
from router.outputs import OutputChunk, Usage
from router.validation import load_router_tokenizer


def test_chat_and_completions_shapes(llama_dir: Path) -> None:
    tokenizer = load_router_tokenizer(llama_dir)
    ids = tokenizer.encode("Hello world", add_special_tokens=False).ids
    found = [TokenLogprobs(t, -0.5 * (i + 1), i + 1, ((t, -0.5), (3, -1.5)))
             for i, t in enumerate(ids)]
    texts = [tokenizer.decode([t], skip_special_tokens=False) for t in ids]
    chat = LogprobsWriter(tokenizer, chat=True).body(found)
    assert [e["token"] for e in chat["content"]] == texts
    assert [e["logprob"] for e in chat["content"]] == [lp.logprob for lp in found]
    assert chat["content"][0]["bytes"] == list(texts[0].encode())
    assert [len(e["top_logprobs"]) for e in chat["content"]] == [2] * len(ids)
    writer = LogprobsWriter(tokenizer, chat=False)
    first, rest = writer.body(found[:1]), writer.body(found[1:])  # two stream chunks
    assert first["tokens"] + rest["tokens"] == texts
    assert first["text_offset"] + rest["text_offset"] == [
        sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert rest["top_logprobs"][0][texts[1]] == found[1].logprob


def test_a_chunk_without_text_still_carries_its_logprobs(llama_dir: Path) -> None:
    writer = LogprobsWriter(load_router_tokenizer(llama_dir), chat=True)
    shape = Shape.of(chat=True, request_id="r", model="m", created=0, logprobs=writer)
    chunk = OutputChunk((5,), "", logprobs=(TokenLogprobs(5, -1.0, 1),))
    (event,) = shape.chunks(chunk)
    assert event["choices"][0]["logprobs"]["content"][0]["logprob"] == -1.0
    plain = Shape.of(chat=True, request_id="r", model="m", created=0)
    assert plain.chunks(OutputChunk((5,), "")) == []
    whole = plain.whole([OutputChunk((5,), "hi", "stop")])
    assert whole["choices"][0]["logprobs"] is None and whole["choices"][0]["message"][
        "content"] == "hi"


def test_n_choices_are_indexed_and_joined_per_choice() -> None:
    shape = Shape.of(chat=False, request_id="r", model="m", created=0, n=2)
    received = [OutputChunk((1,), "a", index=1), OutputChunk((2,), "b"),
                OutputChunk((3,), "c", "length", index=1),
                OutputChunk((4,), "d", "stop", Usage(5, 4, 0))]
    assert [e["choices"][0]["index"] for c in received for e in shape.chunks(c)] == [1, 0, 1, 0]
    whole = shape.whole(received)
    assert [(c["index"], c["text"], c["finish_reason"]) for c in whole["choices"]] == [
        (0, "bd", "stop"), (1, "ac", "length")]
    assert whole["usage"]["completion_tokens"] == 4
    chat = Shape.of(chat=True, request_id="r", model="m", created=0, n=3)
    assert [e["choices"][0]["index"] for e in chat.opening()] == [0, 1, 2]
