"""The chart lints clean, renders for every values case, and every object it renders is a
valid object of its kind for a current Kubernetes release (strict: no unknown fields).
Settings that cannot work fail the render, naming the value."""

from __future__ import annotations

import copy
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
