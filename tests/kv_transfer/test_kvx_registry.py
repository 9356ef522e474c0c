"""Backend registry: names, capabilities, availability; the deployment's automatic choice from it."""

from __future__ import annotations

import dataclasses

import pytest

from kv_transfer import BackendName, BackendUnavailableError, UnknownBackendError, registry


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownBackendError, match="'rdma'; known: local, nixl, torch"):
        registry.resolve("rdma")
    with pytest.raises(UnknownBackendError, match="known: local, nixl, torch"):
        registry.make_sender("rdma", "p", None)


def test_capabilities_are_declared_per_backend():
    assert registry.capabilities("torch").sender_takes_part
    assert registry.capabilities("torch").needs_peer_bound_up_front
    assert not registry.capabilities("nixl").sender_takes_part
    assert not registry.capabilities(BackendName.LOCAL).crosses_processes


def _set_available(monkeypatch: pytest.MonkeyPatch, name: BackendName, is_available: bool) -> None:
    spec = dataclasses.replace(registry.BACKENDS[name], is_available=lambda: is_available)
    monkeypatch.setitem(registry.BACKENDS, name, spec)


def test_a_backend_that_cannot_run_here_is_an_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch):
    _set_available(monkeypatch, BackendName.NIXL, False)
    with pytest.raises(BackendUnavailableError, match="nixl is not available"):
        registry.make_receiver("nixl", "d", None)


def test_the_deployment_prefers_nixl_then_torch_and_needs_none_for_mixed_workers(
        monkeypatch: pytest.MonkeyPatch):
    """The automatic choice the product makes (gateway/fleet/config.py), from the registry's availability."""
    from gateway.fleet.config import DeploymentConfig
    from llm_engine import EngineConfig

    _set_available(monkeypatch, BackendName.NIXL, True)
    assert DeploymentConfig(EngineConfig("m")).resolve_backend() is BackendName.NIXL
    _set_available(monkeypatch, BackendName.NIXL, False)
    assert DeploymentConfig(EngineConfig("m")).resolve_backend() is BackendName.TORCH
    all_mixed = DeploymentConfig(EngineConfig("m"), num_prefill=0, num_decode=0, num_mixed=2)
    assert all_mixed.resolve_backend() is BackendName.LOCAL
    with pytest.raises(UnknownBackendError, match="known: local, nixl, torch"):
        DeploymentConfig(EngineConfig("m"), backend="shm").resolve_backend()


def test_halves_expose_their_backend_capabilities():
    import torch

    from kv_transfer import make_receiver, make_sender

    sender = make_sender("local", "prefill-caps", torch.zeros(2, 1, 2, 16, 1, 8))
    receiver = make_receiver("local", "decode-caps", torch.zeros(2, 1, 2, 16, 1, 8))
    assert sender.capabilities == receiver.capabilities == registry.capabilities("local")
    sender.close()
