"""Where a worker finds the model on its own node: the gateway never assumes the workers share its disk.

A path is taken to be the same directory on every node (a shared filesystem, or a copy baked into every
node's image). A Hugging Face model id is resolved by each node itself, through its own Hugging Face cache
(downloaded there on first use unless HF_HUB_OFFLINE; llm_engine/model_files.py), at the one commit the
gateway resolved it to: a node started days later loads the same weights, config and tokenizer as its
peers and the gateway, not whatever the branch holds then. The default model is
prepared by each node for itself where its cache lacks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from llm_engine.model_files import ModelNotFoundError, is_local_path, resolve_model


@dataclass(frozen=True)
class ModelSource:
    """What every worker loads, as the operator named it (not as the gateway's host resolved it)."""

    path: str | None = None  # a Hugging Face directory at this path on every node
    hub_id: str | None = None  # else a Hugging Face model id; neither: the default model
    revision: str | None = None  # of hub_id: branch, tag or commit (None: its default branch)

    @classmethod
    def named(cls, model: str | None, revision: str | None = None, resolved_dir: str | None = None
              ) -> ModelSource:
        """The source of a --model value: a path where it names one on this (the gateway's) disk, made
        absolute (a worker's working directory is not ours), else a hub id, pinned to the commit the
        gateway resolved it to (`resolved_dir`, a Hugging Face cache snapshot) when `revision` names a
        branch or nothing."""
        if model is None:
            return cls()
        if is_local_path(model):
            return cls(path=str(Path(model).expanduser().absolute()))
        commit = snapshot_commit(resolved_dir) if resolved_dir is not None else None
        return cls(hub_id=model, revision=commit or revision)

    def resolve_here(self, node: str) -> str:
        """The local directory of the model on this node, preparing or downloading it if it is missing.

        Args:
            node: how to name this node in an error (e.g. "10.0.0.3 (node id 5f2c…)").

        Raises:
            FileNotFoundError: the model cannot be found or fetched on this node; the message names the node.
        """
        if self.hub_id is not None:
            try:
                return str(resolve_model(self.hub_id, self.revision, weights=True))
            except ModelNotFoundError as error:
                raise ModelNotFoundError(f"on node {node}: {error}") from None
        if self.path is None:
            from llm_engine.default_model import prepare_default_model

            return str(prepare_default_model())  # converted once per node, into that node's cache
        if not (Path(self.path) / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {self.path!r} is not on node {node}: put the model on a filesystem every "
                "node mounts at the same path (or into every node's image), serve a Hugging Face model id "
                "(each node fetches it), or serve the default model")
        return self.path


def snapshot_commit(model_dir: str) -> str | None:
    """The commit of a Hugging Face cache snapshot directory (…/models--org--name/snapshots/<sha>), else
    None."""
    path = Path(model_dir)
    name = path.name
    if path.parent.name == "snapshots" and len(name) == 40 and all(c in "0123456789abcdef" for c in name):
        return name
    return None
