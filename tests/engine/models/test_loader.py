"""Checkpoint discovery (single file, sharded with an index) and weight-loading errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.config import ConfigError
from engine.models.loader import INDEX_FILE, SINGLE_FILE, checkpoint_files, iter_weights
from engine.testing.tiny_model import make_tiny_model
from tests.factories import PROMPTS

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("sharded"), arch="llama", num_shards=2)


def edited_checkpoint(model_dir: Path, out_dir: Path,
                      edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """A copy of a single-file checkpoint whose tensors went through ``edit``."""
    shutil.copytree(model_dir, out_dir)
    tensors = load_file(str(out_dir / SINGLE_FILE))
    edit(tensors)
    save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
    return out_dir


def drop(name: str) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        del tensors[name]

    return edit


def add(name: str, shape: tuple[int, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    def edit(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = torch.zeros(shape)

    return edit


def build_llm(model_dir: Path) -> None:
    with LLM(model_dir, num_kv_blocks=8):
        pass


def first_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Logits of the token after ``prompt``: one scheduled prefill, executed, not updated."""
    core = llm.core
    core.add_request("probe", prompt, GREEDY)
    out = core.scheduler.schedule()
    logits = core.executor.execute(out.chunks)
    core.abort_request("probe")
    return logits


# ------------------------------------------------------------------- discovery
def test_single_file_checkpoint(llama_dir: Path) -> None:
    assert checkpoint_files(llama_dir) == [llama_dir / SINGLE_FILE]


def test_sharded_checkpoint_files_come_from_the_index(sharded_dir: Path) -> None:
    files = checkpoint_files(sharded_dir)
    assert [f.name for f in files] == ["model-00001-of-00002.safetensors",
                                       "model-00002-of-00002.safetensors"]
    index = json.loads((sharded_dir / INDEX_FILE).read_text())["weight_map"]
    names = [name for name, _ in iter_weights(sharded_dir, torch.float32)]
    assert sorted(names) == sorted(index) and len(set(names)) == len(names)


def test_sharded_and_single_checkpoints_hold_the_same_tensors(llama_dir: Path,
                                                              sharded_dir: Path) -> None:
    single = dict(iter_weights(llama_dir, torch.float32))
    sharded = dict(iter_weights(sharded_dir, torch.float32))
    assert single.keys() == sharded.keys()
    assert all(torch.equal(single[name], sharded[name]) for name in single)
    assert all(t.dtype == torch.bfloat16 for _, t in iter_weights(llama_dir, torch.bfloat16))


def test_sharded_and_single_give_identical_logits_and_tokens(llama_dir: Path,
                                                            sharded_dir: Path) -> None:
    with LLM(llama_dir, num_kv_blocks=32) as single, LLM(sharded_dir, num_kv_blocks=32) as sharded:
        prompt = single.encode(PROMPTS[0])
        # 1. the same logits for the first token...
        assert torch.equal(first_logits(single, prompt), first_logits(sharded, prompt))
        # 2. ...and the same greedy continuations
        expected = [r.token_ids for r in single.generate(PROMPTS[:3], GREEDY)]
        assert [r.token_ids for r in sharded.generate(PROMPTS[:3], GREEDY)] == expected
        single.core.check_integrity()
        sharded.core.check_integrity()


def test_missing_shard_is_named(sharded_dir: Path, tmp_path: Path) -> None:
    broken = Path(shutil.copytree(sharded_dir, tmp_path / "broken"))
    (broken / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors"):
        checkpoint_files(broken)
    with pytest.raises(ConfigError, match="model-00002-of-00002.safetensors"):
        build_llm(broken)


def test_no_safetensors_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    empty = Path(shutil.copytree(llama_dir, tmp_path / "empty"))
    (empty / SINGLE_FILE).unlink()
    with pytest.raises(ConfigError, match=SINGLE_FILE):
        checkpoint_files(empty)
    with pytest.raises(ConfigError, match="safetensors"):
        build_llm(empty)


# ----------------------------------------------------------------- load errors
def test_missing_weight_is_named(llama_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.1.mlp.down_proj.weight"
    broken = edited_checkpoint(llama_dir, tmp_path / "broken", drop(name))
    with pytest.raises(ValueError, match="layers.1.mlp.down_proj.weight"):
        build_llm(broken)


def test_unexpected_weight_is_named(llama_dir: Path, tmp_path: Path) -> None:
    name = "model.layers.0.self_attn.extra_proj.weight"
    broken = edited_checkpoint(llama_dir, tmp_path / "broken", add(name, (4, 4)))
    with pytest.raises(ValueError, match=name):
        build_llm(broken)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight",
                                  "model.layers.1.mlp.gate_proj.weight"])
def test_missing_part_of_a_fused_weight_is_named(llama_dir: Path, tmp_path: Path,
                                                 name: str) -> None:
    broken = edited_checkpoint(llama_dir, tmp_path / "broken", drop(name))
    with pytest.raises(ValueError, match=name.removeprefix("model.")):
        build_llm(broken)


@pytest.mark.parametrize(("name", "shape"), [
    ("model.norm.bias", (64,)),  # a known module, but no such parameter
    ("model.layers.0.self_attn.o_proj.bias", (64,)),  # a parameter the config has no use for
    ("model.layers.4.mlp.gate_proj.weight", (128, 64)),  # a layer beyond num_hidden_layers
], ids=["norm.bias", "o_proj.bias", "layer-out-of-range"])
def test_unexpected_parameter_of_a_known_module_is_named(llama_dir: Path, tmp_path: Path,
                                                         name: str,
                                                         shape: tuple[int, ...]) -> None:
    broken = edited_checkpoint(llama_dir, tmp_path / "broken", add(name, shape))
    with pytest.raises(ValueError, match=name):
        build_llm(broken)
