"""The ``trained`` preset (``engine.testing.training``), built here with a few steps on a
narrowed shape: the trainer's forward is Hugging Face's on the checkpoint it writes (so
what it learnt is what transformers and the engine run), training lowers the loss, the
build is deterministic, and the text is the standard library's, with a held-out part.
The full preset's quality is measured by the benchmarks (``bench.engine --quantization``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

from engine.testing import training
from engine.testing.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(180)

NARROW = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2}
STEPS = 6


def _digest(path: Path) -> str:
    return hashlib.sha256(b"".join((path / name).read_bytes() for name in
                                   ("model.safetensors", "tokenizer.json", "config.json"))).hexdigest()


def test_a_trained_checkpoint_is_what_transformers_runs_and_builds_the_same_twice(
        tmp_path: Path) -> None:
    lines: list[str] = []
    first = make_tiny_model(tmp_path / "a", preset="trained", overrides=NARROW,
                            train_steps=STEPS, progress=lines.append)
    again = make_tiny_model(tmp_path / "b", preset="trained", overrides=NARROW, train_steps=STEPS)
    assert _digest(first) == _digest(again)
    assert lines and lines[-1].startswith(f"step {STEPS}/{STEPS}: loss")
    tokenizer = transformers.AutoTokenizer.from_pretrained(first)
    assert len(tokenizer) > 3000  # trained on the text: most of its 4096 merges found
    hf = transformers.AutoModelForCausalLM.from_pretrained(first).eval()
    trainer = training._Trainer(json.loads((first / "config.json").read_text()))
    trainer.load_state_dict(load_file(str(first / "model.safetensors")))
    ids = torch.tensor([tokenizer("def main(argv):\n    return 0\n")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(trainer(ids), hf(ids).logits, rtol=1e-4, atol=1e-4)


def test_training_lowers_the_loss_on_text_it_never_saw() -> None:
    from engine.testing.tokenizer_corpus import train_tokenizer

    text = training.training_text()
    held_out = training.held_out_text()
    assert len(text.encode()) >= training.TEXT_BYTES and len(held_out) > 10_000
    assert held_out[:200] not in text
    tokenizer = train_tokenizer("llama", 512, text[:200_000])
    ids = tokenizer.encode(text[:200_000], add_special_tokens=False).ids
    config = {"model_type": "llama", **NARROW, "head_dim": 16, "vocab_size": 576,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
    test = torch.tensor([tokenizer.encode(held_out[:20_000], add_special_tokens=False).ids[:257]])

    def loss(weights: dict[str, torch.Tensor]) -> float:
        model = training._Trainer(config)
        model.load_state_dict(weights)
        with torch.no_grad():
            logits = model(test[:, :-1])
        return float(torch.nn.functional.cross_entropy(logits[0], test[0, 1:]))

    before = loss(training.train_weights(config, ids, seed=3, steps=1))
    after = loss(training.train_weights(config, ids, seed=3, steps=60))
    assert after < before - 1.0, (before, after)
    with pytest.raises(ValueError, match="llama architecture"):
        training.train_weights({**config, "model_type": "qwen2"}, ids, seed=0, steps=1)
    with pytest.raises(ValueError, match="more than"):
        training.train_weights(config, ids[:100], seed=0, steps=1)


def test_the_trained_preset_is_a_single_file_llama(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama in one weight file"):
        make_tiny_model(tmp_path, preset="trained", arch="qwen2")
    with pytest.raises(ValueError, match="llama in one weight file"):
        make_tiny_model(tmp_path, preset="trained", num_shards=2)
