"""Backend registry: names, capabilities, automatic and forced choice."""

from __future__ import annotations

import dataclasses

import pytest

from kv_transfer import BackendName, BackendUnavailableError, UnknownBackendError, choose_backend, registry


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


def test_same_process_pairs_use_local():
    assert choose_backend(is_same_process=True).name == BackendName.LOCAL


def test_nixl_is_preferred_then_torch(monkeypatch: pytest.MonkeyPatch):
    _set_available(monkeypatch, BackendName.NIXL, True)
    _set_available(monkeypatch, BackendName.TORCH, True)
    assert choose_backend(is_same_process=False).name == BackendName.NIXL
    _set_available(monkeypatch, BackendName.NIXL, False)
    choice = choose_backend(is_same_process=False)
    assert choice.name == BackendName.TORCH and "nixl" in choice.reason
    _set_available(monkeypatch, BackendName.TORCH, False)
    with pytest.raises(BackendUnavailableError, match="no KV transfer backend"):
        choose_backend(is_same_process=False)


def test_forced_unavailable_backend_is_an_error_not_a_fallback(monkeypatch: pytest.MonkeyPatch):
    _set_available(monkeypatch, BackendName.NIXL, False)
    with pytest.raises(BackendUnavailableError, match="forced KV transfer backend nixl"):
        choose_backend(is_same_process=False, forced="nixl")
    with pytest.raises(BackendUnavailableError, match="nixl is not available"):
        registry.make_receiver("nixl", "d", None)
    with pytest.raises(BackendUnavailableError, match="one process"):
        choose_backend(is_same_process=False, forced="local")
    with pytest.raises(UnknownBackendError):
        choose_backend(is_same_process=True, forced="shm")


def test_forced_available_backend_is_used(monkeypatch: pytest.MonkeyPatch):
    _set_available(monkeypatch, BackendName.TORCH, True)
    choice = choose_backend(is_same_process=True, forced=BackendName.TORCH)
    assert choice.name == BackendName.TORCH and "forced" in choice.reason


def test_halves_expose_their_backend_capabilities():
    import torch

    from kv_transfer import make_receiver, make_sender

    sender = make_sender("local", "prefill-caps", torch.zeros(2, 1, 2, 16, 1, 8))
    receiver = make_receiver("local", "decode-caps", torch.zeros(2, 1, 2, 16, 1, 8))
    assert sender.capabilities == receiver.capabilities == registry.capabilities("local")
    sender.close()
