"""load_tokenizer on a small byte-level BPE tokenizer written in the Hugging Face layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from engine.text.tokenizer import TokenizerInfo, load_tokenizer

EOS_TOKEN = "<|eos|>"
BOS_TOKEN = "<|bos|>"
# Accented Latin, CJK and emoji; with a small vocabulary many merges stop inside a
# character, so some tokens hold partial UTF-8 sequences.
TRAINING_TEXT = [
    "héllo wörld, café naïve façade über straße",
    "中文字符测试，中文分词。你好世界",
    "emoji 😀🎉👍 fun 😀😀 🎉 party",
    "hello world. the quick brown fox jumps over the lazy dog",
]


def make_byte_level_tokenizer(vocab_size: int = 420) -> Tokenizer:
    """A GPT-2-style byte-level BPE tokenizer trained on ``TRAINING_TEXT``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[EOS_TOKEN, BOS_TOKEN],
        show_progress=False,
    )
    tokenizer.train_from_iterator(TRAINING_TEXT * 20, trainer)
    return tokenizer


def write_model_dir(
    directory: Path,
    tokenizer: Tokenizer,
    *,
    generation_config: dict | None = None,
    config: dict | None = None,
    tokenizer_config: dict | None = None,
) -> Path:
    """Save ``tokenizer.json`` and whichever config files are given into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    files = {
        "generation_config.json": generation_config,
        "config.json": config,
        "tokenizer_config.json": tokenizer_config,
    }
    for name, content in files.items():
        if content is not None:
            (directory / name).write_text(json.dumps(content))
    return directory


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return make_byte_level_tokenizer()


def test_eos_from_generation_config_list(tmp_path: Path, tokenizer: Tokenizer) -> None:
    model_dir = write_model_dir(
        tmp_path,
        tokenizer,
        generation_config={"eos_token_id": [0, 7, 0], "bos_token_id": 1},
        config={"eos_token_id": 3},
    )
    info = load_tokenizer(model_dir)
    assert isinstance(info, TokenizerInfo)
    assert info.eos_token_ids == (0, 7)
    assert info.bos_token_id == 1
    assert info.vocab_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert info.tokenizer.decode(info.tokenizer.encode("café 中文").ids) == "café 中文"


def test_eos_from_generation_config_int(tmp_path: Path, tokenizer: Tokenizer) -> None:
    info = load_tokenizer(
        write_model_dir(tmp_path, tokenizer, generation_config={"eos_token_id": 5})
    )
    assert info.eos_token_ids == (5,)
    assert info.bos_token_id is None


def test_eos_falls_back_to_model_config(tmp_path: Path, tokenizer: Tokenizer) -> None:
    model_dir = write_model_dir(
        tmp_path,
        tokenizer,
        generation_config={"temperature": 0.7},
        config={"eos_token_id": [2, 3], "bos_token_id": 4},
    )
    info = load_tokenizer(model_dir)
    assert info.eos_token_ids == (2, 3)
    assert info.bos_token_id == 4


def test_eos_falls_back_to_tokenizer_config_string(tmp_path: Path, tokenizer: Tokenizer) -> None:
    model_dir = write_model_dir(
        tmp_path,
        tokenizer,
        config={"hidden_size": 8},
        tokenizer_config={"eos_token": EOS_TOKEN, "bos_token": {"content": BOS_TOKEN}},
    )
    info = load_tokenizer(model_dir)
    assert info.eos_token_ids == (tokenizer.token_to_id(EOS_TOKEN),)
    assert info.bos_token_id == tokenizer.token_to_id(BOS_TOKEN)


def test_no_eos_anywhere_gives_empty_tuple(tmp_path: Path, tokenizer: Tokenizer) -> None:
    model_dir = write_model_dir(tmp_path, tokenizer, tokenizer_config={"eos_token": "<|nope|>"})
    assert load_tokenizer(model_dir).eos_token_ids == ()


def test_malformed_eos_id_is_rejected(tmp_path: Path, tokenizer: Tokenizer) -> None:
    model_dir = write_model_dir(tmp_path, tokenizer, generation_config={"eos_token_id": "2"})
    with pytest.raises(ValueError, match="eos_token_id"):
        load_tokenizer(model_dir)


def test_missing_tokenizer_file_names_file_and_directory(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError) as excinfo:
        load_tokenizer(tmp_path)
    assert "tokenizer.json" in str(excinfo.value)
    assert str(tmp_path) in str(excinfo.value)
