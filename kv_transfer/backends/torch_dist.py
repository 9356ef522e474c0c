"""torch.distributed backend (gloo on CPU, NCCL on GPU): point-to-point isend/irecv between two ranks.

The sender takes part, so each pull is a round trip delivered by the caller (e.g. a Ray actor call):
    receiver.start_pull()          -> PENDING, queues a PullRequest (take_pull_requests())
    sender.accept_pull(request)    lease claimed, blocks gathered into a staging buffer, isend posted;
                                   returns a PullReply (refused if the lease is over or the id unknown)
    receiver.on_pull_reply(reply)  accepted: irecv into a staging buffer -> TRANSFERRING; refused -> FAILED
    receiver.poll()                irecv complete -> staging scattered into the destination blocks -> DONE
    sender.poll()                  isend complete -> PULLED (timed out -> FAILED)
The staging buffers keep the destination blocks untouched until every byte has arrived, and let the source
blocks be freed even if a send leg never completes. The peer set is the process group, fixed up front.
NCCL ignores tags and matches p2p operations in posting order: deliver the replies of one sender in the order
it produced them.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from kv_transfer import wire
from kv_transfer.enums import BackendName, ReleaseReason, TransferState
from kv_transfer.messages import PullReply, PullRequest
from kv_transfer.receiver import KVReceiver, Pull
from kv_transfer.sender import KVSender

if TYPE_CHECKING:
    from kv_transfer.messages import PeerInfo


@dataclass(frozen=True)
class TorchPeerMetadata:
    """PeerInfo.backend_metadata of the torch backend."""

    rank: int  # global torch.distributed rank of the worker


class _Completion:
    """Pollable completion of one isend/irecv.

    Gloo's p2p works never turn is_completed() true, and a wait() with a timeout breaks the connection,
    so on CPU a daemon thread blocks in wait() (asleep, off the CPU) and sets a flag the state machine
    polls. NCCL's works do report is_completed() (a CUDA event query); their wait() does not block the host.
    """

    def __init__(self, work: Any, is_cuda: bool) -> None:
        self._work = work
        self._is_cuda = is_cuda
        self._finished = threading.Event()
        self.error = ""  # the work's error text once finished; empty on success
        if not is_cuda:
            threading.Thread(target=self._wait, name="kvx-p2p-wait", daemon=True).start()

    def _wait(self) -> None:
        try:
            self._work.wait()
        except Exception as exc:  # gloo raises RuntimeError on a closed peer or the group timeout
            self.error = str(exc)
        self._finished.set()

    def is_done(self) -> bool:
        """True once the work finished, either way (see `error`)."""
        if self._is_cuda and not self._finished.is_set() and self._work.is_completed():
            self._wait()  # returns at once: the work is complete; collects its error if any
        return self._finished.is_set()


@dataclass
class _Send:
    completion: _Completion  # the isend
    staging: torch.Tensor  # [num_blocks, *block_shape], gathered source blocks; must outlive the work
    deadline: float  # time.monotonic() after which the send is reported FAILED


def _require_group() -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("the torch backend needs torch.distributed.init_process_group() first")


class TorchSender(KVSender):
    """Sender that isends gathered blocks to the rank that asked for them."""

    backend: ClassVar[BackendName] = BackendName.TORCH

    def __init__(self, *args: Any, group: Any = None, **kwargs: Any) -> None:
        """Args as KVSender, plus group: the torch.distributed group (default: the world)."""
        super().__init__(*args, **kwargs)
        _require_group()
        self._group = group
        self._sends: dict[int, _Send] = {}
        self._abandoned: list[_Send] = []  # timed-out sends, kept alive so gloo never sees freed memory

    def _backend_metadata(self) -> bytes:
        return wire.encode(TorchPeerMetadata(rank=dist.get_rank()))

    def accept_pull(self, request: PullRequest) -> PullReply:
        lease, reason = self._leases.claim(request.transfer_id)
        if lease is None:
            return PullReply(self.worker_id, request.transfer_id, is_accepted=False, reason=reason)
        index = torch.tensor(lease.block_ids, dtype=torch.long, device=self.kv_cache.device)
        staging = self.kv_cache.index_select(0, index)
        work = dist.isend(staging, dst=request.destination_rank, group=self._group, tag=request.transfer_id)
        deadline = time.monotonic() + self.config.transfer_timeout_s
        self._sends[request.transfer_id] = _Send(_Completion(work, staging.is_cuda), staging, deadline)
        return PullReply(self.worker_id, request.transfer_id, is_accepted=True, reason="")

    def _progress(self) -> list[tuple[int, ReleaseReason, str]]:
        done: list[tuple[int, ReleaseReason, str]] = []
        now = time.monotonic()
        for transfer_id, send in list(self._sends.items()):
            if send.completion.is_done():
                error = send.completion.error
                done.append((transfer_id, ReleaseReason.FAILED if error else ReleaseReason.PULLED, error))
            elif now > send.deadline:
                self._abandoned.append(send)
                done.append((transfer_id, ReleaseReason.FAILED, "send timed out; receiver never received"))
            else:
                continue
            del self._sends[transfer_id]
        self._abandoned = [s for s in self._abandoned if not s.completion.is_done()]
        return done


class TorchReceiver(KVReceiver):
    """Receiver that irecvs blocks from a sender's rank after the sender accepted the pull."""

    backend: ClassVar[BackendName] = BackendName.TORCH

    def __init__(self, *args: Any, group: Any = None, **kwargs: Any) -> None:
        """Args as KVReceiver, plus group: the torch.distributed group (default: the world)."""
        super().__init__(*args, **kwargs)
        _require_group()
        self._group = group
        self._ranks: dict[str, int] = {}
        self._outbox: list[PullRequest] = []
        self._abandoned: list[tuple[_Completion, torch.Tensor]] = []  # timed-out irecvs, staging buffers

    def _on_add_peer(self, peer: PeerInfo) -> None:
        self._ranks[peer.worker_id] = wire.decode(TorchPeerMetadata, peer.backend_metadata).rank

    def _start(self, pull: Pull, peer: PeerInfo) -> None:
        self._outbox.append(PullRequest(
            source_worker_id=peer.worker_id,
            transfer_id=pull.handle.transfer_id,
            destination_worker_id=self.worker_id,
            destination_rank=dist.get_rank(),
        ))

    def take_pull_requests(self) -> list[PullRequest]:
        requests, self._outbox = self._outbox, []
        return requests

    def on_pull_reply(self, reply: PullReply) -> None:
        pull = self._pulls.get((reply.source_worker_id, reply.transfer_id))
        if pull is None or pull.state != TransferState.PENDING:
            return  # too late: the pull already FAILED on its deadline; an accepted send times out there
        if not reply.is_accepted:
            pull.fail(f"sender refused: {reply.reason}")
            return
        # staging: [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
        staging = torch.empty((len(pull.dst_block_ids), *self.kv_cache.shape[1:]),
                              dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        work = dist.irecv(staging, src=self._ranks[reply.source_worker_id], group=self._group,
                          tag=reply.transfer_id)
        pull.backend_state = (_Completion(work, staging.is_cuda), staging)
        pull.state = TransferState.TRANSFERRING

    def _advance(self, pull: Pull) -> None:
        self._abandoned = [(c, s) for c, s in self._abandoned if not c.is_done()]
        if pull.state != TransferState.TRANSFERRING:
            return
        completion, staging = pull.backend_state
        if not completion.is_done():
            return
        if completion.error:
            pull.fail(f"irecv failed: {completion.error}")
            return
        index = torch.tensor(pull.dst_block_ids, dtype=torch.long, device=self.kv_cache.device)
        self.kv_cache.index_copy_(0, index, staging)
        pull.state = TransferState.DONE

    def _abort(self, pull: Pull) -> None:
        if pull.state == TransferState.TRANSFERRING:
            self._abandoned.append(pull.backend_state)

