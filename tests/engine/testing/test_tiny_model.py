"""engine.testing.tiny_model: generated checkpoints load in Hugging Face and behave as promised."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from engine.testing import tiny_model
from engine.testing.tiny_model import (
    ARCHS,
    BOS_TOKEN_ID,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    PRESETS,
    default_model_cache_dir,
    ensure_demo_model,
    make_tiny_model,
)

transformers = pytest.importorskip("transformers")

REPO_ROOT = Path(__file__).resolve().parents[3]
# NFC text (the qwen tokenizers normalise to NFC), mixing 1- to 4-byte UTF-8 and ZWJ emoji.
MIXED_TEXT = (
    "Héllo wörld — Ελληνικά, Привет, 今天天气很好, 龘 𝔘𝔫𝔦 🦩👨‍👩‍👧 end.\n\ttabs  and 12345 don't"
)
GREEDY_PROMPTS = [
    "Hello world, this is a test",
    "日本語のテキストと English",
    "a",
    "Καλημέρα κόσμε",
    "Привет, мир! 🙂",
    "numbers 1 2 3 4 5",
    "café déjà vu naïve façade",
    "emoji 🚀🚀 rocket",
]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny checkpoint per arch (seed 0), shared by the module."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(root / arch, arch=arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def hf_models(model_dirs: dict[str, Path]) -> dict[str, Any]:
    """HF models loaded once per arch, with their loading info."""
    loaded = {}
    for arch, path in model_dirs.items():
        model, info = transformers.AutoModelForCausalLM.from_pretrained(
            path, output_loading_info=True
        )
        loaded[arch] = (model.eval(), info)
    return loaded


def _config(path: Path) -> dict[str, Any]:
    return json.loads((path / "config.json").read_text())


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory (sharded or not), via safetensors."""
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return tensors


def _assert_clean_load(info: dict[str, Any]) -> None:
    """No missing, unexpected or mismatched weights and no errors (lists or sets in HF)."""
    assert {"missing_keys", "unexpected_keys"} <= info.keys()
    assert {key: value for key, value in info.items() if len(value)} == {}


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# ---------------------------------------------------------------- HF loading


@pytest.mark.parametrize("arch", ARCHS)
def test_hf_loads_without_missing_or_unexpected_weights(hf_models: dict, arch: str) -> None:
    model, info = hf_models[arch]
    _assert_clean_load(info)
    assert type(model).__name__ == _config_class(arch)


def _config_class(arch: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
    }[arch]


@pytest.mark.parametrize("arch", ARCHS)
def test_forward_gives_finite_logits_over_config_vocab(
    hf_models: dict, model_dirs: dict[str, Path], arch: str
) -> None:
    model, _ = hf_models[arch]
    vocab_size = _config(model_dirs[arch])["vocab_size"]
    with torch.no_grad():
        logits = model(torch.tensor([[BOS_TOKEN_ID, 5, 300, vocab_size - 1, 7]])).logits
    assert logits.shape == (1, 5, vocab_size)
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    assert 1.0 < logits.std().item() < 20.0  # scaled up from std-0.02 init, not exploding


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_top2_gap_and_varied_continuations(
    hf_models: dict, model_dirs: dict[str, Path], arch: str
) -> None:
    """Seed 0 is the suite's default: its greedy choices must not be near-ties."""
    model, _ = hf_models[arch]
    tok = transformers.AutoTokenizer.from_pretrained(model_dirs[arch])
    gaps, distinct = [], []
    with torch.no_grad():
        for prompt in GREEDY_PROMPTS:
            ids = tok.encode(prompt)
            num_prompt_tokens = len(ids)
            for _ in range(32):  # full forward per step: no cache API involved
                logits = model(torch.tensor([ids])).logits[0, -1]
                top2 = logits.topk(2).values
                gaps.append((top2[0] - top2[1]).item())
                ids.append(int(logits.argmax()))
            distinct.append(len(set(ids[num_prompt_tokens:])))
    assert min(gaps) > 1e-3
    assert sum(distinct) / len(distinct) > 12  # no collapse into one repeated token


# ---------------------------------------------------------------- layout and config


@pytest.mark.parametrize("arch", ARCHS)
def test_weight_names_and_arch_differences(model_dirs: dict[str, Path], arch: str) -> None:
    config = _config(model_dirs[arch])
    tensors = _tensors(model_dirs[arch])
    names = set(tensors)
    assert config["architectures"] == [_config_class(arch)] and config["model_type"] == arch
    assert all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors.values())
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    layer0 = "model.layers.0."
    for suffix in (
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.o_proj.weight",
    ):
        assert layer0 + suffix in names
    has_bias = f"{layer0}self_attn.q_proj.bias" in names
    assert has_bias == (arch == "qwen2")
    assert ("lm_head.weight" not in names) == (arch == "qwen2") == config["tie_word_embeddings"]
    assert (f"{layer0}self_attn.q_norm.weight" in names) == (arch == "qwen3")
    head_dim = config["head_dim"]
    assert tensors[f"{layer0}self_attn.q_proj.weight"].shape == (
        config["num_attention_heads"] * head_dim,
        config["hidden_size"],
    )
    if arch == "qwen3":
        assert head_dim != config["hidden_size"] // config["num_attention_heads"]
        assert tensors[f"{layer0}self_attn.k_norm.weight"].shape == (head_dim,)


def test_biases_and_norms_are_not_trivial(model_dirs: dict[str, Path]) -> None:
    tensors = _tensors(model_dirs["qwen2"])
    assert tensors["model.layers.0.self_attn.k_proj.bias"].abs().min() > 0
    norm = tensors["model.layers.1.input_layernorm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))


@pytest.mark.parametrize("arch", ARCHS)
def test_config_and_side_files(model_dirs: dict[str, Path], arch: str) -> None:
    path = model_dirs[arch]
    config = _config(path)
    assert (config["bos_token_id"], config["eos_token_id"]) == (BOS_TOKEN_ID, EOS_TOKEN_ID)
    assert config["torch_dtype"] == "float32" and config["hidden_act"] == "silu"
    num_tokens = len(transformers.AutoTokenizer.from_pretrained(path))
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] > num_tokens
    assert config["vocab_size"] - num_tokens <= 64
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    assert tok_config["bos_token"] == "<s>" and tok_config["eos_token"] == "</s>"
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    generation = json.loads((path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == EOS_TOKEN_ID


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer_round_trip_and_specials(model_dirs: dict[str, Path], arch: str) -> None:
    from tokenizers import Tokenizer

    tok = transformers.AutoTokenizer.from_pretrained(model_dirs[arch])
    raw = Tokenizer.from_file(str(model_dirs[arch] / "tokenizer.json"))
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (
        PAD_TOKEN_ID,
        BOS_TOKEN_ID,
        EOS_TOKEN_ID,
    )
    assert len(tok) == raw.get_vocab_size()  # HF adds no tokens of its own
    ids = tok.encode(MIXED_TEXT)
    assert ids == raw.encode(MIXED_TEXT).ids  # HF and tokenizer.json agree
    assert (ids[0] == BOS_TOKEN_ID) == (arch in ("llama", "mistral"))
    assert tok.decode(ids, skip_special_tokens=True) == MIXED_TEXT
    assert raw.decode(raw.encode(MIXED_TEXT, add_special_tokens=False).ids) == MIXED_TEXT


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_some_tokens_are_partial_utf8(model_dirs: dict[str, Path], arch: str) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(model_dirs[arch])
    ids = tok.encode("今天天气很好 龘 🦩 Привет", add_special_tokens=False)
    pieces = [tok.decode([i]) for i in ids]
    assert "\ufffd" in pieces  # a lone partial UTF-8 sequence
    # ...and merges also made tokens of whole non-ASCII characters.
    assert any("\ufffd" not in p and any(ord(c) > 127 for c in p) for p in pieces)


# ---------------------------------------------------------------- sharding, determinism


def test_sharded_checkpoint_matches_unsharded(
    tmp_path: Path, model_dirs: dict[str, Path], hf_models: dict
) -> None:
    sharded = make_tiny_model(tmp_path / "sharded", arch="llama", num_shards=2)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert set(index["weight_map"].values()) == set(files)
    assert set(index["weight_map"]) == set(_tensors(model_dirs["llama"]))
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        sharded, output_loading_info=True
    )
    _assert_clean_load(info)
    ids = torch.tensor([[BOS_TOKEN_ID, 40, 41, 42, 500]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, hf_models["llama"][0](ids).logits)


def test_same_seed_identical_files_different_seed_different_weights(
    tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    again = make_tiny_model(tmp_path / "again", arch="qwen3", seed=0)
    assert _file_bytes(again) == _file_bytes(model_dirs["qwen3"])
    other = make_tiny_model(tmp_path / "other", arch="qwen3", seed=1)
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    a, b = _tensors(again), _tensors(other)
    assert a.keys() == b.keys()
    assert not any(torch.equal(a[name], b[name]) for name in a)


def test_builds_in_a_process_without_transformers(
    tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    """No transformers import anywhere; also: a fresh process gives byte-identical files."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "from engine.testing.tiny_model import make_tiny_model\n"
        "make_tiny_model(sys.argv[1], arch='qwen2')\n"
    )
    out = tmp_path / "no_hf"
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=REPO_ROOT, env=env, check=True, timeout=120
    )
    assert _file_bytes(out) == _file_bytes(model_dirs["qwen2"])


# ---------------------------------------------------------------- options and errors


def test_invalid_arch_or_preset_names_the_choices(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="llama, mistral, qwen2, qwen3"):
        make_tiny_model(tmp_path, arch="gpt2")
    with pytest.raises(ValueError, match="tiny, trained, trained55m, bench55m"):
        make_tiny_model(tmp_path, preset="huge")


def test_overrides_reach_config_and_weights(tmp_path: Path) -> None:
    path = make_tiny_model(
        tmp_path / "m", overrides={"num_hidden_layers": 1, "my_extra_key": [1, 2]}
    )
    config = _config(path)
    assert config["num_hidden_layers"] == 1 and config["my_extra_key"] == [1, 2]
    assert not any(name.startswith("model.layers.1.") for name in _tensors(path))
    with pytest.raises(ValueError, match="vocab_size"):
        make_tiny_model(tmp_path / "small_vocab", overrides={"vocab_size": 64})


def test_presets_have_the_promised_sizes() -> None:
    bench = PRESETS["bench55m"]
    assert (bench["hidden_size"], bench["num_hidden_layers"], bench["vocab_size"]) == (
        512,
        8,
        32000,
    )
    assert PRESETS["tiny"]["hidden_size"] <= 128


def test_bench55m_builds_with_fixed_vocab(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "bench", preset="bench55m")
    config = _config(path)
    assert config["vocab_size"] == 32000
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        num_params = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    assert 55e6 < num_params < 56e6  # llama: untied 32000 x 512 embedding and head


@pytest.mark.slow
def test_bench55m_loads_in_hf(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "bench", preset="bench55m", arch="qwen3")
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    _assert_clean_load(info)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 2, 3, 31999]])).logits
    assert logits.shape == (1, 4, 32000) and torch.isfinite(logits).all()


# ---------------------------------------------------------------- demo model cache


def test_ensure_demo_model_builds_once_and_reuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_model_cache_dir() == tmp_path / "pdserve" / "models"
    builds = []
    real_make = tiny_model.make_tiny_model

    def counting_make(*args: Any, **kwargs: Any) -> Path:
        builds.append(kwargs)
        return real_make(*args, **kwargs)

    monkeypatch.setattr(tiny_model, "make_tiny_model", counting_make)
    first = ensure_demo_model()
    assert first.parent == default_model_cache_dir() and (first / "config.json").is_file()
    assert _config(first)["model_type"] == "llama"
    second = ensure_demo_model()
    assert second == first and len(builds) == 1
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temp dirs left


def test_ensure_demo_model_tolerates_a_concurrent_builder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process finishes first: our rename fails, we use theirs and clean up."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    real_make = tiny_model.make_tiny_model

    final = default_model_cache_dir() / f"tiny-llama-seed0-{tiny_model._generator_fingerprint()}"

    def racing_make(out_dir: Path, **kwargs: Any) -> Path:
        real_make(final, **kwargs)  # the other builder wins the race
        (final / "winner").touch()
        return real_make(out_dir, **kwargs)

    monkeypatch.setattr(tiny_model, "make_tiny_model", racing_make)
    path = ensure_demo_model()
    assert path == final and (path / "winner").exists()
    assert [p.name for p in path.parent.iterdir()] == [path.name]
