"""The wire form of ``EngineConfig`` (leader → rank processes) and the rank launch message."""

from __future__ import annotations

import json

import pytest

from engine.config import (
    CacheConfig,
    ConfigError,
    EngineConfig,
    ParallelConfig,
    RopeScaling,
    SchedulerConfig,
)
from engine.kernels.linear import KernelPlan
from engine.tp.config_codec import CONFIG_WIRE_VERSION, decode_engine_config, encode_engine_config
from engine.tp.rank_process import RankLaunch, RankStatus, StatusKind
from tests.engine.test_config import make_model_config


def full_config() -> EngineConfig:
    model = make_model_config(rope_scaling=RopeScaling(8.0, 1.0, 4.0, 256),
                              tie_word_embeddings=True, rms_norm_eps=1e-6)
    return EngineConfig(
        model=model, cache=CacheConfig(block_size=32, num_kv_blocks=None, hash_seed=7),
        parallel=ParallelConfig(tensor_parallel_size=2, collective_timeout_s=30.0),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
        linear_kernel="torch", rank_plugin="tests.engine.tp.rank_plugin_example:make",
        rank_plugin_config='{"x": 1}')


def test_round_trip_keeps_every_field_and_type() -> None:
    config = full_config()
    decoded = decode_engine_config(encode_engine_config(config))
    assert decoded == config
    assert isinstance(decoded.model.rope_scaling, RopeScaling)
    assert type(decoded.model.rope_theta) is float and type(decoded.cache.block_size) is int
    plain = EngineConfig(model=make_model_config())  # defaults, None rope scaling
    assert decode_engine_config(encode_engine_config(plain)) == plain


def _edited(edit: str, value: object) -> str:
    raw = json.loads(encode_engine_config(full_config()))
    target = raw
    *path, leaf = edit.split(".")
    for key in path:
        target = target[key]
    if value is KeyError:
        del target[leaf]
    else:
        target[leaf] = value
    return json.dumps(raw)


@pytest.mark.parametrize("edit,value,message", [
    ("version", CONFIG_WIRE_VERSION + 1, "wire version"),
    ("engine_config.model.surprise", 1, r"unknown fields \['surprise'\]"),
    ("engine_config.cache.block_size", KeyError, r"missing fields \['block_size'\]"),
    ("engine_config.cache.block_size", "16", "engine_config.cache.block_size"),
    ("engine_config.model.tie_word_embeddings", 1, "tie_word_embeddings"),
    ("engine_config.model.num_layers", 2.0, "num_layers"),
    ("engine_config.model.rope_scaling", [1, 2], "rope_scaling"),
    ("engine_config.parallel.tensor_parallel_size", 0, "tensor_parallel_size must be >= 1"),
])
def test_bad_wire_configs_fail_naming_the_field(edit: str, value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        decode_engine_config(_edited(edit, value))


def test_not_json_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="not JSON"):
        decode_engine_config(b"\x80pickle?")


def test_rank_launch_and_status_round_trip() -> None:
    plan = KernelPlan(((64, 64, "onednn"), (704, 64, "mm_t")), "measured")
    launch = RankLaunch(rank=1, config=full_config(), store_host="127.0.0.1", store_port=4242,
                        num_kv_blocks=64, threads=1, parent_pid=99, kernel_plan=plan,
                        sys_path=("/a", "/b c"))
    assert RankLaunch.decode(launch.encode()) == launch
    for bad_plan in ({"kernels": [[64, "64", "torch"]], "source": "x"},
                     {"kernels": [[64, 64, "cublas"]], "source": "x"}, {"source": "x"}):
        other = json.loads(launch.encode())
        other["kernel_plan"] = bad_plan
        with pytest.raises(ValueError):
            RankLaunch.decode(json.dumps(other).encode())
    other = json.loads(launch.encode())
    other["version"] += 1
    with pytest.raises(ValueError, match="version"):
        RankLaunch.decode(json.dumps(other).encode())
    other = json.loads(launch.encode())
    other["store_port"] = "4242"
    with pytest.raises(ValueError, match="malformed"):
        RankLaunch.decode(json.dumps(other).encode())
    status = RankStatus(StatusKind.READY, 3, 12345)
    assert RankStatus.decode(status.encode()) == status
    with pytest.raises(ValueError):
        RankStatus.decode(b"short")
