"""What the chart's pods run: the pdserve command lines (checked against the real CLI), the
probes, GPUs equal to the tensor-parallel size, the Redis URL, secrets (Redis password, API
key, cluster token) kept out of pod specs and command lines, non-root security contexts,
images, the model volume."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from urllib.parse import urlsplit

import pytest

from pdserve.cli import _parser
from tests.deploy import chart

Rendered = Callable[[str], list[dict]]
GPU = "nvidia.com/gpu"
GPU_CASES = [c for c in chart.CASES if c != "cpu"]

# Flags and environment the chart relies on that the pdserve command line does not have yet
# (issue 14 adds them). A flag outside this list and the CLI is a typo in the chart.
PENDING_FLAGS = {
    "router": {"--http-port"},
}


def _subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    for flag in PENDING_FLAGS.get(command, ()):
        if flag not in parser._option_string_actions:  # not there yet
            parser.add_argument(flag)
    parser.exit_on_error = False
    return parser


@pytest.mark.parametrize("case", chart.CASES)
def test_command_lines_parse_with_the_pdserve_cli(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    for component in chart.components(docs):
        container = chart.main_container(chart.workload(docs, component))
        # ENTRYPOINT pdserve, or the pool's shell, which execs pdserve (run here with sh)
        assert ("command" in container) == (component == "pool")
        command, *args = chart.pdserve_argv(container)
        assert command == chart.SUBCOMMANDS[component]
        parser = _subparser(command)
        known = {o for a in parser._actions for o in a.option_strings}
        unknown = {a for a in args if a.startswith("--")} - known
        assert not unknown, f"{case}: {component} flags pdserve does not know: {unknown}"
        try:
            parser.parse_args(args)
        except (argparse.ArgumentError, SystemExit) as exc:
            pytest.fail(f"{case}: {component} {args}: {exc}")
        assert "--redis-url" not in args  # the URL (with its password) comes from the env
        assert "PDSERVE_REDIS_URL" in chart.env_of(container)


@pytest.mark.parametrize("case", chart.CASES)
def test_workers_bind_all_and_advertise_the_pod_ip(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    namespaces = set()
    for component in chart.components(docs):
        obj = chart.workload(docs, component)
        args = chart.pdserve_argv(chart.main_container(obj))
        assert chart.flag_value(args, "--host") == "0.0.0.0"
        namespaces.add(chart.flag_value(args, "--cluster"))
        if component == "planner":  # no --grace: it resigns its lock at once on SIGTERM
            continue
        grace = float(chart.flag_value(args, "--grace"))
        assert chart.pod_spec(obj)["terminationGracePeriodSeconds"] > grace
        if component == "router":
            continue
        env = chart.env_of(chart.main_container(obj))
        assert chart.flag_value(args, "--advertise-host") == "$(POD_IP)"
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert chart.flag_value(args, "--worker-id") == "$(POD_NAME)"
        assert chart.flag_value(args, "--port") == str(chart.container_ports(obj)["grpc"])
        if component in ("decode", "pool"):  # any pool pod may become a decode worker
            assert chart.flag_value(args, "--kv-port") == str(chart.container_ports(obj)["kv"])
    assert len(namespaces) == 1, "router, workers and planner must share one Redis key namespace"


@pytest.mark.parametrize("case", chart.CASES)
def test_probes_ask_grpc_health_on_the_right_ports(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    for component in chart.worker_components(docs):
        obj = chart.workload(docs, component)
        grpc_port = chart.container_ports(obj)["grpc"]
        container = chart.main_container(obj)
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {"port": grpc_port}, (component, probe)
    router = chart.workload(docs, "router")
    container = chart.main_container(router)
    health = int(chart.flag_value(container["args"], "--health-port"))
    assert chart.container_ports(router)["health"] == health
    assert health != int(chart.flag_value(container["args"], "--port"))
    assert container["readinessProbe"]["grpc"] == {"port": health}
    assert container["livenessProbe"]["tcpSocket"] == {"port": health}
    probed = [v for k, v in container.items() if k.endswith("Probe")]
    assert all(chart.container_ports(router)["grpc"] not in p.get("grpc", {}).values()
               for p in probed), "the (maybe TLS) API port must not get plaintext probes"


@pytest.mark.parametrize("case", GPU_CASES)
def test_gpu_requests_equal_tensor_parallel_size(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    for component in chart.worker_components(docs):
        container = chart.main_container(chart.workload(docs, component))
        tp = int(chart.flag_value(container["args"], "--tensor-parallel-size"))
        assert container["resources"]["requests"][GPU] == tp, component
        assert container["resources"]["limits"][GPU] == tp, component
        assert chart.flag_value(container["args"], "--device") == "cuda"
        assert "OMP_NUM_THREADS" not in chart.env_of(container)
    for obj in chart.workloads(docs):
        if obj["metadata"]["name"].endswith(("-router", "-redis", "-planner")):
            assert GPU not in str(chart.pod_spec(obj)), obj["metadata"]["name"]


def test_decode_tp4_two_replicas(rendered: Rendered) -> None:
    docs = rendered("decode-tp4")
    decode = chart.workload(docs, "decode")
    prefill = chart.workload(docs, "prefill")
    assert decode["kind"] == "StatefulSet" and decode["spec"]["replicas"] == 2
    assert chart.main_container(decode)["resources"]["limits"][GPU] == 4
    assert prefill["spec"]["replicas"] == 3
    assert chart.main_container(prefill)["resources"]["limits"][GPU] == 2
    for obj in (decode, prefill):
        spec = chart.pod_spec(obj)
        assert spec["runtimeClassName"] == "nvidia"
        assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert "runtimeClassName" not in chart.pod_spec(chart.workload(docs, "router"))


def test_cpu_mode_has_no_gpus_and_sets_omp_threads(rendered: Rendered) -> None:
    docs = rendered("cpu")
    assert GPU not in str(docs)
    expected_threads = {"prefill": "2", "decode": "3"}  # 2500m / 1 rank, 6 CPUs / 2 ranks
    for component, threads in expected_threads.items():
        obj = chart.workload(docs, component)
        container = chart.main_container(obj)
        assert chart.env_of(container)["OMP_NUM_THREADS"]["value"] == threads
        assert "--device" not in container["args"]
        assert "tolerations" not in chart.pod_spec(obj)
        assert chart.main_container(obj)["image"].endswith("-cpu")


@pytest.mark.parametrize("case", chart.CASES)
def test_router_redis_url_points_at_the_redis_service(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    for component in chart.components(docs):
        env_list = chart.main_container(chart.workload(docs, component))["env"]
        names = [e["name"] for e in env_list]
        url = urlsplit(chart.env_of({"env": env_list})["PDSERVE_REDIS_URL"]["value"])
        assert url.password == "$(REDIS_PASSWORD)"
        # $(VAR) expands only variables defined earlier in the list
        assert names.index("REDIS_PASSWORD") < names.index("PDSERVE_REDIS_URL")
        ref = chart.env_of({"env": env_list})["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
        if case == "external-redis":
            assert (url.scheme, url.hostname, url.port, url.path, url.username) == (
                "rediss", "redis.shared.svc.cluster.local", 6380, "/2", "pdserve")
            assert ref == {"name": "shared-redis", "key": "password"}
            continue
        service = chart.one(docs, "Service", url.hostname)
        (port,) = service["spec"]["ports"]
        assert (url.scheme, url.port) == ("redis", port["port"])
        redis = chart.workload(docs, "redis")
        assert chart.selector_matches(service["spec"]["selector"],
                                      redis["spec"]["template"]["metadata"]["labels"])
        config = chart.one(docs, "ConfigMap", url.hostname)["data"]["redis.conf"]
        assert f"port {chart.container_ports(redis)[port['targetPort']]}" in config.splitlines()
        server_ref = chart.env_of(chart.main_container(redis))["REDISCLI_AUTH"]
        assert server_ref["valueFrom"]["secretKeyRef"] == ref
    if case == "external-redis":
        assert not [w for w in chart.workloads(docs) if "redis" in w["metadata"]["name"]]


SECRET_FLAGS = {"--api-key", "--requirepass", "--redis-url", "--password", "--pass", "-a",
                "--cluster-token"}
SECRET_ENV = {"REDIS_PASSWORD", "REDISCLI_AUTH", "PDSERVE_API_KEY", chart.CLUSTER_TOKEN_ENV}


def _command_lines(container: dict) -> list[str]:
    """What ``ps`` can show: the container's command and args, and its exec probes'."""
    words = list(container.get("command", [])) + list(container.get("args", []))
    for key, value in container.items():
        if key.endswith("Probe") and "exec" in value:
            words += value["exec"]["command"]
    return words


@pytest.mark.parametrize("case", chart.CASES)
def test_secrets_are_referenced_not_inlined(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    generated = chart.secret_values(docs)
    assert generated or case in ("external-redis",)  # the in-chart Redis has a password
    for doc in docs:  # a generated secret appears in its Secret only: no arg, env, annotation
        if doc["kind"] != "Secret":
            assert not any(s in text for s in generated for text in chart.strings_in(doc))
    for obj in chart.workloads(docs):
        for container in chart.containers(obj):
            words = _command_lines(container)
            assert not SECRET_FLAGS & set(words), (obj["metadata"]["name"], words)
            assert not any("--requirepass" in w or "--api-key=" in w or "--cluster-token=" in w
                           for w in words)
            for env in container.get("env", []):
                if env["name"] in SECRET_ENV:
                    assert "secretKeyRef" in env["valueFrom"], env["name"]
                if "://" in env.get("value", ""):  # a URL's password is only a $(VAR)
                    password = urlsplit(env["value"]).password
                    assert password is None or password.startswith("$("), env["name"]


def test_generated_secrets_are_random_and_long(rendered: Rendered) -> None:
    # the API key (the Redis password and the cluster token: existing Secrets)
    secrets = chart.secret_values(rendered("tls-apikey"))
    assert len(secrets) == 1 and len(secrets[0]) == 40 and secrets[0].isalnum()
    docs = rendered("defaults")
    assert {s["metadata"]["name"] for s in chart.find(docs, "Secret")} == {
        f"{chart.FULLNAME}-redis", chart.CLUSTER_TOKEN_SECRET}
    (redis_password,) = chart.secret_data(chart.one(docs, "Secret", f"{chart.FULLNAME}-redis")
                                          ).values()
    assert len(redis_password) == 32 and redis_password.isalnum()
    (token,) = chart.secret_data(chart.one(docs, "Secret", chart.CLUSTER_TOKEN_SECRET)).values()
    assert len(token) == 48 and token.isalnum() and token != redis_password


def _mounted_secret(obj: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) behind the file ``path`` of the main container."""
    for mount in chart.main_container(obj)["volumeMounts"]:
        if path.startswith(mount["mountPath"].rstrip("/") + "/"):
            volume = next(v for v in chart.pod_spec(obj)["volumes"] if v["name"] == mount["name"])
            assert mount.get("readOnly") is True
            key = path[len(mount["mountPath"].rstrip("/")) + 1:]
            assert {"key": key, "path": key} in volume["secret"]["items"]
            return volume["secret"]["secretName"], key
    raise AssertionError(f"{path} is on no volume")


def test_tls_and_api_key_come_from_mounted_secrets(rendered: Rendered) -> None:
    docs = rendered("tls-apikey")
    router = chart.workload(docs, "router")
    args = chart.main_container(router)["args"]
    assert _mounted_secret(router, chart.flag_value(args, "--tls-cert")) == ("pdserve-tls", "tls.crt")
    assert _mounted_secret(router, chart.flag_value(args, "--tls-key")) == ("pdserve-tls", "tls.key")
    name, key = _mounted_secret(router, chart.flag_value(args, "--api-key-file"))
    assert key in chart.one(docs, "Secret", name)["data"]
    assert chart.one(docs, "Service", f"{chart.FULLNAME}-router")["spec"]["type"] == "LoadBalancer"
    existing = chart.workload(rendered("extras"), "router")
    path = chart.flag_value(chart.main_container(existing)["args"], "--api-key-file")
    assert _mounted_secret(existing, path) == ("pdserve-api-key", "key")
    assert not chart.find(rendered("extras"), "Secret", "pdserve-api-key")  # the user's own
    plain = chart.main_container(chart.workload(rendered("defaults"), "router"))["args"]
    assert not {"--tls-cert", "--tls-key", "--api-key-file"} & set(plain)


@pytest.mark.parametrize("case", chart.CASES)
def test_pods_run_as_non_root(rendered: Rendered, case: str) -> None:
    for obj in chart.workloads(rendered(case)):
        spec = chart.pod_spec(obj)
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        assert spec["automountServiceAccountToken"] is False
        for container in chart.containers(obj):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and not sc.get("privileged")
            assert sc["readOnlyRootFilesystem"] is True
            assert "ALL" in sc["capabilities"]["drop"]
            assert sc.get("runAsUser", 1) > 0


@pytest.mark.parametrize("case", chart.CASES)
def test_images_are_pinned(rendered: Rendered, case: str) -> None:
    docs = rendered(case)
    for obj in chart.workloads(docs):
        for container in chart.containers(obj):
            name, _, tag = container["image"].rpartition(":")
            assert name and tag and tag != "latest", container["image"]
    redis = chart.workload(docs, "redis") if case != "external-redis" else None
    if redis is not None:
        assert chart.main_container(redis)["image"] == "redis:7.2.5-alpine"
    for component in chart.components(docs):  # torch never runs in the router or planner
        image = chart.main_container(chart.workload(docs, component))["image"]
        gpu = component in chart.WORKER_COMPONENTS and case != "cpu"
        assert image == ("pdserve:0.1.0-cuda" if gpu else "pdserve:0.1.0-cpu"), component


def _model_volume(obj: dict) -> dict:
    return next(v for v in chart.pod_spec(obj)["volumes"] if v["name"] == "model")


def test_model_sources(rendered: Rendered) -> None:
    default = rendered("defaults")
    pvc = chart.one(default, "PersistentVolumeClaim", f"{chart.FULLNAME}-model")
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for component in chart.PDSERVE_COMPONENTS:
        obj = chart.workload(default, component)
        claim = _model_volume(obj)["persistentVolumeClaim"]
        assert claim == {"claimName": pvc["metadata"]["name"], "readOnly": True}
        assert chart.flag_value(chart.main_container(obj)["args"], "--model") == "/models"
    minimal = chart.workload(rendered("minimal"), "decode")
    assert _model_volume(minimal)["persistentVolumeClaim"]["claimName"] == "llama-weights"
    assert not chart.find(rendered("minimal"), "PersistentVolumeClaim")
    extras = rendered("extras")
    router_args = chart.main_container(chart.workload(extras, "router"))["args"]
    assert chart.flag_value(router_args, "--model") == "/models/Llama-3.1-8B-Instruct"
    assert chart.flag_value(router_args, "--model-name") == "llama-3.1-8b"
    assert _model_volume(chart.workload(extras, "prefill"))["hostPath"]["path"] == "/srv/models"


def test_init_container_writes_the_model_dir(rendered: Rendered) -> None:
    for component in chart.PDSERVE_COMPONENTS:
        obj = chart.workload(rendered("cpu"), component)
        (init,) = chart.pod_spec(obj)["initContainers"]
        model_dir = chart.flag_value(chart.main_container(obj)["args"], "--model")
        assert chart.env_of(init)["PDSERVE_MODEL_DIR"]["value"] == model_dir == "/models/tiny"
        assert init["args"] == ["make-tiny-model", "$(PDSERVE_MODEL_DIR)"]
        (mount,) = [m for m in init["volumeMounts"] if m["name"] == "model"]
        assert not mount.get("readOnly") and "emptyDir" in _model_volume(obj)
