"""The pure parts of ``pdserve up --ray`` (no Ray needed): placement-group bundles per
tensor-parallel size, the actor options they become, each actor's command line and
environment (secrets only in the environment), ``ray.init``'s arguments, the CLI flags."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.ray.connect import LOOPBACK_ENV, ray_init_kwargs
from deploy.ray.options import ray_spec_from_args
from deploy.ray.plan import (
    RaySpec,
    actor_resources,
    child_argv,
    child_env,
    local_ray_cpus,
    plan_workers,
    planned_cpus,
    planner_spec,
    router_bundle,
    router_spec,
    worker_bundle,
    worker_spec,
)
from deploy.spec import ClusterSpec
from pdserve.cli import _parser
from tests.factories import REPO_ROOT

REDIS_URL = "redis://:s3cret@10.0.0.5:6379/0"


def _config(**fields: Any) -> RaySpec:
    """2 prefill workers (TP 1), 1 decode worker (TP 4), 2 CPUs and a pdserve_gpu per rank."""
    base: dict[str, Any] = {"model_dir": Path("/models/m"), "num_prefill": 2, "num_decode": 1,
                            "decode_tp": 4, "num_kv_blocks": 64}
    return RaySpec(cluster=ClusterSpec(**{**base, **fields}),
                            gpu_resource="pdserve_gpu", cpus_per_rank=2)


# ------------------------------------------------------------------------ placement

@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_one_bundle_holds_a_whole_tp_group(tp: int) -> None:
    assert worker_bundle(tp, cpus_per_rank=1.5, gpu_resource="GPU") == {"CPU": 1.5 * tp,
                                                                         "GPU": float(tp)}
    assert worker_bundle(tp, cpus_per_rank=0, gpu_resource="pdserve_gpu") == {
        "pdserve_gpu": float(tp)}
    assert worker_bundle(tp, cpus_per_rank=1, gpu_resource=None) == {"CPU": float(tp)}


def test_a_worker_has_at_least_one_rank() -> None:
    with pytest.raises(ValueError, match="at least one rank"):
        worker_bundle(0, cpus_per_rank=1, gpu_resource=None)


def test_actor_options_claim_exactly_the_bundle() -> None:
    assert actor_resources({"CPU": 8.0, "GPU": 4.0}) == {"num_cpus": 8.0, "num_gpus": 4.0,
                                                        "resources": {}}
    assert actor_resources({"CPU": 2.0, "pdserve_gpu": 2.0}) == {
        "num_cpus": 2.0, "num_gpus": 0, "resources": {"pdserve_gpu": 2.0}}


def test_plan_workers_prefill_then_decode_each_with_its_group() -> None:
    plans = plan_workers(_config())
    assert [(p.name, p.slot.role, p.tp) for p in plans] == [
        ("prefill-0", "prefill", 1), ("prefill-1", "prefill", 1), ("decode-0", "decode", 4)]
    assert plans[2].bundle == {"CPU": 8.0, "pdserve_gpu": 4.0}
    assert plans[0].bundle == {"CPU": 2.0, "pdserve_gpu": 1.0}


def test_config_checks_and_the_default_gpu_resource() -> None:
    spec = ClusterSpec()
    assert RaySpec(cluster=spec, device="cuda").rank_gpu_resource == "GPU"
    assert RaySpec(cluster=spec).rank_gpu_resource is None
    assert RaySpec(cluster=spec, gpu_resource="x").rank_gpu_resource == "x"
    with pytest.raises(ValueError, match="must reserve something"):
        RaySpec(cluster=spec, cpus_per_rank=0)
    with pytest.raises(ValueError, match="device"):
        RaySpec(cluster=spec, device="tpu")
    with pytest.raises(ValueError, match="max_restarts"):
        RaySpec(cluster=spec, max_restarts=-2)
    with pytest.raises(ValueError, match="cpu_affinity"):
        RaySpec(cluster=ClusterSpec(cpu_affinity={"decode-0": (1,)}))
    with pytest.raises(ValueError, match="min_workers needs max_workers"):
        RaySpec(cluster=spec, min_workers=2)
    with pytest.raises(ValueError, match="the workers started \\(2\\) <= max_workers"):
        RaySpec(cluster=spec, max_workers=1)
    with pytest.raises(ValueError, match="min_workers <= max_workers"):
        RaySpec(cluster=spec, min_workers=4, max_workers=3)


# ------------------------------------------------------------------------ command lines

def test_a_worker_binds_and_advertises_its_node() -> None:
    config = _config()
    spec = worker_spec(config, plan_workers(config)[2], log_dir="/logs", redis_url=REDIS_URL)
    argv = child_argv(spec, node_ip="10.0.0.7", model_dir="/models/m",
                      ready_path="/logs/decode-0.ready.json", python="py")
    assert argv[:6] == ["py", "-m", "pdserve", "decode", "--model", "/models/m"]
    assert _option(argv, "--host") == "10.0.0.7"  # its node's address, not the router's
    assert _option(argv, "--advertise-host") == "10.0.0.7"
    assert _option(argv, "--worker-id") == "decode-0"
    assert _option(argv, "--tensor-parallel-size") == "4"
    assert _option(argv, "--num-kv-blocks") == "64" and _option(argv, "--device") == "cpu"
    assert argv[-2:] == ["--ready-file", "/logs/decode-0.ready.json"]
    assert not any("redis" in word or "s3cret" in word for word in argv)
    assert _parses(argv[3:])  # the real worker parser takes it


def test_worker_args_reach_every_worker_and_decode_args_the_decode_workers() -> None:
    config = _config(worker_args=("--max-num-seqs", "8"),
                     decode_args=("--no-enable-prefix-caching",))
    for plan in plan_workers(config):
        spec = worker_spec(config, plan, log_dir="/l", redis_url=REDIS_URL)
        argv = child_argv(spec, node_ip="10.0.0.7", model_dir="/m", ready_path="/r")
        assert _option(argv, "--max-num-seqs") == "8", argv
        assert ("--no-enable-prefix-caching" in argv) == (plan.name.startswith("decode")), argv
        assert _parses(argv[3:])


def test_a_wildcard_host_binds_every_interface_and_still_advertises_the_node() -> None:
    config = _config(host="0.0.0.0")
    spec = worker_spec(config, plan_workers(config)[0], log_dir="/l", redis_url=REDIS_URL)
    argv = child_argv(spec, node_ip="10.0.0.7", model_dir="/m", ready_path="/r")
    assert (_option(argv, "--host"), _option(argv, "--advertise-host")) == ("0.0.0.0", "10.0.0.7")


def test_the_router_binds_host_and_gets_its_secrets_in_the_environment() -> None:
    config = _config(host="0.0.0.0", port=50051, model_name="m", max_inflight=9)
    spec = router_spec(config, log_dir="/l", redis_url=REDIS_URL, api_key="k3y")
    argv = child_argv(spec, node_ip="10.0.0.7", model_dir="/m", ready_path="/r")
    assert (_option(argv, "--host"), _option(argv, "--port")) == ("0.0.0.0", "50051")
    assert "--advertise-host" not in argv and _option(argv, "--max-inflight") == "9"
    assert not any("s3cret" in w or "k3y" in w for w in argv)
    assert "s3cret" not in repr(spec) and "k3y" not in repr(spec)
    env = child_env(spec, base={"PATH": "/bin"}, node_ip="10.0.0.7", gpu_ids=[])
    assert env["PDSERVE_REDIS_URL"] == REDIS_URL and env["PDSERVE_API_KEY"] == "k3y"
    assert _parses(argv[3:])


def test_the_planner_runs_without_a_model_and_keeps_a_prefill_worker() -> None:
    config = _config(planner_args=("--profile", "/p.json", "--max-workers", "4"))
    spec = planner_spec(config, log_dir="/l", redis_url=REDIS_URL, token="t0k")
    argv = child_argv(spec, node_ip="10.0.0.7", model_dir="", ready_path="/r")
    assert argv[3] == "planner" and "--model" not in argv and REDIS_URL not in argv
    assert _option(argv, "--profile") == "/p.json" and _option(argv, "--max-workers") == "4"
    assert _option(argv, "--min-prefill") == "1"  # the routers do not prefill (never)
    assert _option(argv, "--cluster") == config.cluster.name
    assert _option(argv, "--ready-file") == "/r"
    env = child_env(spec, base={"PATH": "/bin"}, node_ip="10.0.0.7", gpu_ids=[])
    assert env["PDSERVE_REDIS_URL"] == REDIS_URL and env["PDSERVE_CLUSTER_TOKEN"] == "t0k"
    local = _config(planner_args=("--profile", "/p.json"), local_prefill="fallback")
    assert "--min-prefill" not in planner_spec(local, log_dir="/l", redis_url=REDIS_URL).options


def test_the_router_gets_the_http_api_settings_and_extra_flags() -> None:
    on = router_spec(_config(http_port=8080, chat_template=Path("/t.jinja"),
                             router_args=("--max-queued-tokens", "99")),
                     log_dir="/l", redis_url=REDIS_URL, api_key=None)
    argv = child_argv(on, node_ip="10.0.0.7", model_dir="/m", ready_path="/r")
    assert _option(argv, "--http-port") == "8080" and _option(argv, "--chat-template") == "/t.jinja"
    assert _option(argv, "--max-queued-tokens") == "99" and _parses(argv[3:])
    off = router_spec(_config(http_port=None), log_dir="/l", redis_url=REDIS_URL, api_key=None)
    argv = child_argv(off, node_ip="10.0.0.7", model_dir="/m", ready_path="/r")
    assert "--no-http" in argv and "--http-port" not in argv and _parses(argv[3:])


def test_worker_environment_secrets_threads_gloo_and_one_gpu_per_rank() -> None:
    config = _config()
    spec = worker_spec(config, plan_workers(config)[2], log_dir="/l", redis_url=REDIS_URL)
    base = {"PATH": "/bin", "PDSERVE_API_KEY": "router-only", "PDSERVE_REDIS_URL": "stale",
            "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    env = child_env(spec, base=base, node_ip="127.0.0.1", gpu_ids=["4", "5", "6", "7"])
    assert env["PDSERVE_REDIS_URL"] == REDIS_URL and "PDSERVE_API_KEY" not in env
    assert env["OMP_NUM_THREADS"] == "2" and env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_SOCKET_IFNAME"] == "lo"
    # the leader sees rank 0's GPU only; each follower narrows to its own (engine.config)
    assert env["CUDA_VISIBLE_DEVICES"] == "4" and env["PDSERVE_RANK_GPUS"] == "4,5,6,7"
    remote = child_env(spec, base={}, node_ip="10.0.0.7", gpu_ids=[])
    assert "GLOO_SOCKET_IFNAME" not in remote and "PDSERVE_RANK_GPUS" not in remote


def test_the_cluster_token_reaches_every_process_in_its_environment_only() -> None:
    config = _config()
    token = "t0ken-0123456789abcdef"
    specs = [worker_spec(config, plan, log_dir="/l", redis_url=REDIS_URL, token=token)
             for plan in plan_workers(config)]
    specs.append(router_spec(config, log_dir="/l", redis_url=REDIS_URL, api_key=None,
                             token=token))
    for spec in specs:
        argv = child_argv(spec, node_ip="10.0.0.7", model_dir="/m", ready_path="/r")
        assert not any(token in word for word in argv) and token not in repr(spec)
        env = child_env(spec, base={"PDSERVE_CLUSTER_TOKEN": "stale"}, node_ip="10.0.0.7",
                        gpu_ids=[])
        assert env["PDSERVE_CLUSTER_TOKEN"] == token
    # a process not given one does not inherit the actor's
    bare = worker_spec(config, plan_workers(config)[0], log_dir="/l", redis_url=REDIS_URL)
    env = child_env(bare, base={"PDSERVE_CLUSTER_TOKEN": "stale"}, node_ip="10.0.0.7",
                    gpu_ids=[])
    assert "PDSERVE_CLUSTER_TOKEN" not in env


def _option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def _parses(words: list[str]) -> bool:
    args = _parser().parse_args(words)
    return bool(args.model) and bool(args.ready_file)


# ------------------------------------------------------------------------ ray.init, CLI

def test_ray_init_arguments() -> None:
    env, kwargs = ray_init_kwargs(RaySpec())
    assert env == {LOOPBACK_ENV: "0"}  # else Ray swaps 127.0.0.1 for an outward address
    assert kwargs["_node_ip_address"] == "127.0.0.1" and kwargs["include_dashboard"] is False
    env, kwargs = ray_init_kwargs(RaySpec(cluster=ClusterSpec(host="0.0.0.0")))
    assert env == {} and "_node_ip_address" not in kwargs
    env, kwargs = ray_init_kwargs(RaySpec(address="auto"))
    assert env == {} and kwargs["address"] == "auto" and "include_dashboard" not in kwargs


def test_a_local_ray_is_sized_for_the_plan_it_places() -> None:
    # the defect: on 2 cores the default plan (two workers of 1 CPU, a router of 1) left
    # the router waiting in silence for a third CPU
    spec = RaySpec(cluster=ClusterSpec(num_prefill=1, num_decode=1))
    assert planned_cpus(spec) == 3.0
    assert local_ray_cpus(spec, host_cpus=2) == 3 and local_ray_cpus(spec, host_cpus=16) == 16
    _, kwargs = ray_init_kwargs(spec)
    assert kwargs["num_cpus"] >= 3
    wide = RaySpec(cluster=ClusterSpec(num_prefill=2, num_decode=1, decode_tp=2),
                   cpus_per_rank=0.5, router_cpus=0.0)
    assert planned_cpus(wide) == 2.0 and local_ray_cpus(wide, host_cpus=1) == 2
    assert "num_cpus" not in ray_init_kwargs(RaySpec(address="auto"))[1]  # not ours to size
    assert router_bundle(spec, "10.0.0.7") == {"node:10.0.0.7": 0.001, "CPU": 1.0}
    assert router_bundle(wide, "10.0.0.7") == {"node:10.0.0.7": 0.001}
    # room for the workers the planner may add: 3 more of the larger TP (2 ranks of 0.5)
    growing = dataclasses.replace(wide, max_workers=6)
    assert planned_cpus(growing) == 2.0 + 3 * 1.0


def _up_args(*words: str) -> argparse.Namespace:
    return _parser().parse_args(["up", *words])


def test_ray_flags_become_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_REDIS_URL", REDIS_URL)
    args = _up_args("--ray", "--ray-address", "auto", "--device", "cuda",
                    "--ray-cpus-per-rank", "4", "--ray-router-cpus", "0.5",
                    "--ray-max-restarts", "-1")
    config = ray_spec_from_args(args, ClusterSpec())
    assert (config.address, config.device, config.rank_gpu_resource) == ("auto", "cuda", "GPU")
    assert (config.cpus_per_rank, config.router_cpus, config.max_restarts) == (4.0, 0.5, -1)
    assert config.cluster.redis_url == REDIS_URL  # from the environment, never a flag
    defaults = ray_spec_from_args(_up_args("--ray"), ClusterSpec(redis_url="redis://x"))
    assert defaults.cluster.redis_url == "redis://x" and defaults.cpus_per_rank == 1.0
    assert defaults.max_workers is None
    bounds = ray_spec_from_args(_up_args("--ray", "--min-workers", "2", "--max-workers", "5"),
                                ClusterSpec())
    assert (bounds.min_workers, bounds.max_workers) == (2, 5)


@pytest.mark.parametrize(("words", "message"), [
    (["--ray-address", "auto"], "--ray-address needs --ray"),
    (["--device", "cuda"], "--device needs --ray"),
    (["--max-workers", "3"], "--max-workers needs --ray"),
    (["--ray", "--max-workers", "1"], "the workers started (2) <= max_workers"),
    (["--ray", "--planner", "p.json", "--min-workers", "1", "--max-workers", "3"],
     "--min-workers 1 is below the planner's floor 2"),
    (["--ray", "--ray-cpus-per-rank", "0"], "must reserve something"),
])
def test_bad_ray_flags_exit_2_before_starting_anything(words: list[str], message: str,
                                                       tmp_path: Path) -> None:
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--log-dir",
                             str(tmp_path / "logs"), *words], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and not (tmp_path / "logs").exists()

