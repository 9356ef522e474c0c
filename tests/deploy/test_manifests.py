"""deploy/ is checked, not just written: `ray-cluster.yaml` against Ray's own cluster-config schema, the
KubeRay manifests against the CRDs' OpenAPI v3 schemas (../shared/kuberay-crds/), plain Kubernetes objects
(the Service, every pod template) with kubernetes-validate; the commands they run parse with pdserve's CLI,
the serving YAML they name loads, and every node group offers the custom resource its role asks for."""

from __future__ import annotations

import gzip
import json
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import ray
import yaml

from gateway.config import ServeConfig
from pdserve.main import build_parser
from pool_worker import Role

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
SHARED_CRDS = REPO.parent / "shared" / "kuberay-crds"  # the shared copy, where it lies beside the checkout
VENDORED_CRDS = Path(__file__).parent / "kuberay_crds"  # the same files, gzipped, for any other machine
# Where the manifests find the checkout: ray up copies it to ~/pdserve, the image holds it at /app.
CHECKOUT_PREFIXES = ("~/pdserve/", "/app/")
K8S_VERSION = kubernetes_validate.latest_version()


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def multi_node_roles() -> dict[Role, dict[str, float]]:
    config = ServeConfig.from_yaml(DEPLOY / "serve.multi-node.yaml")
    return config.deployment_config("unused").role_resources


def test_serving_examples_load_and_pin_roles_to_resources() -> None:
    ServeConfig.from_yaml(DEPLOY / "serve.example.yaml")
    assert multi_node_roles() == {Role.PREFILL: {"pdserve_prefill": 1.0},
                                  Role.DECODE: {"pdserve_decode": 1.0}}


def test_ray_cluster_yaml_matches_rays_own_schema_and_offers_each_roles_resource() -> None:
    schema = json.loads((Path(ray.__file__).parent / "autoscaler" / "ray-schema.json").read_text())
    cluster = load("ray-cluster.yaml")
    jsonschema.validate(cluster, schema)
    offered = [node.get("resources", {}) for node in cluster["available_node_types"].values()]
    for role, resources in multi_node_roles().items():
        assert resources in offered, f"no node type offers the {role.value} workers' {resources}"
    head = cluster["available_node_types"][cluster["head_node_type"]]
    assert not head["resources"] and any("--num-cpus=0" in c for c in cluster["head_start_ray_commands"])


def _crd_text(name: str) -> str:
    if (SHARED_CRDS / name).is_file():
        return (SHARED_CRDS / name).read_text()
    return gzip.decompress((VENDORED_CRDS / f"{name}.gz").read_bytes()).decode()


def _crd_schema(name: str, api_version: str) -> dict[str, Any]:
    crd = yaml.safe_load(_crd_text(name))
    version = api_version.split("/")[1]
    [entry] = [v for v in crd["spec"]["versions"] if v["name"] == version and v["served"]]
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


@pytest.mark.parametrize(("manifest", "crd"), [("kuberay/raycluster.yaml", "ray.io_rayclusters.yaml"),
                                               ("kuberay/rayjob.yaml", "ray.io_rayjobs.yaml")])
def test_kuberay_manifests_match_the_crd_schemas(manifest: str, crd: str) -> None:
    resource = load(manifest)
    schema = _crd_schema(crd, resource["apiVersion"])
    jsonschema.Draft4Validator(schema).validate(resource)
    assert unknown_fields(resource, schema) == []


def _pod_templates(cluster: dict[str, Any]) -> dict[str, dict[str, Any]]:
    groups = {"head": cluster["spec"]["headGroupSpec"]}
    groups |= {g["groupName"]: g for g in cluster["spec"]["workerGroupSpecs"]}
    return {name: group["template"] for name, group in groups.items()}


def test_plain_kubernetes_objects_are_valid() -> None:
    kubernetes_validate.validate(load("kuberay/service.yaml"), K8S_VERSION, strict=True)
    for name, template in _pod_templates(load("kuberay/raycluster.yaml")).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                        "template": template}
        kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)


def test_the_raycluster_groups_offer_each_roles_resource_and_the_service_reaches_the_gateway() -> None:
    cluster = load("kuberay/raycluster.yaml")
    offered = []
    for group in cluster["spec"]["workerGroupSpecs"]:
        # KubeRay passes the value to `ray start --resources` as is: a quoted JSON object.
        offered.append(json.loads(json.loads(group["rayStartParams"]["resources"])))
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["nvidia.com/gpu"] == "1"
    for role, resources in multi_node_roles().items():
        assert resources in offered, f"no worker group offers the {role.value} workers' {resources}"
    service = load("kuberay/service.yaml")
    [head] = _pod_templates(cluster)["head"]["spec"]["containers"]
    assert service["spec"]["ports"][0]["targetPort"] in [p["containerPort"] for p in head["ports"]]
    name = cluster["metadata"]["name"]
    assert service["spec"]["selector"]["ray.io/cluster"] == name
    assert load("kuberay/rayjob.yaml")["spec"]["clusterSelector"]["ray.io/cluster"] == name


def pdserve_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `pdserve`) of every pdserve command the deployment files run."""
    found = []
    cluster = load("ray-cluster.yaml")
    for command in [*cluster["setup_commands"], *cluster["head_start_ray_commands"]]:
        found += [("ray-cluster.yaml", argv) for argv in _pdserve_in(command)]
    entrypoint = load("kuberay/rayjob.yaml")["spec"]["entrypoint"]
    found += [("rayjob.yaml", argv) for argv in _pdserve_in(entrypoint)]
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for line in dockerfile.replace("\\\n", " ").splitlines():
        if line.startswith("CMD "):
            found.append(("Dockerfile CMD", json.loads(line[4:])[1:]))
        elif line.startswith("RUN "):
            found += [("Dockerfile RUN", argv) for argv in _pdserve_in(line[4:])]
    return found


def _pdserve_in(shell: str) -> list[list[str]]:
    """The argv after each `pdserve` in a shell line, up to the next operator (&&, ;, >, &, |)."""
    lexer = shlex.shlex(shell, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    words = list(lexer)
    commands = []
    for i, word in enumerate(words):
        if word == "pdserve" or word.endswith("/bin/pdserve"):
            tail = words[i + 1:]
            ends = [j for j, w in enumerate(tail) if set(w) <= set("();<>|&")]
            commands.append(tail[:ends[0] if ends else len(tail)])
    return commands


def test_the_commands_they_run_are_pdserve_commands_with_those_flags() -> None:
    found = pdserve_commands()
    assert {where for where, _ in found} >= {"ray-cluster.yaml", "rayjob.yaml", "Dockerfile CMD",
                                             "Dockerfile RUN"}
    for where, argv in found:
        args = build_parser().parse_args(argv)  # an unknown command or flag exits here
        config_path = getattr(args, "config", None)
        if config_path:
            local = next(REPO / config_path[len(p):] for p in CHECKOUT_PREFIXES if config_path.startswith(p))
            assert local.is_file(), f"{where}: {config_path}"
            ServeConfig.from_yaml(local)
    makefile = (REPO / "Makefile").read_text()
    assert "\ninstall: $(STAMP)\n" in makefile  # what the Dockerfile and ray-cluster.yaml run
