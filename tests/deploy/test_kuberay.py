"""The KubeRay manifests (deploy/kuberay/): valid against the KubeRay CRD schemas of
``../shared/schemas/kuberay/`` (plus the check the API server's pruning would make: no
field the schema does not know), their pod templates valid Kubernetes, and the RayJob
running ``pdserve up --ray`` with a layout that fits the cluster's GPUs."""

from __future__ import annotations

import argparse
import copy
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from pdserve.cli import _parser
from tests.deploy.chart import KUBE_VERSION, REPO_ROOT

KUBERAY_DIR = REPO_ROOT / "deploy" / "kuberay"
SCHEMA_DIR = REPO_ROOT.parent / "shared" / "schemas" / "kuberay"
SCHEMA_FILES = {"RayCluster": "raycluster-ray.io-v1.json", "RayJob": "rayjob-ray.io-v1.json"}
GPU = "nvidia.com/gpu"


def _manifests() -> dict[str, dict]:
    docs = [d for path in sorted(KUBERAY_DIR.glob("*.yaml"))
            for d in yaml.safe_load_all(path.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict]:
    return _manifests()


@pytest.fixture(scope="module")
def schemas() -> dict[str, dict]:
    if not SCHEMA_DIR.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found: looked in {SCHEMA_DIR} "
                    "(the shared/ folder beside the repository)")
    return {kind: json.loads((SCHEMA_DIR / name).read_text())
            for kind, name in SCHEMA_FILES.items()}


def unknown_fields(obj: Any, schema: dict, path: str = "") -> list[str]:
    """Fields of ``obj`` its structural schema does not define (the API server would prune
    them silently; ``jsonschema`` alone lets them through, CRD schemas not being closed)."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    if isinstance(obj, list) and "items" in schema:
        return [f for i, item in enumerate(obj)
                for f in unknown_fields(item, schema["items"], f"{path}[{i}]")]
    if not isinstance(obj, dict):
        return []
    properties, extra = schema.get("properties"), schema.get("additionalProperties")
    found = []
    for key, value in obj.items():
        if properties is not None and key in properties:
            found += unknown_fields(value, properties[key], f"{path}.{key}")
        elif isinstance(extra, dict):
            found += unknown_fields(value, extra, f"{path}.{key}")
        elif properties is not None and extra is None:
            found.append(f"{path}.{key}")
    return found


def _validate(obj: dict, schema: dict) -> None:
    jsonschema.Draft7Validator(schema).validate(obj)
    assert not unknown_fields(obj, schema), f"{obj['kind']}: unknown fields"


def test_manifests_valid_against_the_crd_schemas(
        manifests: dict[str, dict], schemas: dict[str, dict]) -> None:
    for kind in SCHEMA_FILES:
        assert manifests[kind]["apiVersion"] == "ray.io/v1"
        _validate(manifests[kind], schemas[kind])


def test_the_schema_check_catches_a_misspelt_field(
        manifests: dict[str, dict], schemas: dict[str, dict]) -> None:
    cluster = copy.deepcopy(manifests["RayCluster"])
    cluster["spec"]["workerGroupSpecs"][0]["replica"] = 2
    assert unknown_fields(cluster, schemas["RayCluster"]) == [".spec.workerGroupSpecs[0].replica"]
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "two"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(schemas["RayCluster"]).validate(cluster)


def _pod_templates(manifests: dict[str, dict]) -> dict[str, dict]:
    spec = manifests["RayCluster"]["spec"]
    templates = {"head": spec["headGroupSpec"]["template"]}
    templates |= {g["groupName"]: g["template"] for g in spec["workerGroupSpecs"]}
    templates["submitter"] = manifests["RayJob"]["spec"]["submitterPodTemplate"]
    return templates


def test_pod_templates_and_plain_objects_are_valid_kubernetes(manifests: dict[str, dict]) -> None:
    for name, template in _pod_templates(manifests).items():
        wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                   "template": template}
        kubernetes_validate.validate(wrapped, KUBE_VERSION, strict=True)
    for kind, obj in manifests.items():
        if kind not in SCHEMA_FILES:
            kubernetes_validate.validate(obj, KUBE_VERSION, strict=True)
    assert "PersistentVolumeClaim" in manifests


def _up_args(manifests: dict[str, dict]) -> argparse.Namespace:
    words = shlex.split(manifests["RayJob"]["spec"]["entrypoint"])
    assert words[:3] == ["pdserve", "up", "--ray"]
    sub = next(a for a in _parser()._actions if isinstance(a, argparse._SubParsersAction))
    up = sub.choices["up"]
    up.exit_on_error = False
    known = {o for a in up._actions for o in a.option_strings}
    assert not {w for w in words if w.startswith("--")} - known
    return up.parse_args(words[2:])


def test_rayjob_runs_pdserve_up_on_the_raycluster(manifests: dict[str, dict]) -> None:
    job, cluster = manifests["RayJob"]["spec"], manifests["RayCluster"]
    assert job["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert not job.get("shutdownAfterJobFinishes")  # never delete the shared cluster
    assert "activeDeadlineSeconds" not in job  # it serves until stopped
    args = _up_args(manifests)
    assert (args.ray, args.ray_address, args.host, args.port) == (True, "auto", "0.0.0.0", 50051)
    assert args.device == "cuda" and args.ray_gpu_resource is None  # each rank: one Ray GPU
    for name, template in _pod_templates(manifests).items():
        if name == "submitter":
            continue
        (container,) = template["spec"]["containers"]
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert Path(args.model).parent.as_posix() in mounts, f"{name}: {args.model} unmounted"
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert {"name": "pdserve-grpc", "containerPort": args.port} in head["ports"]
    env = {e["name"]: e for e in head["env"]}
    assert "secretKeyRef" in env["PDSERVE_API_KEY"]["valueFrom"]


def test_the_layout_fits_the_gpu_workers(manifests: dict[str, dict]) -> None:
    args = _up_args(manifests)
    spec = manifests["RayCluster"]["spec"]
    (group,) = spec["workerGroupSpecs"]
    (container,) = group["template"]["spec"]["containers"]
    gpus_per_pod = container["resources"]["limits"][GPU]
    assert container["resources"]["requests"][GPU] == gpus_per_pod
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    # a tensor-parallel group lives within one pod; all groups fit the worker pods
    assert max(args.prefill_tp, args.decode_tp) <= gpus_per_pod
    needed = args.prefill * args.prefill_tp + args.decode * args.decode_tp
    assert needed <= group["replicas"] * gpus_per_pod
    head = spec["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    assert GPU not in str(head["template"]["spec"]["containers"][0]["resources"])


def test_images_ray_version_and_security(manifests: dict[str, dict]) -> None:
    cluster = manifests["RayCluster"]["spec"]
    images = set()
    for template in _pod_templates(manifests).values():
        spec = template["spec"]
        assert spec["securityContext"]["runAsNonRoot"] is True
        assert spec["securityContext"]["runAsUser"] > 0
        for container in spec["containers"]:
            images.add(container["image"])
            assert container["securityContext"]["allowPrivilegeEscalation"] is False
            assert "ALL" in container["securityContext"]["capabilities"]["drop"]
    (image,) = images
    assert image.endswith("-ray") and ":" in image
    # the image is built with the Ray version the cluster declares (docs/operations/deployment.md)
    build_arg = f"--build-arg RAY_VERSION={cluster['rayVersion']}"
    assert build_arg in (REPO_ROOT / "docs" / "operations" / "deployment.md").read_text()
    assert build_arg in (REPO_ROOT / "deploy" / "docker" / "Dockerfile.cuda").read_text()


def test_only_the_ray_pods_the_submitter_and_the_operator_reach_ray(
        manifests: dict[str, dict]) -> None:
    """Ray's dashboard is its Jobs API, unauthenticated: another pod reaching it (or the
    GCS, or the Ray client port) could run code on the cluster. The pdserve API stays open."""
    from tests.deploy.netpol import Pod, ingress_allowed

    policies = [manifests["NetworkPolicy"]]
    labels = {"app.kubernetes.io/name": "pdserve"}
    head = Pod({**labels, "app.kubernetes.io/component": "ray-head"}, "pdserve")
    gpu = Pod({**labels, "app.kubernetes.io/component": "ray-gpu-worker"}, "pdserve")
    submitter_labels = manifests["RayJob"]["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    submitter = Pod(submitter_labels, "pdserve")
    operator = Pod({"app.kubernetes.io/name": "kuberay-operator"}, "kuberay-system")
    stranger = Pod({"app": "something-else"}, "pdserve")
    for port in (6379, 8265, 10001):
        assert not ingress_allowed(policies, head, stranger, port), port
        assert ingress_allowed(policies, head, gpu, port), port
    assert ingress_allowed(policies, gpu, head, 12345)  # the workers' own ports
    assert not ingress_allowed(policies, gpu, stranger, 12345)
    assert ingress_allowed(policies, head, submitter, 8265)
    assert not ingress_allowed(policies, head, submitter, 6379)
    assert ingress_allowed(policies, head, operator, 8265)
    for port in (50051, 8000):  # the pdserve API, as the RayJob's --port and the HTTP one
        assert ingress_allowed(policies, head, stranger, port)
    assert "--port 50051" in manifests["RayJob"]["spec"]["entrypoint"]
