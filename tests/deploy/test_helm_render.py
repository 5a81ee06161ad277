"""The chart lints clean, renders for every values case, and every object it renders is a
valid object of its kind for a current Kubernetes release (strict: no unknown fields).
Settings that cannot work fail the render, naming the value. The cluster token reaches every
router and worker from a Secret, through the environment only."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from pathlib import Path

import kubernetes_validate
import pytest

from tests.deploy import chart

CUSTOM_KINDS = {"ServiceMonitor"}  # checked by their own fields in test_helm_network.py


def test_lint_strict_clean(helm: Path) -> None:
    for values_file in chart.CASES.values():
        args = ["lint", "--strict", str(chart.CHART_DIR), "--kube-version", chart.KUBE_VERSION]
        if values_file is not None:
            args += ["-f", str(chart.CI_VALUES_DIR / values_file)]
        done = chart.run_helm(helm, *args)
        assert done.returncode == 0, f"helm lint ({values_file}):\n{done.stdout}{done.stderr}"
        assert "0 chart(s) failed" in done.stdout
        assert "[WARNING]" not in done.stdout and "[ERROR]" not in done.stdout


def test_every_ci_values_file_is_a_case() -> None:
    on_disk = {p.name for p in chart.CI_VALUES_DIR.glob("*-values.yaml")}
    assert on_disk == {f for f in chart.CASES.values() if f is not None}


@pytest.mark.parametrize("case", chart.CASES)
def test_objects_valid_against_kubernetes_schemas(
        rendered: Callable[[str], list[dict]], case: str) -> None:
    docs = rendered(case)
    kinds = {d["kind"] for d in docs}
    assert {"Deployment", "StatefulSet", "Service"} <= kinds
    for doc in docs:
        if doc["kind"] in CUSTOM_KINDS:
            continue
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        try:
            kubernetes_validate.validate(doc, chart.KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{case}: {name} is not a valid {doc['apiVersion']} {doc['kind']}: "
                        f"{exc.message}")
        except kubernetes_validate.SchemaNotFoundError:
            pytest.fail(f"{case}: {name}: no schema for {doc['apiVersion']} in Kubernetes "
                        f"{chart.KUBE_VERSION} (a removed or misspelt API version?)")


@pytest.mark.parametrize("case", chart.CASES)
def test_each_case_runs_the_components_of_its_layout(
        rendered: Callable[[str], list[dict]], case: str) -> None:
    """The tests that walk ``chart.components`` see every component of the layout."""
    expected = chart.POOLED_COMPONENTS if case in chart.POOLED_CASES else chart.PDSERVE_COMPONENTS
    assert tuple(chart.components(rendered(case))) == expected


def test_the_schema_check_rejects_unknown_fields(rendered: Callable[[str], list[dict]]) -> None:
    """The validation above is strict: a misspelt probe field is an error."""
    decode = copy.deepcopy(chart.workload(rendered("defaults"), "decode"))
    probe = chart.main_container(decode)["readinessProbe"]
    probe["grpcPort"] = probe.pop("grpc")["port"]
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(decode, chart.KUBE_VERSION, strict=True)


def test_names_and_namespaces(rendered: Callable[[str], list[dict]]) -> None:
    docs = rendered("defaults")
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), "two objects of one kind share a name"
    for kind, name in names:
        assert name.startswith(chart.FULLNAME), f"{kind}/{name} lacks the release prefix"
        assert len(name) <= 63


@pytest.mark.parametrize(("sets", "message"), [
    (("router.tls.enabled=true",), "router.tls.secretName"),
    (("redis.enabled=false",), "redis.external.host"),
    (("model.source=s3",), "model.source"),
    (("model.source=hostPath",), "model.hostPath.path"),
    (("decode.tensorParallelSize=0",), "decode.tensorParallelSize"),
    (("prefill.replicas=0",), "router.localPrefill"),
    (("decode.tensorParalelSize=4",), "decode.tensorParalelSize"),  # values.schema.json
    (("router.localPrefill=sometimes",), "router.localPrefill"),
    (("gpu.enabled=yes",), "gpu.enabled"),
    (("clusterToken.enabled=yes",), "clusterToken.enabled"),
    (("clusterToken.secretKey=a/b",), "clusterToken.secretKey"),  # not a Secret key
    (("clusterToken.existingSecrets=mine",), "clusterToken.existingSecrets"),
])
def test_impossible_settings_fail_naming_the_value(
        helm: Path, sets: tuple[str, ...], message: str) -> None:
    """Refused by values.schema.json (which names '/a/b' or the misspelt key) or by the
    templates' checks (which name a.b)."""
    done = chart.run_helm(helm, *chart.template_args(None, *sets))
    assert done.returncode != 0
    parent, _, leaf = message.rpartition(".")
    by_schema = (f"'/{message.replace('.', '/')}'" in done.stderr  # a bad value
                 or f"'/{parent.replace('.', '/')}'" in done.stderr and f"'{leaf}'" in done.stderr)
    assert message in done.stderr or by_schema, done.stderr


def test_colocated_mode_may_run_without_prefill_workers(helm: Path) -> None:
    docs = chart.render(helm, None, "prefill.replicas=0", "router.localPrefill=always")
    assert chart.workload(docs, "prefill")["spec"]["replicas"] == 0
    args = chart.main_container(chart.workload(docs, "router"))["args"]
    assert chart.flag_value(args, "--local-prefill") == "always"


def test_conditional_disaggregation_is_a_value(helm: Path) -> None:
    args = chart.main_container(chart.workload(chart.render(helm, None), "router"))["args"]
    assert chart.flag_value(args, "--local-prefill-max-tokens") == "64"  # the router's
    docs = chart.render(helm, None, "router.localPrefillMaxTokens=0")
    args = chart.main_container(chart.workload(docs, "router"))["args"]
    assert chart.flag_value(args, "--local-prefill-max-tokens") == "0"


def test_notes_say_how_to_reach_the_api(helm: Path) -> None:
    """NOTES.txt (rendered by a client-side dry-run install, which needs no cluster)."""
    done = chart.run_helm(helm, "install", chart.RELEASE, str(chart.CHART_DIR), "--dry-run=client",
                          "--namespace", chart.NAMESPACE,
                          "-f", str(chart.CI_VALUES_DIR / "tls-apikey-values.yaml"))
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert f"port-forward svc/{chart.FULLNAME}-router 50051:50051 8000:8000" in notes
    assert f"{chart.FULLNAME}-router.{chart.NAMESPACE}.svc:50051" in notes
    assert f"get secret {chart.FULLNAME}-api-key" in notes  # where the API key is read
    assert "--tls-ca" in notes and "pdserve generate" in notes
    assert "the Secret pdserve-cluster-token, key cluster-token" in notes  # the user's own


# ------------------------------------------------------------------ the cluster token

TOKEN_RE = re.compile(r"[\x21-\x7e]{16,512}")  # cluster/token.py: printable ASCII, no spaces
TOKEN_CASES = [c for c in chart.CASES if c != "minimal"]  # minimal: clusterToken.enabled=false


def _token_ref(container: dict) -> dict | None:
    """The container's PDSERVE_CLUSTER_TOKEN entry (checked to be there at most once)."""
    entries = [e for e in container.get("env", []) if e["name"] == chart.CLUSTER_TOKEN_ENV]
    assert len(entries) <= 1, container["name"]
    return entries[0] if entries else None


def _expected_ref(case: str) -> tuple[str, str]:
    """(Secret, key) every pdserve container must read the token from, in ``case``."""
    if case == "tls-apikey":  # clusterToken.existingSecret and secretKey set
        return "pdserve-cluster-token", "cluster-token"
    return chart.CLUSTER_TOKEN_SECRET, "token"


def test_default_render_generates_a_valid_token(rendered: Callable[[str], list[dict]]) -> None:
    from cluster.token import parse_tokens  # the rule the router and workers apply at start

    secret = chart.one(rendered("defaults"), "Secret", chart.CLUSTER_TOKEN_SECRET)
    assert secret["type"] == "Opaque"
    assert secret["metadata"]["labels"]["app.kubernetes.io/instance"] == chart.RELEASE
    data = chart.secret_data(secret)
    assert set(data) == {"token"}
    token = data["token"]
    assert len(token) == 48 and token.isalnum() and TOKEN_RE.fullmatch(token)
    assert parse_tokens(token).tokens == (token,)


def test_each_fresh_render_generates_a_new_token(helm: Path) -> None:
    """No Secret in the cluster to look up (helm template): a random one each time."""
    tokens = {chart.secret_data(chart.one(chart.render(helm, None), "Secret",
                                          chart.CLUSTER_TOKEN_SECRET))["token"]
              for _ in range(2)}
    assert len(tokens) == 2


@pytest.mark.parametrize("case", TOKEN_CASES)
def test_every_pdserve_container_reads_the_token_from_the_secret(
        rendered: Callable[[str], list[dict]], case: str) -> None:
    docs = rendered(case)
    name, key = _expected_ref(case)
    for component in chart.components(docs):  # the planner too: it calls SetRole
        entry = _token_ref(chart.main_container(chart.workload(docs, component)))
        assert entry == {"name": chart.CLUSTER_TOKEN_ENV,
                         "valueFrom": {"secretKeyRef": {"name": name, "key": key}}}, component
    generated = chart.find(docs, "Secret", chart.CLUSTER_TOKEN_SECRET)
    if case == "tls-apikey":
        assert not generated and not chart.find(docs, "Secret", name)  # the user's own
    else:
        assert key in generated[0]["data"]
    for obj in chart.workloads(docs):  # nothing else (Redis, init containers) gets it
        for container in chart.containers(obj):
            if container is not chart.main_container(obj) or obj["metadata"]["name"].endswith(
                    "-redis"):
                assert _token_ref(container) is None, (obj["metadata"]["name"], container["name"])


@pytest.mark.parametrize("case", TOKEN_CASES)
def test_the_token_is_on_no_command_line(rendered: Callable[[str], list[dict]], case: str) -> None:
    docs = rendered(case)
    tokens = [chart.secret_data(s)["token"]
              for s in chart.find(docs, "Secret", chart.CLUSTER_TOKEN_SECRET)]
    assert tokens or case == "tls-apikey"
    for doc in docs:  # nor in any env value, annotation or ConfigMap
        if doc["kind"] != "Secret":
            assert not any(t in text for t in tokens for text in chart.strings_in(doc))
    for obj in chart.workloads(docs):
        for container in chart.containers(obj):
            words = list(container.get("command", [])) + list(container.get("args", []))
            words += [w for k, v in container.items() if k.endswith("Probe") and "exec" in v
                      for w in v["exec"]["command"]]
            assert not any("cluster-token" in w or chart.CLUSTER_TOKEN_ENV in w for w in words), (
                obj["metadata"]["name"], words)
            entry = _token_ref(container)
            assert entry is None or "value" not in entry


def test_an_existing_secret_is_referenced_not_created(helm: Path) -> None:
    docs = chart.render(helm, None, "clusterToken.existingSecret=mine", "clusterToken.secretKey=k")
    assert not [s for s in chart.find(docs, "Secret") if "cluster-token" in s["metadata"]["name"]
                or s["metadata"]["name"] == "mine"]
    for component in chart.components(docs):
        entry = _token_ref(chart.main_container(chart.workload(docs, component)))
        assert entry["valueFrom"] == {"secretKeyRef": {"name": "mine", "key": "k"}}
    generated = chart.render(helm, None, "clusterToken.secretKey=k")  # a generated one, key k
    secret = chart.one(generated, "Secret", chart.CLUSTER_TOKEN_SECRET)
    assert set(secret["data"]) == {"k"}
    entry = _token_ref(chart.main_container(chart.workload(generated, "decode")))
    assert entry["valueFrom"]["secretKeyRef"] == {"name": chart.CLUSTER_TOKEN_SECRET, "key": "k"}


@pytest.mark.parametrize("source", ["set", "minimal"])
def test_disabled_means_no_token_and_no_secret(
        helm: Path, rendered: Callable[[str], list[dict]], source: str) -> None:
    docs = (chart.render(helm, None, "clusterToken.enabled=false") if source == "set"
            else rendered("minimal"))
    assert not [s for s in chart.find(docs, "Secret") if "cluster-token" in s["metadata"]["name"]]
    assert chart.CLUSTER_TOKEN_ENV not in str(docs)
    for component in chart.components(docs):  # the rest of the environment is unchanged
        env = chart.env_of(chart.main_container(chart.workload(docs, component)))
        assert "PDSERVE_REDIS_URL" in env and "HOME" in env
