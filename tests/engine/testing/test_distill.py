"""``engine.testing.distill``: a student distilled from a teacher (two tiny random Llamas of
one vocabulary, a few steps) is a checkpoint the engine loads and can draft with, its
weights moved from the student's, the same for the same seed; a teacher of another
vocabulary is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from engine import LLM, SamplingParams
from engine.testing.distill import make_distilled_draft

STEPS = 3
TEXT = "def add(a, b):\n    return a + b\n\n" * 400  # a short text: tokenised at once


def test_a_distilled_draft_loads_drafts_and_is_deterministic(
        model_factory: Callable[..., Path], tmp_path: Path) -> None:
    teacher = model_factory("llama")
    student = model_factory("llama", seed=1, num_hidden_layers=1)
    lines: list[str] = []
    first = make_distilled_draft(tmp_path / "a", student, teacher, steps=STEPS, text=TEXT,
                                 progress=lines.append)
    again = make_distilled_draft(tmp_path / "b", student, teacher, steps=STEPS, text=TEXT)
    assert (first / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert len(lines) == STEPS and "top-1 agreement" in lines[-1]
    before, after = (load_file(str(d / "model.safetensors")) for d in (student, first))
    assert before.keys() == after.keys()
    assert any(not before[k].equal(after[k]) for k in before)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    with LLM(teacher) as plain:
        expected = plain.generate([[5, 6, 7, 8] * 6], params)[0].token_ids
    spec = {"method": "draft_model", "model": str(first), "num_speculative_tokens": 3}
    with LLM(teacher, speculative_config=spec) as llm:
        assert llm.generate([[5, 6, 7, 8] * 6], params)[0].token_ids == expected
        assert llm.stats.num_draft_tokens > 0


def test_a_teacher_of_another_vocabulary_is_refused(model_factory: Callable[..., Path],
                                                    tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocabulary"):
        make_distilled_draft(tmp_path, model_factory("llama", vocab_size=1024),
                             model_factory("llama"), steps=1, text=TEXT)
