"""Factories shared by the tests: checkpoints, requests, reference generations."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "Hello world, this is a test of the engine",
    "日本語のテキストと English mixed together",
    "a",
    "The quick brown fox jumps over the lazy dog again and again and again, "
    "until the dog finally wakes up and chases the fox across the field",
    "Καλημέρα κόσμε",
    "Привет, мир! 🙂",
    "numbers 1 2 3 4 5 6 7 8 9 10 11 12",
    "café déjà vu naïve façade",
    "short",
    "emoji 🚀🚀 rocket science is not that hard",
]


def make_model_dir(path: Path, arch: str = "llama", seed: int = 0,
                   overrides: dict[str, Any] | None = None) -> Path:
    from engine.testing.tiny_model import make_tiny_model

    return make_tiny_model(path, arch=arch, seed=seed, overrides=overrides or {})


def hf_greedy(model: Any, prompt_ids: list[int], num_tokens: int) -> tuple[list[int], list[Any]]:
    """Greedy continuation with Hugging Face (unpadded, EOS ignored) and each step's logits."""
    import torch

    tokens: list[int] = []
    step_logits = []
    with torch.no_grad():
        for _ in range(num_tokens):  # full forward each step: slow but cache-API independent
            logits = model(torch.tensor([prompt_ids + tokens])).logits[0, -1].float()
            step_logits.append(logits)
            tokens.append(int(logits.argmax()))
    return tokens, step_logits


def assert_greedy_match(ours: list[int], ref: list[int], ref_logits: list[Any],
                        tie_tolerance: float = 1e-3) -> None:
    """Token-for-token equality; a divergence is excused only where the reference's own
    top-2 logits were within ``tie_tolerance`` (a near-tie flipped by float noise)."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a == b:
            continue
        top2 = ref_logits[i].topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap < tie_tolerance, (
            f"diverged at token {i}: ours {a}, reference {b}, reference top-2 gap {gap:.2e}\n"
            f"ours={ours}\nref ={ref}")
        return


def run_without_torch(body: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh interpreter (repo root as cwd) where ``import torch``
    raises ImportError; the caller asserts on the result."""
    code = "import sys\nsys.modules['torch'] = None  # `import torch` now raises\n" + body
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout_s)
