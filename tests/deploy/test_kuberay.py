"""The KubeRay manifests as operators apply them: each overlay rendered (kubectl kustomize, or
tests/deploy/kustomize.py where kubectl is absent) and checked against KubeRay's CRD schema and Kubernetes'
strict schemas; every image from the one `images:` entry; the gateway probed on /health and behind a Service
that only ready pods back; keys and tokens from Secrets, never inlined; autoscaling on, a worker group per
role offering its resources; each overlay brings the model its way."""

from __future__ import annotations

import json
import shutil
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from gateway.config import ServeConfig
from gateway.serve_settings import deployment_config
from tests.deploy.kuberay import (
    DEPLOY,
    KUBERAY,
    OVERLAYS,
    crd_schema,
    gateway_container,
    image_reference,
    pod_templates,
    raycluster_of,
    rendered,
    unknown_fields,
    walk,
)
from tests.deploy.kustomize import render_here
from worker_runtime.roles import Role

K8S_VERSION = kubernetes_validate.latest_version()
SECRET_LIKE = ("KEY", "TOKEN", "SECRET", "PASSWORD")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_its_schema(overlay: str) -> None:
    for obj in rendered(overlay):
        if obj["kind"] == "RayCluster":
            schema = crd_schema("ray.io_rayclusters.yaml", obj["apiVersion"])
            jsonschema.Draft4Validator(schema).validate(obj)
            assert unknown_fields(obj, schema) == []
            for name, template in pod_templates(obj).items():
                kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate",
                                              "metadata": {"name": name}, "template": template},
                                             K8S_VERSION, strict=True)
        else:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    kinds = sorted(o["kind"] for o in rendered(overlay))
    volumes = ["PersistentVolumeClaim"] if "pvc" in overlay else []
    assert kinds == sorted(["RayCluster", "Service", "NetworkPolicy", *volumes])


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl absent: only the renderer here runs")
@pytest.mark.parametrize("kustomization", [*OVERLAYS, "monitoring"])
def test_the_renderer_here_agrees_with_kubectl(kustomization: str) -> None:
    def by_kind(objects: Any) -> dict[str, Any]:
        return {o["kind"]: o for o in objects}

    assert by_kind(render_here(KUBERAY / kustomization)) == by_kind(rendered(kustomization))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_image_comes_from_the_one_images_entry(overlay: str) -> None:
    images = [value for path, value in walk(list(rendered(overlay))) if path.endswith(".image")]
    assert len(images) == 4 and set(images) == {image_reference()}  # head, gateway, two worker groups
    assert image_reference().startswith("registry.example.com/")  # the placeholder deploy/README names
    # The sources name only the logical image, so nothing bypasses the one place.
    for path in KUBERAY.rglob("*.yaml"):
        if path.name != "kustomization.yaml":
            sources = [v for p, v in walk(list(yaml.safe_load_all(path.read_text()))) if p.endswith(".image")]
            assert set(sources) <= {"pdserve"}, path


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_gateway_is_probed_and_the_service_routes_only_to_a_ready_one(overlay: str) -> None:
    cluster = raycluster_of(overlay)
    gateway = gateway_container(cluster)
    assert gateway["command"][:3] == ["python", "/app/deploy/supervise.py", "--"]
    [port] = [p for p in gateway["ports"] if p["containerPort"] == 8000]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert gateway[probe]["httpGet"] == {"path": "/health", "port": port["name"]}, probe
    assert gateway["startupProbe"]["periodSeconds"] * gateway["startupProbe"]["failureThreshold"] >= (
        ServeConfig.from_yaml(DEPLOY / "serve.multi-node.yaml").placement_timeout_s)  # covers placement
    # It joins the head's Ray through the socket directory they share.
    head = pod_templates(cluster)["head"]["spec"]
    mounts = {c["name"]: {m["mountPath"] for m in c["volumeMounts"]} for c in head["containers"]}
    assert "/tmp/ray" in mounts["ray-head"] & mounts["pdserve-gateway"]
    [service] = [o for o in rendered(overlay) if o["kind"] == "Service"]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"],
                                           "ray.io/node-type": "head"}
    assert not service["spec"].get("publishNotReadyAddresses")
    assert [p["targetPort"] for p in service["spec"]["ports"]] == [port["name"]]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_keys_and_tokens_come_from_secrets_never_inlined(overlay: str) -> None:
    assert all(o["kind"] != "Secret" for o in rendered(overlay))
    cluster = raycluster_of(overlay)
    for template in pod_templates(cluster).values():
        for container in template["spec"]["containers"]:
            for env in container.get("env", []):
                if any(word in env["name"] for word in SECRET_LIKE):
                    assert "value" not in env and "secretKeyRef" in env["valueFrom"], env
    names = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in gateway_container(cluster)["env"]
             if "valueFrom" in e}
    assert names["PDSERVE_API_KEY"] == {"name": "pdserve-keys", "key": "PDSERVE_API_KEY"}
    assert names["PDSERVE_ADMIN_KEY"] == {"name": "pdserve-keys", "key": "PDSERVE_ADMIN_KEY"}
    if overlay == "overlays/hf-model":  # every pod that loads the model gets the token
        for name, template in pod_templates(cluster).items():
            containers = template["spec"]["containers"]
            loaders = [c for c in containers if c["name"] != "ray-head"]
            assert all(any(e["name"] == "HF_TOKEN" for e in c["env"]) for c in loaders), name


def test_the_pvc_overlay_mounts_the_model_read_only_wherever_it_is_loaded() -> None:
    cluster = raycluster_of("overlays/pvc-model")
    [pvc] = [o for o in rendered("overlays/pvc-model") if o["kind"] == "PersistentVolumeClaim"]
    model = gateway_container(cluster)["command"][-1]
    for name, template in pod_templates(cluster).items():
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        assert volumes["models"]["persistentVolumeClaim"] == {"claimName": pvc["metadata"]["name"],
                                                              "readOnly": True}, name
        for container in template["spec"]["containers"]:
            if container["name"] != "ray-head":
                [mount] = [m for m in container["volumeMounts"] if m["name"] == "models"]
                assert mount["readOnly"] and model.startswith(mount["mountPath"] + "/"), name


def test_autoscaling_is_on_and_each_role_has_a_worker_group_offering_its_resources() -> None:
    cluster = raycluster_of(OVERLAYS[0])
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    multi_node = ServeConfig.from_yaml(DEPLOY / "serve.multi-node.yaml")
    roles = deployment_config(multi_node, "unused").role_resources
    offered = {}
    for group in cluster["spec"]["workerGroupSpecs"]:
        assert group["minReplicas"] <= group["replicas"] < group["maxReplicas"]
        # KubeRay passes the value to `ray start --resources` as is: a quoted JSON object.
        offered[group["groupName"]] = json.loads(json.loads(group["rayStartParams"]["resources"]))
        [worker] = group["template"]["spec"]["containers"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert offered == {role.value: resources for role, resources in roles.items()
                       if role in (Role.PREFILL, Role.DECODE)}


def test_the_service_monitor_scrapes_the_services_port_with_the_api_key() -> None:
    [monitor] = [o for o in rendered("monitoring") if o["kind"] == "ServiceMonitor"]
    service = yaml.safe_load((KUBERAY / "base" / "service.yaml").read_text())
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in [p["name"] for p in service["spec"]["ports"]]
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["credentials"] == {"name": "pdserve-keys", "key": "PDSERVE_API_KEY"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_no_pod_runs_as_root_and_only_the_gateway_port_is_open_from_outside(overlay: str) -> None:
    """Review (deploy hardening): every pod non-root under the runtime's seccomp profile, every container
    without privilege escalation or capabilities; a NetworkPolicy opens the cluster's pods to each other
    (Ray, UCX, NCCL ports are chosen at run time) and to others on the gateway's port only."""
    for name, template in pod_templates(raycluster_of(overlay)).items():
        pod = template["spec"]["securityContext"]
        assert pod["runAsNonRoot"] and pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for container in template["spec"]["containers"]:
            assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                    "capabilities": {"drop": ["ALL"]}}, container["name"]
    [policy] = [o for o in rendered(overlay) if o["kind"] == "NetworkPolicy"]
    own_pods = {"podSelector": {"matchLabels": {"ray.io/cluster": "pdserve"}}}
    assert policy["spec"]["podSelector"] == own_pods["podSelector"]
    assert policy["spec"]["ingress"] == [{"from": [own_pods]}, {"ports": [{"port": 8000, "protocol": "TCP"}]}]
