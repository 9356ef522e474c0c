"""Where a worker finds the model on its own node: the gateway never assumes the workers share its disk.

A path is taken to be the same directory on every node (a shared filesystem, or a copy baked into every
node's image); the default model is prepared by each node for itself where its cache lacks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSource:
    """What every worker loads, as the operator named it (not as the gateway's host resolved it)."""

    path: str | None = None  # a Hugging Face directory at this path on every node; None: the default model

    def resolve_here(self, node: str) -> str:
        """The local directory of the model on this node, preparing the default model if it is missing.

        Args:
            node: how to name this node in an error (e.g. "10.0.0.3 (node id 5f2c…)").

        Raises:
            FileNotFoundError: the path is not a model directory on this node; the message names the node.
        """
        if self.path is None:
            from llm_engine.default_model import prepare_default_model

            return str(prepare_default_model())  # converted once per node, into that node's cache
        if not (Path(self.path) / "config.json").is_file():
            raise FileNotFoundError(
                f"model directory {self.path!r} is not on node {node}: put the model on a filesystem every "
                "node mounts at the same path (or into every node's image), or serve the default model")
        return self.path
