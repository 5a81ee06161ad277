"""How the chart's objects find each other: NetworkPolicies (who may reach which port),
Services and their target ports, PodDisruptionBudgets, topology spreading, HPAs and the
ServiceMonitor."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from tests.deploy import chart
from tests.deploy.netpol import Pod, ingress_allowed

Rendered = Callable[[str], list[dict]]
EPHEMERAL_PORT = 43127  # torch.distributed connects on ports like this one


def _pods(docs: list[dict]) -> dict[str, Pod]:
    pods = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]:
            Pod(w["spec"]["template"]["metadata"]["labels"], chart.NAMESPACE)
            for w in chart.workloads(docs)}
    # a pod of another app in the same namespace, and one of another release of this chart
    pods["stranger"] = Pod({"app": "web"}, chart.NAMESPACE)
    pods["other-release"] = Pod({**pods["decode"].labels, "app.kubernetes.io/instance": "b"},
                                chart.NAMESPACE)
    pods["frontend"] = Pod({"app": "ui"}, "frontend", {"kubernetes.io/metadata.name": "frontend"})
    return pods


@pytest.mark.parametrize("case", ["defaults", "extras", "external-redis"])
def test_network_policies_let_only_pdserve_pods_reach_workers_and_redis(
        rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    policies = chart.find(docs, "NetworkPolicy")
    assert len(policies) == (2 if case == "external-redis" else 3)
    pods = _pods(docs)

    def allowed(src: str, dst: str, port: int) -> bool:
        return ingress_allowed(policies, pods[dst], pods[src], port)

    grpc, kv, metrics = 50061, 50071, 9090
    for dst in ("prefill", "decode"):
        for src in ("prefill", "decode"):  # KV store, then gloo/NCCL on ephemeral ports
            assert allowed(src, dst, kv) and allowed(src, dst, EPHEMERAL_PORT), (src, dst)
        assert allowed("router", dst, grpc)
        assert not allowed("router", dst, EPHEMERAL_PORT)
        for src in ("stranger", "other-release", "frontend"):
            assert not allowed(src, dst, grpc) and not allowed(src, dst, kv), (src, dst)
            assert allowed(src, dst, metrics)  # metricsFrom: every namespace
    if case != "external-redis":
        for src in ("router", "prefill", "decode"):
            assert allowed(src, "redis", 6379)
        for src in ("stranger", "other-release", "frontend"):
            assert not allowed(src, "redis", 6379)
    api_callers = ("frontend",) if case == "extras" else ("stranger", "frontend")
    for src in api_callers:
        assert allowed(src, "router", 50051) and allowed(src, "router", 8000)
    if case == "extras":  # apiFrom: only the frontend namespace
        assert not allowed("stranger", "router", 50051)
    assert not allowed("stranger", "router", EPHEMERAL_PORT)


def test_network_policies_can_be_switched_off(rendered: Rendered) -> None:
    assert not chart.find(rendered("minimal"), "NetworkPolicy")


@pytest.mark.parametrize("case", chart.CASES)
def test_services_select_pods_and_name_their_ports(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    for service in chart.find(docs, "Service"):
        targets = [w for w in chart.workloads(docs) if chart.selector_matches(
            service["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        assert len(targets) == 1, service["metadata"]["name"]
        ports = chart.container_ports(targets[0])
        for port in service["spec"]["ports"]:
            assert ports[port["targetPort"]] == port["port"], service["metadata"]["name"]
    api = chart.one(docs, "Service", f"{chart.FULLNAME}-router")
    assert {p["name"]: p["port"] for p in api["spec"]["ports"]} == {"grpc": 50051, "http": 8000}
    stateful = chart.find(docs, "StatefulSet")  # decode, or the pool
    assert [s["metadata"]["name"] for s in stateful] == [
        f"{chart.FULLNAME}-{c}" for c in chart.worker_components(docs) if c != "prefill"]
    for obj in stateful:
        headless = chart.one(docs, "Service", obj["spec"]["serviceName"])
        assert headless["spec"]["clusterIP"] == "None"


@pytest.mark.parametrize("case", ["defaults", "decode-tp4"])
def test_pdbs_and_spreading_cover_each_component(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    pdbs = chart.find(docs, "PodDisruptionBudget")
    assert len(pdbs) == 3
    for component in ("router", "prefill", "decode"):
        labels = chart.workload(docs, component)["spec"]["template"]["metadata"]["labels"]
        covering = [p for p in pdbs if chart.selector_matches(p["spec"]["selector"]["matchLabels"],
                                                              labels)]
        assert len(covering) == 1 and covering[0]["spec"]["maxUnavailable"] == 1, component
        spread = chart.pod_spec(chart.workload(docs, component))["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname",
                                                       "topology.kubernetes.io/zone"}
        for constraint in spread:
            assert constraint["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] \
                == component
            assert chart.selector_matches(constraint["labelSelector"]["matchLabels"], labels)
    minimal = rendered("minimal")
    assert not chart.find(minimal, "PodDisruptionBudget")
    assert all("topologySpreadConstraints" not in chart.pod_spec(w)
               for w in chart.workloads(minimal))


def test_hpas_target_their_workloads(rendered: Rendered) -> None:
    docs = rendered("extras")
    hpas = chart.find(docs, "HorizontalPodAutoscaler")
    assert len(hpas) == 3
    for hpa in hpas:
        ref = hpa["spec"]["scaleTargetRef"]
        (target,) = chart.find(docs, ref["kind"], ref["name"])
        assert "replicas" not in target["spec"], "the HPA owns the replica count"
    kinds = {h["spec"]["scaleTargetRef"]["name"]: h["spec"]["scaleTargetRef"]["kind"] for h in hpas}
    assert kinds[f"{chart.FULLNAME}-decode"] == "StatefulSet"
    assert not chart.find(rendered("defaults"), "HorizontalPodAutoscaler")


def test_service_monitor_scrapes_every_metrics_port(rendered: Rendered) -> None:
    """ServiceMonitor is a custom resource: its fields are checked here, not by a schema."""
    docs = rendered("extras")
    (monitor,) = chart.find(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [chart.NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics"
    selected = [s for s in chart.find(docs, "Service") if chart.selector_matches(
        monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    components = sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected)
    assert components == ["decode", "prefill", "router"]
    for service in selected:
        assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    api = chart.one(docs, "Service", f"{chart.FULLNAME}-router")
    assert "metrics" not in [p["name"] for p in api["spec"]["ports"]]  # never on the LB
    for component in ("router", "prefill", "decode"):
        args = chart.main_container(chart.workload(docs, component))["args"]
        assert chart.flag_value(args, "--metrics-port") == "9090"
    assert not chart.find(rendered("defaults"), "ServiceMonitor")
    minimal_args = chart.main_container(chart.workload(rendered("minimal"), "decode"))["args"]
    assert "--metrics-port" not in minimal_args
