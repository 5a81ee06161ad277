"""A draft model for a trained target: the ``trained`` preset fine-tuned to predict what
the target predicts (knowledge distillation on the same text), for speculative decoding's
figures (``bench.speculative --method draft_model``).

Two small models trained apart on a few megabytes agree on the next token far less often
than a family of large models trained to convergence on the same data (the 5M-parameter
``trained`` preset and ``trained55m`` agree on about one greedy token in four), so a draft
made that way says little about the mechanism. Distilling it from the target — its
weights as the starting point, then AdamW on the KL divergence from the target's
next-token distribution over random windows of the training text — is how drafts are
made to agree. Deterministic from the seed on a given machine and torch build, cached in
the model cache next to the target (``ensure_distilled_draft``).
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.testing import training
from engine.testing.cache import built_once
from engine.testing.weights import write_tensors

# 1,200 steps (19 minutes here): against 300, free text's guesses kept 0.45 -> 0.49 and
# the input-grounded text's 0.22 -> 0.52 (bench.speculative, batch 1)
DISTILL_STEPS = 1200
LEARNING_RATE = 1e-3
_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json")


def distill_weights(student_dir: Path, teacher_dir: Path, token_ids: list[int], *, seed: int,
                    steps: int, progress: Callable[[str], None] | None = None
                    ) -> dict[str, torch.Tensor]:
    """The student checkpoint's weights (Hugging Face names) after ``steps`` AdamW steps
    of KL divergence from the teacher's next-token distribution on random
    ``training.SEQ_LEN`` windows of ``token_ids`` (``training.BATCH`` a step, warm-up
    then cosine decay). Both must be Llamas of one vocabulary."""
    from safetensors.torch import load_file

    configs = [json.loads((d / "config.json").read_text()) for d in (student_dir, teacher_dir)]
    if configs[0]["vocab_size"] != configs[1]["vocab_size"]:
        raise ValueError(f"the student's vocabulary ({configs[0]['vocab_size']}) is not the "
                         f"teacher's ({configs[1]['vocab_size']})")
    threads = torch.get_num_threads()
    torch.set_num_threads(training.TRAIN_THREADS)
    try:
        student, teacher = (training._Trainer(c) for c in configs)
        for model, d in ((student, student_dir), (teacher, teacher_dir)):
            model.load_state_dict(load_file(str(d / "model.safetensors")))
        teacher.eval().requires_grad_(False)
        return _distill(student, teacher, torch.tensor(token_ids), seed, steps, progress)
    finally:
        torch.set_num_threads(threads)


def _distill(student: torch.nn.Module, teacher: torch.nn.Module, data: torch.Tensor,
             seed: int, steps: int, progress: Callable[[str], None] | None
             ) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(student.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95),
                                  weight_decay=0.1)
    started, every = time.monotonic(), max(1, steps // 10)
    for step in range(steps):
        lr = LEARNING_RATE * min(1.0, (step + 1) / training.WARMUP_STEPS) * \
            0.5 * (1 + math.cos(math.pi * step / steps))
        for group in optimizer.param_groups:
            group["lr"] = lr
        starts = torch.randint(0, data.numel() - training.SEQ_LEN, (training.BATCH,),
                               generator=generator)
        window = torch.stack([data[s:s + training.SEQ_LEN] for s in starts.tolist()])
        with torch.no_grad():
            target = F.log_softmax(teacher(window), dim=-1)
        logits = student(window)
        vocab = logits.shape[-1]
        loss = F.kl_div(F.log_softmax(logits, dim=-1).reshape(-1, vocab),
                        target.reshape(-1, vocab), log_target=True, reduction="batchmean")
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        if progress is not None and ((step + 1) % every == 0 or step + 1 == steps):
            agree = (logits.argmax(-1) == target.argmax(-1)).float().mean().item()
            progress(f"step {step + 1}/{steps}: KL {loss.item():.3f}, top-1 agreement "
                     f"{agree:.2f} ({time.monotonic() - started:.0f} s)")
    return {name: t.detach().contiguous() for name, t in student.state_dict().items()}


def make_distilled_draft(out_dir: Path, student_dir: Path, teacher_dir: Path, *,
                         seed: int = 0, steps: int = DISTILL_STEPS, text: str | None = None,
                         progress: Callable[[str], None] | None = None) -> Path:
    """Writes the student distilled from the teacher on ``text`` (default: the training
    text) as a checkpoint (the student's config and tokenizer files) into ``out_dir``;
    returns it."""
    from tokenizers import Tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in _FILES:
        shutil.copyfile(student_dir / name, out_dir / name)
    tokenizer = Tokenizer.from_file(str(teacher_dir / "tokenizer.json"))
    ids = tokenizer.encode(training.training_text() if text is None else text,
                           add_special_tokens=False).ids
    write_tensors(out_dir, distill_weights(student_dir, teacher_dir, ids, seed=seed,
                                           steps=steps, progress=progress))
    return out_dir


def ensure_distilled_draft(student_dir: Path, teacher_dir: Path, *,
                           progress: Callable[[str], None] | None = None) -> Path:
    """``make_distilled_draft`` of the two cached checkpoints, cached beside them (named by
    both and by this module's source: a changed recipe gets a fresh entry)."""
    digest = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
    final = teacher_dir.parent / f"draft-{student_dir.name}-for-{teacher_dir.name}-{digest}"
    return built_once(final, lambda tmp: make_distilled_draft(tmp, student_dir, teacher_dir,
                                                              progress=progress))
