"""Render a kustomization as `kubectl kustomize DIR` does, for the parts deploy/kuberay uses: `resources:`
(files and other kustomizations), `images:` (every `containers` / `initContainers` entry's image, at any
depth, as kustomize's image transformer does) and `patches:` with JSON 6902 operations (add, replace,
remove; `-` appends). Used where kubectl is absent; where it is present, a test checks both agree.
"""

from __future__ import annotations

import copy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import yaml


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects the kustomization in `directory` produces; kubectl's when it is on PATH."""
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "kustomize", str(directory)], check=True, capture_output=True,
                             text=True).stdout
        return [doc for doc in yaml.safe_load_all(out) if doc]
    return render_here(directory)


def render_here(directory: Path) -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict[str, Any]] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        if path.is_dir():
            objects += render_here(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        for obj in objects:
            if obj["kind"] == target["kind"] and obj["metadata"]["name"] == target["name"]:
                for operation in yaml.safe_load(patch["patch"]):
                    _apply(obj, operation)
    for image in kustomization.get("images", []):
        for obj in objects:
            _set_image(obj, image)
    return objects


def _apply(obj: dict[str, Any], operation: dict[str, Any]) -> None:
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in operation["path"].split("/")[1:]]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(operation.get("value"))
    if operation["op"] == "remove":
        del node[int(last) if isinstance(node, list) else last]
    elif isinstance(node, list):
        if last == "-":
            node.append(value)
        elif operation["op"] == "add":
            node.insert(int(last), value)
        else:
            node[int(last)] = value
    else:
        node[last] = value


def _set_image(node: Any, image: dict[str, str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    name, _, tag = container.get("image", "").partition(":")
                    if name == image["name"]:
                        container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
            else:
                _set_image(value, image)
    elif isinstance(node, list):
        for item in node:
            _set_image(item, image)
