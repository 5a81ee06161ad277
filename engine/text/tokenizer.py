"""Loading a Hugging Face ``tokenizer.json`` plus the special ids the engine needs. Torch-free."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tokenizers

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG_FILE = "generation_config.json"
MODEL_CONFIG_FILE = "config.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"


@dataclass(frozen=True)
class TokenizerInfo:
    """A loaded tokenizer and the ids that end or start a sequence.

    ``vocab_size`` is the tokenizer's own size (added tokens included); the model's
    embedding may be larger, and ids beyond this size have no text.
    ``eos_token_ids`` is empty when the checkpoint names no EOS token.
    """

    tokenizer: tokenizers.Tokenizer
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    vocab_size: int


def load_tokenizer(model_dir: str | Path) -> TokenizerInfo:
    """Load ``tokenizer.json`` from a Hugging Face model directory.

    EOS ids come from ``generation_config.json`` ``eos_token_id`` (int or list), else
    ``config.json``, else ``tokenizer_config.json`` ``eos_token`` (a token string looked
    up in the vocabulary). BOS follows the same order. Raises ``FileNotFoundError`` when
    ``tokenizer.json`` is missing and ``ValueError`` on malformed id fields.
    """
    model_dir = Path(model_dir)
    path = model_dir / TOKENIZER_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{TOKENIZER_FILE} not found in model directory {model_dir}")
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    configs = [_read_json(model_dir / name) for name in (GENERATION_CONFIG_FILE, MODEL_CONFIG_FILE)]
    tokenizer_config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)

    eos_token_ids = _first_ids(configs, "eos_token_id")
    if eos_token_ids is None:
        eos_token_ids = _token_string_id(tokenizer, tokenizer_config.get("eos_token"))
    bos_ids = _first_ids(configs, "bos_token_id")
    if bos_ids is None:
        bos_ids = _token_string_id(tokenizer, tokenizer_config.get("bos_token"))
    return TokenizerInfo(
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids,
        bos_token_id=bos_ids[0] if bos_ids else None,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
    )


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in ``path``, or ``{}`` when the file does not exist."""
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def _first_ids(configs: list[dict[str, Any]], key: str) -> tuple[int, ...] | None:
    """``key`` (an int or a list of ints) from the first config that sets it, else None."""
    for config in configs:
        value = config.get(key)
        if value is None or value == []:
            continue
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            raise ValueError(f"{key} must be a non-negative int or a list of them, got {value!r}")
        return tuple(dict.fromkeys(values))  # dedupe, keep order
    return None


def _token_string_id(tokenizer: tokenizers.Tokenizer, token: object) -> tuple[int, ...]:
    """The id of a token given as a string (or ``{"content": str}``), or () if unknown."""
    if isinstance(token, dict):
        token = token.get("content")
    if not isinstance(token, str):
        return ()
    token_id = tokenizer.token_to_id(token)
    return () if token_id is None else (token_id,)
