"""Small hand-written profiles for the simulator's and the planner's tests (not
measurements)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sim.profile import SCHEMA, Profile, from_json


def profile_json(num_kv_blocks: int = 512) -> dict[str, Any]:
    step = {"base_s": 0.002, "per_prefill_token_s": 2e-5, "per_prefill_attention_s": 1e-9,
            "per_decode_seq_s": 1e-4, "per_decode_context_s": 1e-7,
            "num_kv_blocks": num_kv_blocks}
    return {"schema": SCHEMA, "source": "derived", "description": "test profile",
            "model": {"name": "test", "num_layers": 2, "kv_bytes_per_token": 1024,
                      "block_size": 16, "max_model_len": 4096},
            "steps": {"1": step, "2": {**step, "base_s": 0.001}},
            "transfer": {"latency_s": 0.001, "bytes_per_s": 1e9},
            "router": {"overhead_s": 0.0005}, "handoff": {"overhead_s": 0.002}}


def small_profile(num_kv_blocks: int = 512) -> Profile:
    return from_json(profile_json(num_kv_blocks))


# 5 ms a prompt token: a ~30-token prompt takes ~0.15 s, one worker finishes ~6.6 a second
SLOW_PREFILL_STEP = {"base_s": 0.001, "per_prefill_token_s": 0.005,
                     "per_prefill_attention_s": 0.0, "per_decode_seq_s": 1e-5,
                     "per_decode_context_s": 0.0, "num_kv_blocks": 64}


def write_slow_prefill_profile(path: Path) -> Path:
    """A profile whose prefill is slow enough that the few requests a second of the
    planner's e2e tests (the tiny model's test prompts) load one prefill worker near
    saturation; written to ``path``."""
    path.write_text(json.dumps({
        "schema": SCHEMA, "source": "derived", "description": "a slow-prefill test profile",
        "model": {"name": "tiny", "num_layers": 2, "kv_bytes_per_token": 1024,
                  "block_size": 16, "max_model_len": 2048},
        "steps": {"1": SLOW_PREFILL_STEP}, "transfer": {"latency_s": 0.001, "bytes_per_s": 1e9},
        "router": {"overhead_s": 0.0005}, "handoff": {"overhead_s": 0.002}}))
    return path
