"""What the KubeRay tests read: the kustomize overlays rendered (tests/deploy/kustomize.py), the RayCluster
and its gateway container in them, the one image reference, KubeRay's CRD schemas (../shared/kuberay-crds/, or
the gzipped copies vendored beside this file)."""

from __future__ import annotations

import functools
import gzip
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.kustomize import render

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
KUBERAY = DEPLOY / "kuberay"
SHARED_CRDS = REPO.parent / "shared" / "kuberay-crds"  # the shared copy, where it lies beside the checkout
VENDORED_CRDS = Path(__file__).parent / "kuberay_crds"  # the same files, gzipped, for any other machine
# What operators apply: one overlay per way of bringing the model.
OVERLAYS = ("overlays/hf-model", "overlays/pvc-model")
GATEWAY = "pdserve-gateway"


@functools.cache
def rendered(kustomization: str) -> tuple[dict[str, Any], ...]:
    return tuple(render(KUBERAY / kustomization))


def raycluster_of(kustomization: str) -> dict[str, Any]:
    [cluster] = [o for o in rendered(kustomization) if o["kind"] == "RayCluster"]
    return cluster


def gateway_container(cluster: dict[str, Any]) -> dict[str, Any]:
    [gateway] = [c for c in cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
                 if c["name"] == GATEWAY]
    return gateway


def pod_templates(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    groups = {"head": cluster["spec"]["headGroupSpec"]}
    groups |= {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    return {name: group["template"] for name, group in groups.items()}


def image_reference() -> str:
    """The image every manifest runs, from the one place that names it (the base's `images:`)."""
    [image] = yaml.safe_load((KUBERAY / "base" / "kustomization.yaml").read_text())["images"]
    return f"{image['newName']}:{image['newTag']}"


def crd_schema(name: str, api_version: str) -> dict[str, Any]:
    if (SHARED_CRDS / name).is_file():
        text = (SHARED_CRDS / name).read_text()
    else:
        text = gzip.decompress((VENDORED_CRDS / f"{name}.gz").read_bytes()).decode()
    version = api_version.split("/")[1]
    [entry] = [v for v in yaml.safe_load(text)["spec"]["versions"] if v["name"] == version and v["served"]]
    return entry["schema"]["openAPIV3Schema"]


def unknown_fields(instance: Any, schema: dict[str, Any], at: str = "") -> list[str]:
    """Fields the schema does not define: Kubernetes would drop them silently, so a typo would vanish."""
    found = []
    if isinstance(instance, dict) and "properties" in schema and not schema.get(
            "x-kubernetes-preserve-unknown-fields"):
        for key, value in instance.items():
            if key not in schema["properties"]:
                found.append(f"{at}.{key}")
            else:
                found += unknown_fields(value, schema["properties"][key], f"{at}.{key}")
    elif isinstance(instance, dict) and isinstance(schema.get("additionalProperties"), dict):
        for key, value in instance.items():
            found += unknown_fields(value, schema["additionalProperties"], f"{at}.{key}")
    elif isinstance(instance, list) and "items" in schema:
        for i, item in enumerate(instance):
            found += unknown_fields(item, schema["items"], f"{at}[{i}]")
    return found


def walk(node: Any, at: str = "") -> list[tuple[str, Any]]:
    """Every (path, value) under `node`, dicts and lists included."""
    found = [(at, node)]
    if isinstance(node, dict):
        for key, value in node.items():
            found += walk(value, f"{at}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            found += walk(value, f"{at}[{i}]")
    return found
