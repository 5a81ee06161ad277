"""Rendering the Helm chart and walking what it renders (shared by the chart tests)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
CHART_DIR = REPO_ROOT / "deploy" / "helm" / "pdserve"
CI_VALUES_DIR = CHART_DIR / "ci"
RELEASE = "pd"
NAMESPACE = "serving"
FULLNAME = f"{RELEASE}-pdserve"
KUBE_VERSION = "1.35.0"  # rendered for, and validated against, this Kubernetes release
HELM_TIMEOUT_S = 60

# The rendering cases: name → values file under ci/ (None: the chart's defaults).
CASES: dict[str, str | None] = {
    "defaults": None,
    "external-redis": "external-redis-values.yaml",
    "decode-tp4": "decode-tp4-values.yaml",
    "cpu": "cpu-values.yaml",
    "tls-apikey": "tls-apikey-values.yaml",
    "extras": "extras-values.yaml",
    "minimal": "minimal-values.yaml",
    "pooled": "pooled-values.yaml",
}
POOLED_CASES = ("pooled",)  # workers.layout=pooled; the others are split

WORKLOAD_KINDS = ("Deployment", "StatefulSet")
# The workloads that run pdserve, per layout (split: roles pinned; pooled: roles switched live)
PDSERVE_COMPONENTS = ("router", "prefill", "decode")
POOLED_COMPONENTS = ("router", "pool", "planner")
WORKER_COMPONENTS = ("prefill", "decode", "pool")
# the pdserve subcommand each component runs
SUBCOMMANDS = {"router": "router", "prefill": "prefill", "decode": "decode", "pool": "worker",
               "planner": "planner"}
CLUSTER_TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
CLUSTER_TOKEN_SECRET = f"{FULLNAME}-cluster-token"  # the Secret the chart generates


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm), *args], capture_output=True, text=True,
                          timeout=HELM_TIMEOUT_S)


def template_args(values_file: str | None, *sets: str) -> list[str]:
    args = ["template", RELEASE, str(CHART_DIR), "--namespace", NAMESPACE,
            "--kube-version", KUBE_VERSION]
    if values_file is not None:
        args += ["-f", str(CI_VALUES_DIR / values_file)]
    for item in sets:
        args += ["--set", item]
    return args


def render(helm: Path, values_file: str | None, *sets: str) -> list[dict[str, Any]]:
    """The objects ``helm template`` renders (empty documents dropped); raises on failure."""
    done = run_helm(helm, *template_args(values_file, *sets))
    if done.returncode != 0:
        raise AssertionError(f"helm template failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


# ------------------------------------------------------------------ walking the objects

def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind
            and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def workload(docs: list[dict], component: str) -> dict:
    """The Deployment or StatefulSet of a component (router, prefill, decode, redis)."""
    found = [d for d in workloads(docs)
             if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component")
             == component]
    assert len(found) == 1, f"expected one workload of {component}, found {len(found)}"
    return found[0]


def components(docs: list[dict]) -> list[str]:
    """The components of the workloads that run pdserve (all but Redis), in the order of
    ``SUBCOMMANDS``."""
    found = {w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
             for w in workloads(docs)} - {"redis"}
    assert found <= set(SUBCOMMANDS), found
    return [c for c in SUBCOMMANDS if c in found]


def worker_components(docs: list[dict]) -> list[str]:
    return [c for c in components(docs) if c in WORKER_COMPONENTS]


def pod_spec(obj: dict) -> dict:
    return obj["spec"]["template"]["spec"]


def containers(obj: dict, *, init: bool = True) -> list[dict]:
    spec = pod_spec(obj)
    return list(spec.get("initContainers", []) if init else []) + list(spec["containers"])


def main_container(obj: dict) -> dict:
    (first, *_) = pod_spec(obj)["containers"]
    return first


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env", [])}


def container_ports(obj: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for c in containers(obj, init=False)
            for p in c.get("ports", []) if "name" in p}


def run_entrypoint(container: dict, pod_name: str,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Runs a container's shell ``command`` + ``args`` as the kubelet would start it, with
    ``POD_NAME=pod_name``, the container's literal env values (then ``env``), and a
    stand-in ``pdserve`` first on PATH that prints its arguments as a JSON list."""
    values = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    with tempfile.TemporaryDirectory() as bin_dir:
        stub = os.path.join(bin_dir, "pdserve")
        with open(stub, "w") as out:
            out.write(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n")
        os.chmod(stub, 0o755)
        return subprocess.run(
            [*container["command"], *container["args"]], capture_output=True, text=True,
            timeout=HELM_TIMEOUT_S,
            env={**values, "POD_NAME": pod_name, **(env or {}), "PATH": f"{bin_dir}:/usr/bin:/bin"})


def pdserve_argv(container: dict, pod_name: str = f"{FULLNAME}-pool-0") -> list[str]:
    """The ``pdserve`` command line a container runs (after the word ``pdserve``): its args
    under the image's ``ENTRYPOINT ["pdserve"]``, or, for a shell ``command``, what that shell
    execs when started in the pod ``pod_name`` (``run_entrypoint``)."""
    if "command" not in container:
        return list(container["args"])
    done = run_entrypoint(container, pod_name)
    assert done.returncode == 0, done.stderr
    argv = json.loads(done.stdout)
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv)
    return argv


def flag_value(args: list[str], flag: str) -> str | None:
    """The value after ``flag`` in an argument list, None when the flag is absent."""
    return args[args.index(flag) + 1] if flag in args else None


def selector_matches(match_labels: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in match_labels.items())


def secret_data(secret: dict) -> dict[str, str]:
    """The keys and decoded values of one Secret."""
    data = {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}
    return {**data, **secret.get("stringData", {})}


def secret_values(docs: list[dict]) -> list[str]:
    """Every value of every Secret the chart renders, decoded."""
    values = []
    for secret in find(docs, "Secret"):
        values += [base64.b64decode(v).decode() for v in secret.get("data", {}).values()]
        values += list(secret.get("stringData", {}).values())
    return values


def strings_in(obj: Any) -> Iterator[str]:
    """Every string anywhere inside a YAML value."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from strings_in(value)
    elif isinstance(obj, list):
        for value in obj:
            yield from strings_in(value)
