"""A local Ray instance for the pool tests (started once per session, about 3 s)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    import ray

    # Worker processes inherit this environment: UCX stays on loopback, tokenizers stay single-threaded.
    os.environ["UCX_NET_DEVICES"] = "lo"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()
