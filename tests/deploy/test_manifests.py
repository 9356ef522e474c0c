"""deploy/ is checked, not just written: `ray-cluster.yaml` against Ray's own cluster-config schema (its image
the one the kustomize base names, the gateway under the supervisor), plain Kubernetes objects with
kubernetes-validate; every pdserve command the files run (ray up, both KubeRay overlays, the Dockerfile)
parses with pdserve's CLI and the serving YAML it names loads; the Dockerfile installs the Makefile's runtime
set on Ray's image of the Ray pdserve runs. The KubeRay manifests themselves: test_kuberay.py."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import ray
import yaml

from gateway.config import ServeConfig
from gateway.serve_settings import deployment_config
from pdserve.main import build_parser
from tests.deploy.kuberay import DEPLOY, OVERLAYS, REPO, gateway_container, image_reference, raycluster_of
from worker_runtime.roles import Role

# Where the manifests find the checkout: ray up copies it to ~/pdserve, the image holds it at /app.
CHECKOUT_PREFIXES = ("~/pdserve/", "/app/")
K8S_VERSION = kubernetes_validate.latest_version()


def load(name: str) -> Any:
    return yaml.safe_load((DEPLOY / name).read_text())


def multi_node_roles() -> dict[Role, dict[str, float]]:
    config = ServeConfig.from_yaml(DEPLOY / "serve.multi-node.yaml")
    return deployment_config(config, "unused").role_resources


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


def test_the_ray_up_cluster_runs_pdserves_image_and_supervises_the_gateway() -> None:
    cluster = load("ray-cluster.yaml")
    assert cluster["docker"]["image"] == image_reference()  # the one place: kustomize's images:
    for node_type in cluster["available_node_types"].values():  # no fall-back to Ray's old default AMI
        assert node_type["node_config"]["ImageId"].startswith("resolve:ssm:/aws/service/deeplearning/")
    [gateway] = [c for c in cluster["head_start_ray_commands"] if "pdserve" in c]
    assert "deploy/supervise.py --health-url http://127.0.0.1:8000/health -- pdserve serve" in gateway
    assert "make install" not in json.dumps(cluster)  # nothing installed on the nodes: the image has it all


def test_plain_kubernetes_objects_are_valid() -> None:
    kubernetes_validate.validate(load("kuberay/base/service.yaml"), K8S_VERSION, strict=True)
    kubernetes_validate.validate(load("kuberay/overlays/pvc-model/pvc.yaml"), K8S_VERSION, strict=True)


def pdserve_commands() -> list[tuple[str, list[str]]]:
    """(where, argv after `pdserve`) of every pdserve command the deployment files run."""
    found = []
    cluster = load("ray-cluster.yaml")
    for command in [*cluster["head_setup_commands"], *cluster["head_start_ray_commands"]]:
        found += [("ray-cluster.yaml", argv) for argv in _pdserve_in(command)]
    for overlay in OVERLAYS:
        gateway = gateway_container(raycluster_of(overlay))
        found += [(f"{overlay} gateway", argv) for argv in _pdserve_in(shlex.join(gateway["command"]))]
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
    assert {where for where, _ in found} >= {"ray-cluster.yaml", "Dockerfile CMD", "Dockerfile RUN",
                                             *(f"{o} gateway" for o in OVERLAYS)}
    for where, argv in found:
        args = build_parser().parse_args(argv)  # an unknown command or flag exits here
        config_path = getattr(args, "config", None)
        if config_path:
            local = next(REPO / config_path[len(p):] for p in CHECKOUT_PREFIXES if config_path.startswith(p))
            assert local.is_file(), f"{where}: {config_path}"
            ServeConfig.from_yaml(local)
    models = [argv[argv.index("--model") + 1] for _, argv in found if "--model" in argv]
    assert sorted(models) == ["/models/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"]  # one per overlay


def _dockerfile_arg(name: str) -> str:
    [value] = re.findall(rf"^ARG {name}=(\S+)$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)
    return value


def test_the_image_is_rays_own_of_the_pinned_ray_with_the_makefiles_runtime_set() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "FROM rayproject/ray:${RAY_VERSION}-py311-${VARIANT}" in dockerfile
    assert _dockerfile_arg("RAY_VERSION") == ray.__version__  # the Ray pdserve is tested with
    assert load("kuberay/base/raycluster.yaml")["spec"]["rayVersion"] == ray.__version__
    # The runtime set of `make install`: the same torch pin by default, the same --no-deps pins, no [dev].
    makefile = (REPO / "Makefile").read_text()
    install = makefile[makefile.index("define install_set"):makefile.index("endef")]
    assert f"TORCH_SPEC ?= {_dockerfile_arg('TORCH_SPEC')}" in makefile
    [pins] = re.findall(r"--no-deps ((?:\S+==\S+ ?)+)$", install, re.MULTILINE)
    assert len(pins.split()) == 2 and f"--no-deps {pins}" in dockerfile, pins
    assert "[dev]" not in dockerfile and "USER ray" in dockerfile
    assert dockerfile.index("COPY --chown=ray:users pyproject.toml") < dockerfile.index(
        "pip install --quiet -c /tmp/constraints.txt -r") < dockerfile.index("COPY --chown=ray:users . /app")
