"""The worker's command line reaches its engine: ``--enable-prefix-caching`` (on by
default, vLLM's spelling) and ``--no-enable-prefix-caching`` (a decode worker then takes
no prompt block from its cache at a reservation: it receives every one)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from engine import SamplingParams
from engine.core.engine_core import EngineCore
from worker import options
from worker.process import engine_config


def _config(llama_dir: Path, *flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    options.add_worker_args(parser)
    return parser.parse_args(["--model", str(llama_dir), "--num-kv-blocks", "16", *flags])


def test_prefix_caching_is_on_unless_turned_off(llama_dir: Path) -> None:
    prompt = list(range(3, 40))
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for flags, cached in (((), 2), (("--no-enable-prefix-caching",), 0)):
        # the engine alone: the KV plane's rank plugin left out
        config = replace(engine_config(_config(llama_dir, *flags)), rank_plugin=None)
        assert config.cache.enable_prefix_caching == (cached > 0)
        core = EngineCore(config)
        try:
            first = core.reserve_for_kv("a", prompt, params, reuse_prefix=True)
            assert first is not None and first.num_cached_blocks == 0
            core.admit_with_kv("a", 5)  # its blocks are keyed now (when caching is on)
            assert core.abort_request("a")
            again = core.reserve_for_kv("b", prompt, params, reuse_prefix=True)
            assert again is not None and again.num_cached_blocks == cached
            assert core.abort_request("b")
        finally:
            core.shutdown()
