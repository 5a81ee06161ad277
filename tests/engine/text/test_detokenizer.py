"""IncrementalDetokenizer and TextStream on a byte-level BPE tokenizer with partial-UTF-8 tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers

from engine.text.detokenizer import IncrementalDetokenizer, TextStream
from tests.engine.text.test_tokenizer import EOS_TOKEN, make_byte_level_tokenizer

# Trained characters plus unseen ones (龍, 🚀, Ω, ж) that fall back to raw byte tokens.
ALPHABET = "abc .,éöüñç中文字符你好世界😀🎉👍龍🚀Ωж\n"
texts = st.text(alphabet=ALPHABET, min_size=0, max_size=40)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return make_byte_level_tokenizer()


def byte_token_id(tokenizer: Tokenizer, value: int) -> int:
    """The id of the single-byte token for byte ``value``."""
    token = _bytes_to_unicode()[value]
    token_id = tokenizer.token_to_id(token)
    assert token_id is not None
    return token_id


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map used by the ByteLevel pre-tokenizer."""
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1))
    printable += list(range(0xAE, 0xFF + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    assert set(mapping.values()) == alphabet
    return mapping


def stream_deltas(
    detokenizer: IncrementalDetokenizer, chunks: Sequence[Sequence[int]]
) -> list[str]:
    """Feed ``chunks`` in order, then flush; return every delta."""
    deltas = [detokenizer.add(chunk) for chunk in chunks]
    deltas.append(detokenizer.flush())
    return deltas


def split_into_chunks(ids: list[int], cuts: list[int]) -> list[list[int]]:
    bounds = sorted({min(c, len(ids)) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(bounds, bounds[1:])]


# --- IncrementalDetokenizer -------------------------------------------------------------


@settings(deadline=None, max_examples=150)
@given(text=texts, cuts=st.lists(st.integers(0, 60), max_size=8))
def test_streamed_deltas_concatenate_to_decode(
    tokenizer: Tokenizer, text: str, cuts: list[int]
) -> None:
    ids = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = stream_deltas(detokenizer, split_into_chunks(ids, cuts))
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert detokenizer.text == text
    assert not any("\ufffd" in d for d in deltas)


@settings(deadline=None, max_examples=100)
@given(prompt=texts, text=texts)
def test_token_by_token_with_prompt_context(tokenizer: Tokenizer, prompt: str, text: str) -> None:
    prompt_ids = tokenizer.encode(prompt).ids
    ids = tokenizer.encode(text).ids
    detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = stream_deltas(detokenizer, [[t] for t in ids])
    assert deltas[-1] == ""  # valid text: nothing left to flush
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_partial_character_tokens_yield_nothing_until_complete(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("龍").ids  # unseen: three single-byte tokens
    assert len(ids) == 3
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.add([t]) for t in ids] == ["", "", "龍"]


def test_token_spanning_characters_releases_only_complete_ones(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("中文字符").ids
    pieces = [tokenizer.decode([t]) for t in ids]
    assert any(p.endswith("\ufffd") and p != "\ufffd" for p in pieces), pieces
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.add([t]) for t in ids]
    assert "".join(deltas) == "中文字符"
    assert all(d in ("", "中文", "字", "符") for d in deltas), deltas


def test_ids_outside_tokenizer_give_no_text(tokenizer: Tokenizer) -> None:
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    detokenizer = IncrementalDetokenizer(tokenizer)
    first, second = tokenizer.encode("龍").ids[:2], tokenizer.encode("龍").ids[2:]
    assert detokenizer.add([vocab_size, vocab_size + 100]) == ""
    assert detokenizer.add(first + [vocab_size]) == ""
    assert detokenizer.add([vocab_size + 1] + second) == "龍"
    assert detokenizer.text == "龍"


def test_special_tokens_skipped_or_kept(tokenizer: Tokenizer) -> None:
    eos = tokenizer.token_to_id(EOS_TOKEN)
    assert eos is not None
    ids = tokenizer.encode("hi").ids + [eos]
    skipping = IncrementalDetokenizer(tokenizer)
    keeping = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(stream_deltas(skipping, [[t] for t in ids])) == "hi"
    assert "".join(stream_deltas(keeping, [[t] for t in ids])) == "hi" + EOS_TOKEN


def test_invalid_bytes_do_not_stall(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    # A lead byte followed by ASCII is invalid as soon as the ASCII arrives.
    assert detokenizer.add([byte_token_id(tokenizer, 0xE4)]) == ""
    assert detokenizer.add(tokenizer.encode("a").ids) == "\ufffda"
    # A run of bytes that can never be valid is released once it outgrows a character.
    deltas = [detokenizer.add([byte_token_id(tokenizer, 0xFF)]) for _ in range(6)]
    assert "".join(deltas) == "\ufffd" * 3
    assert deltas[:3] == ["", "", ""]
    assert detokenizer.flush() == "\ufffd" * 3
    assert detokenizer.text == tokenizer.decode(
        [byte_token_id(tokenizer, 0xE4)]
        + tokenizer.encode("a").ids
        + [byte_token_id(tokenizer, 0xFF)] * 6
    )


def test_incomplete_tail_is_flushed_as_replacement(tokenizer: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(tokenizer)
    ids = tokenizer.encode("ok龍").ids[:-1]
    assert "".join(detokenizer.add([t]) for t in ids) == "ok"
    assert detokenizer.flush() == "\ufffd"
    assert detokenizer.text == "ok\ufffd"


def test_prompt_ending_mid_character_is_not_completed_by_output(tokenizer: Tokenizer) -> None:
    dragon = tokenizer.encode("龍").ids
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi").ids + dragon[:1])
    deltas = stream_deltas(detokenizer, [dragon[1:], tokenizer.encode("ok").ids])
    assert "".join(deltas) == tokenizer.decode(dragon[1:] + tokenizer.encode("ok").ids)


# --- TextStream -------------------------------------------------------------------------


def run_stream(
    tokenizer: Tokenizer, text: str, stop: Sequence[str]
) -> tuple[list[tuple[str, bool]], TextStream]:
    """Feed ``text``'s tokens one at a time; return every (delta, stopped) and the stream."""
    stream = TextStream(tokenizer, stop=stop)
    results = [stream.add([t]) for t in tokenizer.encode(text).ids]
    return results, stream


def reference_stop_text(
    tokenizer: Tokenizer, ids: list[int], stop: Sequence[str]
) -> tuple[str, bool]:
    """Truncated text at the first token whose prefix text contains a stop string."""
    for n in range(1, len(ids) + 1):
        prefix_text = tokenizer.decode(ids[:n])
        found = [i for i in (prefix_text.find(s) for s in stop) if i >= 0]
        if found:
            return prefix_text[: min(found)], True
    return tokenizer.decode(ids), False


def test_stop_string_truncates_before_it(tokenizer: Tokenizer) -> None:
    results, stream = run_stream(tokenizer, "hello world. bye", ["."])
    assert stream.stopped and results[-1] == ("", True)
    assert "".join(d for d, _ in results) == stream.text == "hello world"
    assert stream.flush() == ""


def test_stop_string_spanning_several_tokens(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab 龍🚀 cd").ids
    stream = TextStream(tokenizer, stop=["龍🚀"])
    results = [stream.add([t]) for t in ids]
    stop_index = next(i for i, (_, stopped) in enumerate(results) if stopped)
    assert stop_index == len(tokenizer.encode("ab 龍🚀").ids) - 1  # the completing token
    assert stream.text == "ab "


def test_possible_stop_prefix_is_held_then_released(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, stop=["world!"])
    emitted = ""
    for token_id in tokenizer.encode("hello world.").ids:
        delta, stopped = stream.add([token_id])
        emitted += delta
        assert not stopped
        assert "w" not in emitted or emitted.endswith(".")  # "world" held until disproved
    assert emitted == "hello world."


def test_flush_releases_trailing_stop_prefix(tokenizer: Tokenizer) -> None:
    results, stream = run_stream(tokenizer, "café wo", ["world"])
    assert "".join(d for d, _ in results) == "café "
    assert stream.flush() == "wo"
    assert stream.text == "café wo" and not stream.stopped


def test_earliest_stop_string_wins(tokenizer: Tokenizer) -> None:
    stop = ["world", "bye", "lo b"]
    _, stream = run_stream(tokenizer, "hello bye world", stop)
    assert stream.stopped and stream.text == "hel"
    # All stop strings complete within one add: still the earliest in the text wins.
    stream = TextStream(tokenizer, stop=stop)
    assert stream.add(tokenizer.encode("hello bye world").ids) == ("hel", True)


def test_tokens_after_stop_add_nothing(tokenizer: Tokenizer) -> None:
    stream = TextStream(tokenizer, stop=["b"])
    assert stream.add(tokenizer.encode("ab").ids) == ("a", True)
    assert stream.add(tokenizer.encode("cd").ids) == ("", True)
    assert stream.text == "a"


def test_empty_stop_string_rejected(tokenizer: Tokenizer) -> None:
    with pytest.raises(ValueError):
        TextStream(tokenizer, stop=[""])


@settings(deadline=None, max_examples=150)
@given(text=texts, data=st.data())
def test_stream_matches_reference(tokenizer: Tokenizer, text: str, data: st.DataObject) -> None:
    stop = data.draw(st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=3))
    if text and data.draw(st.booleans()):  # often stop on a real substring
        start = data.draw(st.integers(0, len(text) - 1))
        stop.append(text[start : start + data.draw(st.integers(1, 4))])
    ids = tokenizer.encode(text).ids
    stream = TextStream(tokenizer, stop=stop)
    deltas = [stream.add([t])[0] for t in ids]
    deltas.append(stream.flush())
    expected_text, expected_stopped = reference_stop_text(tokenizer, ids, stop)
    assert "".join(deltas) == stream.text == expected_text
    assert stream.stopped == expected_stopped
    assert not any("\ufffd" in d for d in deltas)


# --- Sentencepiece-style (Metaspace + byte fallback) tokenizer ----------------------------


def make_sentencepiece_style_tokenizer() -> Tokenizer:
    """A Llama-2-style tokenizer: '▁' word marks, <0xXX> byte fallback, leading space stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "▁w", "ll", "é", "中"]:
        vocab.setdefault(piece, len(vocab))
    model = models.BPE(
        vocab=vocab,
        merges=[("▁", "h"), ("▁", "w"), ("l", "l")],
        byte_fallback=True,
        unk_token="<unk>",
        fuse_unk=True,
    )
    tokenizer = Tokenizer(model)
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    tokenizer.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return tokenizer


def test_prompt_context_keeps_leading_space_for_metaspace() -> None:
    tokenizer = make_sentencepiece_style_tokenizer()
    output_ids = tokenizer.encode("hello world 龍é").ids
    with_prompt = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi").ids)
    without_prompt = IncrementalDetokenizer(tokenizer)
    assert "".join(stream_deltas(with_prompt, [[t] for t in output_ids])) == " hello world 龍é"
    deltas = stream_deltas(without_prompt, [[t] for t in output_ids])
    assert "".join(deltas) == tokenizer.decode(output_ids) == "hello world 龍é"
    assert deltas[-6:] == [" ", "", "", "龍", "é", ""]  # byte-fallback tokens held until complete


def test_a_stop_string_begun_within_min_tokens_still_stops_the_stream(
        tokenizer: Tokenizer) -> None:
    """As vLLM, which looks back a stop string's length: text released while no stop
    string was looked for (min_tokens) may hold its beginning; what was sent stays sent."""
    ids = tokenizer.encode("say STOP now").ids
    split = len(tokenizer.encode("say ST").ids)
    assert tokenizer.decode(ids[:split]) == "say ST"  # the stop string straddles the split
    stream = TextStream(tokenizer, stop=["STOP"])
    sent = "".join(stream.add([t], may_stop=False)[0] for t in ids[:split])
    assert sent == "say ST"
    results = [stream.add([t]) for t in ids[split:]]
    assert stream.stopped and stream.text == "say ST" and results[-1][1]
    # no stop string there: the guarded text holds nothing back, and flush releases the rest
    stream = TextStream(tokenizer, stop=["STOP"])
    for t in tokenizer.encode("say ST").ids:
        stream.add([t], may_stop=False)
    rest = "".join(stream.add([t])[0] for t in tokenizer.encode("OCK up").ids) + stream.flush()
    assert not stream.stopped and stream.text == "say STOCK up" and rest == "OCK up"


def test_a_short_stop_string_wholly_within_min_tokens_does_not_stop_the_stream(
        tokenizer: Tokenizer) -> None:
    """Only a match ending after the min_tokens text counts (as vLLM's look-back): with a
    longer stop string beside it, the guarded text reaches back past a short one's end."""
    stream = TextStream(tokenizer, stop=["\n", "###"])
    sent = "".join(stream.add([t], may_stop=False)[0] for t in tokenizer.encode("a\n").ids)
    assert sent == "a\n"
    rest = "".join(stream.add([t])[0] for t in tokenizer.encode("bc").ids)
    assert not stream.stopped and rest == "bc" and stream.text == "a\nbc"
    assert stream.add(tokenizer.encode("d\ne").ids) == ("d", True)  # a new one still stops
