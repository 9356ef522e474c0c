"""NIXL backend: the receiver READs the sender's blocks over UCX, then NIXL notifies the sender.

One pull:
    receiver.start_pull()  READ posted (one-sided, the sender's CPU takes no part)  -> TRANSFERRING
    receiver.poll()        transfer status DONE -> DONE; ERR -> FAILED; deadline -> FAILED (cancelled)
    sender.poll()          notification b"kvx:<transfer_id>" arrives -> blocks released PULLED
Handshake once per peer: the receiver loads the sender's agent metadata and prepares a descriptor list over
all of the peer's blocks; its own blocks are prepared once at construction. Per pull only indices are passed.
A one-sided READ cannot be refused by the sender, so a late pull is refused by the receiver instead: it never
starts (nor reports DONE) past the handle's lease deadline minus config.lease_margin_s.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, ClassVar

from kv_transfer.backends.nixl_agent import NixlAgent
from kv_transfer.enums import BackendName, ReleaseReason, TransferState
from kv_transfer.receiver import KVReceiver, Pull
from kv_transfer.sender import KVSender

if TYPE_CHECKING:
    from kv_transfer.messages import PeerInfo

_NOTIF_PREFIX = b"kvx:"


def _registered_agent(end: KVSender | KVReceiver) -> NixlAgent:
    """A NIXL agent named for the worker, with its whole KV tensor registered (once per process side)."""
    config = end.config
    agent = NixlAgent(end.worker_id, config.nixl_progress_delay_us, config.nixl_error_mode,
                      config.ucx_cma_seg_size)
    agent.register(end.layout)
    return agent


class NixlSender(KVSender):
    """Sender whose blocks are read by the receiver's NIXL agent; learns of pulls by notification."""

    backend: ClassVar[BackendName] = BackendName.NIXL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.agent = _registered_agent(self)

    def _backend_metadata(self) -> bytes:
        return self.agent.metadata()

    def _progress(self) -> list[tuple[int, ReleaseReason, str]]:
        done: list[tuple[int, ReleaseReason, str]] = []
        for messages in self.agent.notifications().values():
            for message in messages:
                if message.startswith(_NOTIF_PREFIX):
                    done.append((int(message[len(_NOTIF_PREFIX):]), ReleaseReason.PULLED, ""))
        return done

    def close(self) -> None:
        self.agent.close()


class NixlReceiver(KVReceiver):
    """Receiver that READs blocks from NixlSenders through its own NIXL agent."""

    backend: ClassVar[BackendName] = BackendName.NIXL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.agent = _registered_agent(self)
        self._local_dlist = self.agent.prep_blocks("", self.layout)
        self._remote_dlists: dict[str, int] = {}
        self._unreleased: list[int] = []  # transfer handles NIXL refused to release yet (still in flight)

    def _on_add_peer(self, peer: PeerInfo) -> None:
        agent_name = self.agent.add_remote(peer.backend_metadata)
        self._remote_dlists[peer.worker_id] = self.agent.prep_blocks(agent_name, peer.layout)

    def _start(self, pull: Pull, peer: PeerInfo) -> None:
        notif = _NOTIF_PREFIX + str(pull.handle.transfer_id).encode()
        try:
            xfer, status = self.agent.read(self._local_dlist, pull.dst_block_ids,
                                           self._remote_dlists[peer.worker_id], pull.handle.block_ids, notif)
        except Exception as exc:  # the binding raises on NIXL errors (e.g. peer gone, bad descriptors)
            pull.fail(f"NIXL READ could not be posted: {exc}")
            return
        pull.backend_state = xfer
        pull.state = TransferState.TRANSFERRING
        self._finish_if_settled(pull, status)

    def _advance(self, pull: Pull) -> None:
        self._retry_releases()
        self._finish_if_settled(pull, self.agent.status(pull.backend_state))

    def _abort(self, pull: Pull) -> bool:
        if pull.backend_state is not None and not self.agent.release(pull.backend_state):
            self._unreleased.append(pull.backend_state)
        return True

    def _finish_if_settled(self, pull: Pull, status: str) -> None:
        if status == "PROC":
            return
        if status == "DONE" and time.monotonic() <= pull.deadline:
            pull.state = TransferState.DONE
        elif status == "DONE":
            # Seen only after the cutoff: it may have finished after the sender freed the blocks.
            pull.fail("READ completed too late to be trusted: the lease was over")
        else:
            pull.fail("NIXL READ failed (peer gone or memory no longer registered)")
        self.agent.release(pull.backend_state)

    def _retry_releases(self) -> None:
        self._unreleased = [x for x in self._unreleased if not self.agent.release(x)]

    def close(self) -> None:
        self._retry_releases()
        self.agent.close()
