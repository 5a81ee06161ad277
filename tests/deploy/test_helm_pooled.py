"""The chart's pooled layout (workers.layout=pooled): one worker StatefulSet whose pods start
in the role their ordinal gives (the shell entrypoint, run here with sh), the planner with
its profile, bounds and secrets, the HPA on the planner's desired size, and role-free
labels, budgets, Services and network policies. The generic render, pod and network tests
cover the ``pooled`` case too; these check what only this layout has."""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from pdserve.cli import _parser
from planner.policy import PlannerConfig
from sim.profile import from_json
from tests.deploy import chart
from tests.deploy.netpol import Pod, ingress_allowed

Rendered = Callable[[str], list[dict]]
VALUES = "pooled-values.yaml"
POOL = f"{chart.FULLNAME}-pool"
PLANNER = f"{chart.FULLNAME}-planner"
PROFILE_MOUNT = "/etc/pdserve/planner/profile.json"
GRPC, KV, METRICS, REDIS, EPHEMERAL = 50061, 50071, 9090, 6379, 43127


def _ci_values() -> dict:
    return yaml.safe_load((chart.CI_VALUES_DIR / VALUES).read_text())


def _labels(obj: dict) -> dict[str, str]:
    return obj["spec"]["template"]["metadata"]["labels"]


def _planner_args(docs: list[dict]) -> argparse.Namespace:
    """The planner's command line, parsed by the real ``pdserve`` parser."""
    argv = chart.pdserve_argv(chart.main_container(chart.workload(docs, "planner")))
    assert argv[0] == "planner"
    return _parser().parse_args(argv)


def _fails(helm: Path, *sets: str) -> str:
    done = chart.run_helm(helm, *chart.template_args(VALUES, *sets))
    assert done.returncode != 0, f"rendered although {sets} cannot work"
    return done.stderr


# ------------------------------------------------------------------ the pool

def test_one_worker_workload_and_nothing_tied_to_a_role(rendered: Rendered) -> None:
    docs = rendered("pooled")
    (pool,) = [w for w in chart.workloads(docs) if _labels(w)["app.kubernetes.io/component"]
               in chart.WORKER_COMPONENTS]
    assert (pool["kind"], pool["metadata"]["name"]) == ("StatefulSet", POOL)
    assert pool["spec"]["podManagementPolicy"] == "Parallel"
    names = [d["metadata"]["name"] for d in docs]
    assert not [n for n in names if n.endswith(("-prefill", "-decode"))]
    assert len(names) == len({(d["kind"], d["metadata"]["name"]) for d in docs})
    assert all(n.startswith(chart.FULLNAME) and len(n) <= 63 for n in names)
    for doc in docs:  # no label or selector anywhere names a role
        if doc["kind"] == "ConfigMap":
            continue  # the profile and redis.conf: text, not labels
        roles = {"prefill", "decode"} & set(chart.strings_in(doc))
        assert not roles, (doc["kind"], doc["metadata"]["name"], roles)


def test_each_pod_starts_in_the_role_its_ordinal_gives(helm: Path) -> None:
    docs = chart.render(helm, VALUES, "pool.autoscaling.enabled=false", "pool.replicas=4",
                        "pool.initialPrefill=2")
    pool = chart.workload(docs, "pool")
    assert pool["spec"]["replicas"] == 4
    container = chart.main_container(pool)
    assert chart.env_of(container)["PDSERVE_INITIAL_PREFILL"]["value"] == "2"
    script = " ".join(container["command"])
    assert "$(" not in script and "$$" not in script  # Kubernetes would expand those
    # ordinals compare as numbers: 10 and 11 are above 2 (as strings they would sort below)
    expected = {0: "prefill", 1: "prefill", 2: "decode", 3: "decode", 10: "decode", 11: "decode"}
    for ordinal, role in expected.items():
        argv = chart.pdserve_argv(container, f"{POOL}-{ordinal}")
        assert argv[:3] == ["worker", "--role", role], ordinal
        assert argv[3:] == container["args"], "the wrapper passes the args on unchanged"
        args = _parser().parse_args(argv)  # the real worker command line
        assert args.role == role and args.worker_id == "$(POD_NAME)"


def test_the_entrypoint_passes_args_verbatim_and_refuses_a_name_without_ordinal(
        rendered: Rendered) -> None:
    container = copy.deepcopy(chart.main_container(chart.workload(rendered("pooled"), "pool")))
    container["args"] = [*container["args"], "--speculative-config", '{"method": "ngram"} *']
    done = chart.run_entrypoint(container, f"{POOL}-5")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)[-1] == '{"method": "ngram"} *'  # no splitting, no globbing
    assert f"{POOL}-5 (ordinal 5) starts as a decode worker" in done.stderr
    for bad in ("pdserve", f"{POOL}-", f"{POOL}-x1"):
        done = chart.run_entrypoint(container, bad)
        assert done.returncode != 0 and not done.stdout, bad  # pdserve never started
        assert "no StatefulSet ordinal" in done.stderr
    done = chart.run_entrypoint(container, f"{POOL}-0", {"PDSERVE_INITIAL_PREFILL": "0"})
    assert json.loads(done.stdout)[:3] == ["worker", "--role", "decode"]


def test_every_pool_pod_opens_the_kv_port_and_shares_one_tp_group_size(
        rendered: Rendered) -> None:
    docs = rendered("pooled")
    pool = chart.workload(docs, "pool")
    ports = chart.container_ports(pool)
    args = chart.main_container(pool)["args"]
    assert ports == {"grpc": GRPC, "kv": KV, "metrics": METRICS}
    assert chart.flag_value(args, "--kv-port") == str(KV)
    assert chart.flag_value(args, "--tensor-parallel-size") == "2"
    limits = chart.main_container(pool)["resources"]["limits"]
    assert limits["nvidia.com/gpu"] == 2  # all ranks in the one pod
    assert chart.pod_spec(pool)["terminationGracePeriodSeconds"] > float(
        chart.flag_value(args, "--grace"))


# ------------------------------------------------------------------ the planner

def test_planner_command_line_matches_the_pool_and_values(rendered: Rendered) -> None:
    docs = rendered("pooled")
    values = _ci_values()
    args = _planner_args(docs)
    worker_args = _parser().parse_args(
        chart.pdserve_argv(chart.main_container(chart.workload(docs, "pool"))))
    assert args.profile == PROFILE_MOUNT
    assert args.tensor_parallel_size == worker_args.tensor_parallel_size == 2
    assert args.max_num_batched_tokens == worker_args.max_num_batched_tokens == 2048
    assert args.cluster == worker_args.cluster == chart.FULLNAME
    planner = values["planner"]
    assert (args.ttft_slo_ms, args.tpot_slo_ms) == (planner["ttftSloMs"], planner["tpotSloMs"])
    assert (args.min_prefill, args.min_decode) == (1, 1)
    assert (args.min_workers, args.max_workers) == (planner["minWorkers"], planner["maxWorkers"])
    assert args.host == "0.0.0.0"
    obj = chart.workload(docs, "planner")
    assert args.metrics_port == chart.container_ports(obj)["metrics"] == METRICS
    container = chart.main_container(obj)
    for probe in ("livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"] == {"path": "/metrics", "port": METRICS}
    PlannerConfig(ttft_slo_s=args.ttft_slo_ms / 1000, tpot_slo_s=args.tpot_slo_ms / 1000,
                  min_prefill=args.min_prefill, min_decode=args.min_decode,
                  min_workers=args.min_workers, max_workers=args.max_workers)  # accepted
    assert obj["spec"]["replicas"] == 1


def test_planner_secrets_come_only_from_the_environment(rendered: Rendered) -> None:
    docs = rendered("pooled")
    container = chart.main_container(chart.workload(docs, "planner"))
    words = [*container.get("command", []), *container["args"]]
    assert not {"--redis-url", "--cluster-token-file"} & set(words)
    assert not any("redis://" in w or "PASSWORD" in w or "TOKEN" in w for w in words)
    env = chart.env_of(container)
    assert env["PDSERVE_REDIS_URL"]["value"] == f"redis://:$(REDIS_PASSWORD)@{chart.FULLNAME}" \
                                                f"-redis:6379/0"
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{chart.FULLNAME}-redis", "key": "redis-password"}
    assert env[chart.CLUSTER_TOKEN_ENV] == {"name": chart.CLUSTER_TOKEN_ENV, "valueFrom": {
        "secretKeyRef": {"name": chart.CLUSTER_TOKEN_SECRET, "key": "token"}}}
    secrets = chart.secret_values(docs)
    assert not any(s in text for s in secrets
                   for text in chart.strings_in(chart.workload(docs, "planner")))


def _mounted_profile(docs: list[dict]) -> str:
    """The text of the file the planner's --profile names, followed to its ConfigMap."""
    obj = chart.workload(docs, "planner")
    (mount,) = [m for m in chart.main_container(obj)["volumeMounts"]
                if PROFILE_MOUNT.startswith(m["mountPath"] + "/")]
    assert mount["readOnly"] is True
    volume = next(v for v in chart.pod_spec(obj)["volumes"] if v["name"] == mount["name"])
    key = PROFILE_MOUNT.rsplit("/", 1)[1]
    assert {"key": key, "path": key} in volume["configMap"]["items"]
    return chart.one(docs, "ConfigMap", volume["configMap"]["name"])["data"][key]


def test_the_profile_object_reaches_the_planner_as_json(rendered: Rendered) -> None:
    docs = rendered("pooled")
    given = _ci_values()["planner"]["profile"]
    text = _mounted_profile(docs)
    assert json.loads(text) == given
    profile = from_json(json.loads(text))  # what `pdserve planner` loads at start
    assert profile.step(_planner_args(docs).tensor_parallel_size).num_kv_blocks == 30000
    annotations = chart.workload(docs, "planner")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["checksum/profile"] == hashlib.sha256(text.encode()).hexdigest()[:16]


def test_a_profile_file_given_as_a_string_reaches_the_planner_verbatim(
        helm: Path, tmp_path: Path) -> None:
    profile = _ci_values()["planner"]["profile"]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile, indent=1) + "\n")
    done = chart.run_helm(helm, *chart.template_args(VALUES), "--set-file",
                          f"planner.profile={path}")
    assert done.returncode == 0, done.stderr
    docs = [d for d in yaml.safe_load_all(done.stdout) if d]
    assert _mounted_profile(docs) == path.read_text().strip()
    before = chart.workload(chart.render(helm, VALUES), "planner")
    after = chart.workload(docs, "planner")
    key = "checksum/profile"  # another profile text rolls the planner
    assert before["spec"]["template"]["metadata"]["annotations"][key] != \
        after["spec"]["template"]["metadata"]["annotations"][key]


# ------------------------------------------------------------------ the HPA

def test_the_hpa_follows_the_planners_desired_size_within_its_bounds(rendered: Rendered) -> None:
    docs = rendered("pooled")
    (hpa,) = chart.find(docs, "HorizontalPodAutoscaler")  # no CPU HPA for roles
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                             "name": POOL}
    assert "replicas" not in chart.workload(docs, "pool")["spec"], "the HPA owns the count"
    args = _planner_args(docs)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (
        args.min_workers, args.max_workers) == (2, 6)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "External"
    assert metric["external"]["metric"] == {
        "name": "pdserve_planner_desired_workers",
        "selector": {"matchLabels": {"service": PLANNER}}}
    assert metric["external"]["target"] == {"type": "AverageValue", "averageValue": "1"}
    # the selector's service is the planner's metrics Service, which the ServiceMonitor scrapes
    service = chart.one(docs, "Service", PLANNER)
    assert chart.selector_matches(service["spec"]["selector"],
                                  _labels(chart.workload(docs, "planner")))
    assert [p["name"] for p in service["spec"]["ports"]] == ["metrics"]
    (monitor,) = chart.find(docs, "ServiceMonitor")
    assert chart.selector_matches(monitor["spec"]["selector"]["matchLabels"],
                                  service["metadata"]["labels"])


def test_hpa_bounds_default_to_the_planners_floor(helm: Path) -> None:
    docs = chart.render(helm, VALUES, "planner.minWorkers=0", "planner.minPrefill=2",
                        "planner.maxWorkers=9")
    (hpa,) = chart.find(docs, "HorizontalPodAutoscaler")
    args = _planner_args(docs)
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 9)  # 2P + 1D
    assert (args.min_workers, args.max_workers) == (3, 9)


def test_without_max_workers_the_planner_only_switches_roles(helm: Path) -> None:
    docs = chart.render(helm, VALUES, "pool.autoscaling.enabled=false", "planner.minWorkers=0",
                        "planner.maxWorkers=0")
    assert not chart.find(docs, "HorizontalPodAutoscaler")
    assert chart.workload(docs, "pool")["spec"]["replicas"] == 3
    args = _planner_args(docs)
    assert args.min_workers is None and args.max_workers is None


def test_a_pool_without_planner_renders_no_planner(helm: Path) -> None:
    docs = chart.render(helm, VALUES, "planner.enabled=false", "pool.autoscaling.enabled=false",
                        "planner.profile=null")
    assert chart.components(docs) == ["router", "pool"]
    assert not [d for d in docs if d["metadata"]["name"] == PLANNER]


# ------------------------------------------------------------------ who reaches whom

def _pods(docs: list[dict]) -> dict[str, Pod]:
    pods = {c: Pod(_labels(chart.workload(docs, c)), chart.NAMESPACE)
            for c in ("router", "pool", "planner", "redis")}
    pods["stranger"] = Pod({"app": "web"}, chart.NAMESPACE)
    pods["other-release"] = Pod({**pods["pool"].labels, "app.kubernetes.io/instance": "b"},
                                chart.NAMESPACE)
    pods["monitoring"] = Pod({"app": "prometheus"}, "monitoring", {"name": "monitoring"})
    return pods


@pytest.mark.parametrize("metrics_from", ["anyone", "monitoring"])
def test_network_policies_let_the_planner_router_and_pool_talk(
        helm: Path, rendered: Rendered, metrics_from: str) -> None:
    docs = rendered("pooled") if metrics_from == "anyone" else chart.render(
        helm, VALUES, "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.name=monitoring")
    policies = chart.find(docs, "NetworkPolicy")
    assert len(policies) == 4  # workers, router, redis, planner
    pods = _pods(docs)

    def allowed(src: str, dst: str, port: int) -> bool:
        return ingress_allowed(policies, pods[dst], pods[src], port)

    # any pool pod may be prefill or decode: KV store and torch.distributed both ways
    assert all(allowed("pool", "pool", port) for port in (KV, EPHEMERAL, GRPC))
    assert allowed("router", "pool", GRPC) and not allowed("router", "pool", KV)
    assert allowed("planner", "pool", GRPC) and allowed("planner", "pool", METRICS)  # SetRole
    assert not allowed("planner", "pool", KV) and not allowed("planner", "pool", EPHEMERAL)
    for src in ("router", "pool", "planner"):
        assert allowed(src, "redis", REDIS), src
    for src in ("stranger", "other-release"):
        assert not any(allowed(src, "pool", port) for port in (GRPC, KV, EPHEMERAL)), src
        assert not allowed(src, "redis", REDIS) and not allowed(src, "planner", GRPC)
        assert allowed(src, "pool", METRICS) == (metrics_from == "anyone")
        assert allowed(src, "planner", METRICS) == (metrics_from == "anyone")
    assert allowed("monitoring", "planner", METRICS) and allowed("monitoring", "pool", METRICS)


def test_the_pool_budget_and_service_select_every_pool_pod(rendered: Rendered) -> None:
    docs = rendered("pooled")
    labels = _labels(chart.workload(docs, "pool"))
    assert labels["app.kubernetes.io/component"] == "pool"
    (budget,) = [p for p in chart.find(docs, "PodDisruptionBudget")
                 if chart.selector_matches(p["spec"]["selector"]["matchLabels"], labels)]
    assert budget["metadata"]["name"] == POOL and budget["spec"]["maxUnavailable"] == 1
    service = chart.one(docs, "Service", chart.workload(docs, "pool")["spec"]["serviceName"])
    assert chart.selector_matches(service["spec"]["selector"], labels)
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {
        "grpc": GRPC, "kv": KV, "metrics": METRICS}


# ------------------------------------------------------------------ settings that cannot work

@pytest.mark.parametrize(("sets", "message"), [
    (("planner.profile=null",), "planner.profile is required"),
    (("planner.profile=not json",), "planner.profile is not a JSON object"),
    (("pool.tensorParallelSize=4",), "planner.profile has no steps at TP 4"),
    (("metrics.enabled=false",), "planner.enabled needs metrics.enabled"),
    (("planner.minPrefill=0",), "planner.minPrefill=0 needs router.localPrefill"),
    (("pool.autoscaling.enabled=false", "pool.initialPrefill=3"), "pool.initialPrefill (3)"),
    (("pool.initialPrefill=0",), "pool.initialPrefill=0 needs router.localPrefill"),
    (("planner.maxWorkers=0", "planner.minWorkers=0"), "needs planner.maxWorkers"),
    (("pool.autoscaling.enabled=false", "planner.maxWorkers=0"), "planner.minWorkers needs"),
    (("planner.minWorkers=1",), "planner.minWorkers (1) must be at least"),
    (("planner.maxWorkers=1", "planner.minWorkers=0"), "planner.maxWorkers (1) must be"),
    (("planner.enabled=false",), "pool.autoscaling.enabled needs planner.enabled"),
    (("workers.layout=split",), "pool.autoscaling.enabled needs workers.layout=pooled"),
    (("workers.layout=mixed",), "/workers/layout"),  # values.schema.json
])
def test_impossible_pool_settings_fail_naming_the_value(
        helm: Path, sets: tuple[str, ...], message: str) -> None:
    assert message in _fails(helm, *sets)


def test_the_split_layout_ignores_a_profile_and_has_no_planner(helm: Path) -> None:
    docs = chart.render(helm, None, "planner.profile=x")  # never read when split
    assert chart.components(docs) == list(chart.PDSERVE_COMPONENTS)
    assert not [d for d in docs if d["metadata"]["name"].endswith(("-pool", "-planner"))]


def test_notes_describe_the_pool(helm: Path) -> None:
    done = chart.run_helm(helm, "install", chart.RELEASE, str(chart.CHART_DIR), "--dry-run=client",
                          "--namespace", chart.NAMESPACE, "-f", str(chart.CI_VALUES_DIR / VALUES))
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "pool     2-6 (HPA on the planner's desired size) worker(s) x 2 rank(s)" in notes
    assert "ordinal below 1 start as prefill" in notes
    assert f"describe hpa {POOL}" in notes and "prefill.replicas" not in notes
