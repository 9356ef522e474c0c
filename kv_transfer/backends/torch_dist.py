"""torch.distributed backend (gloo on CPU, NCCL on GPU): point-to-point isend/irecv between two ranks.

The sender takes part, so each pull is a round trip delivered by the caller (e.g. a Ray actor call):
    receiver.start_pull()          -> PENDING, queues a PullRequest (take_pull_requests())
    sender.accept_pull(request)    lease claimed, blocks gathered into a staging buffer, isend posted;
                                   returns a PullReply (refused if the lease is over or the id unknown)
    receiver.on_pull_reply(reply)  accepted: irecv into a staging buffer -> TRANSFERRING; refused -> FAILED
    receiver.poll()                irecv complete -> staging scattered into the destination blocks -> DONE
                                   (converted there where the sender's element type is not ours)
    sender.poll()                  isend complete -> PULLED (timed out -> FAILED)
The staging buffers keep the destination blocks untouched until every byte has arrived, and let the source
blocks be freed even if a send leg never completes. The peer set is the process group, fixed up front.

Ordering invariant, per (sender rank, receiver rank) pair: the receiver posts its irecvs in exactly the order
the sender posted its isends, and posts exactly one irecv for every isend. NCCL ignores tags and pairs p2p
operations by posting order, so without this a reply delivered out of order (concurrent actor calls) puts one
pull's bytes into another's blocks, and an unmatched isend holds up every later one. How it is kept:
    - the sender numbers its isends per destination rank (PullReply.send_seq, in posting order);
    - the receiver holds an accepted reply until the replies of every earlier send_seq from that sender have
      their irecv posted (replies may arrive in any order; the caller must deliver every one);
    - an accepted reply whose pull already FAILED (deadline) still gets its irecv, into a discarded buffer.
Gloo matches by tag (the transfer id), so for gloo the invariant is harmless rather than required.
The group's backend must be the one `torch_group.p2p_backend()` names for the KV cache's device (checked at
construction).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist

from kv_transfer import wire
from kv_transfer.backends.torch_group import require_group
from kv_transfer.conversion import block_shape, torch_dtype, write_blocks
from kv_transfer.enums import BackendName, ReleaseReason, TransferState
from kv_transfer.layout import KVLayout
from kv_transfer.messages import PullReply, PullRequest
from kv_transfer.receiver import KVReceiver, Pull
from kv_transfer.sender import KVSender

if TYPE_CHECKING:
    from kv_transfer.messages import PeerInfo

logger = logging.getLogger(__name__)


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


@dataclass
class _SendOrder:
    """Receiver side: where the irecvs from one sender stand in that sender's posting order."""

    next_seq: int = 0  # send_seq of the next irecv to post
    waiting: dict[int, PullReply] = field(default_factory=dict)  # accepted replies that arrived early


class TorchSender(KVSender):
    """Sender that isends gathered blocks to the rank that asked for them."""

    backend: ClassVar[BackendName] = BackendName.TORCH

    def __init__(self, *args: Any, group: Any = None, **kwargs: Any) -> None:
        """Args as KVSender, plus group: the torch.distributed group (default: the world)."""
        super().__init__(*args, **kwargs)
        require_group(group, self.kv_cache)
        self._group = group
        self._rank = dist.get_rank()
        self._sends: dict[int, _Send] = {}
        self._num_posted: dict[int, int] = {}  # destination rank -> isends posted to it (the next send_seq)
        self._failed_posts: list[tuple[int, ReleaseReason, str]] = []  # claimed, but the isend did not post
        self._abandoned: list[_Send] = []  # timed-out sends, kept alive so gloo never sees freed memory

    def _backend_metadata(self) -> bytes:
        return wire.encode(TorchPeerMetadata(rank=self._rank))

    def accept_pull(self, request: PullRequest) -> PullReply:
        lease, reason = self._leases.claim(request.transfer_id)
        if lease is None:
            return PullReply(self.worker_id, request.transfer_id, is_accepted=False, reason=reason,
                             send_seq=-1, num_blocks=0)
        index = torch.tensor(lease.block_ids, dtype=torch.long, device=self.kv_cache.device)
        # Bytes, whatever the cache's dtype: gloo sends no float8, and a block is its bytes either way
        staging = self.kv_cache.view(torch.uint8).index_select(0, index)
        dst = request.destination_rank
        try:
            work = dist.isend(staging, dst=dst, group=self._group, tag=request.transfer_id)
        except Exception as exc:  # e.g. a broken group: nothing was posted, so the order is unchanged
            why = f"isend could not be posted: {exc}"
            self._failed_posts.append((request.transfer_id, ReleaseReason.FAILED, why))
            return PullReply(self.worker_id, request.transfer_id, is_accepted=False, reason=why,
                             send_seq=-1, num_blocks=0)
        send_seq = self._num_posted.get(dst, 0)
        self._num_posted[dst] = send_seq + 1
        deadline = time.monotonic() + self.config.transfer_timeout_s
        self._sends[request.transfer_id] = _Send(_Completion(work, staging.is_cuda), staging, deadline)
        return PullReply(self.worker_id, request.transfer_id, is_accepted=True, reason="",
                         send_seq=send_seq, num_blocks=len(lease.block_ids))

    def _progress(self) -> list[tuple[int, ReleaseReason, str]]:
        done, self._failed_posts = self._failed_posts, []
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
        require_group(group, self.kv_cache)
        self._group = group
        self._rank = dist.get_rank()
        self._ranks: dict[str, int] = {}
        self._sources: dict[str, KVLayout] = {}  # each sender's blocks, as they arrive (kept, as its rank)
        self._orders: dict[str, _SendOrder] = {}  # by source worker id
        self._outbox: list[PullRequest] = []
        self._abandoned: list[tuple[_Completion, torch.Tensor]] = []  # irecvs nobody waits for, and staging

    def _on_add_peer(self, peer: PeerInfo) -> None:
        self._ranks[peer.worker_id] = wire.decode(TorchPeerMetadata, peer.backend_metadata).rank
        self._sources[peer.worker_id] = peer.layout
        self._orders[peer.worker_id] = _SendOrder()

    def _start(self, pull: Pull, peer: PeerInfo) -> None:
        self._outbox.append(PullRequest(
            source_worker_id=peer.worker_id,
            transfer_id=pull.handle.transfer_id,
            destination_worker_id=self.worker_id,
            destination_rank=self._rank,
        ))

    def take_pull_requests(self) -> list[PullRequest]:
        requests, self._outbox = self._outbox, []
        return requests

    def on_pull_reply(self, reply: PullReply) -> None:
        if not reply.is_accepted:
            pull = self._pulls.get((reply.source_worker_id, reply.transfer_id))
            if pull is not None and pull.state == TransferState.PENDING:
                pull.fail(f"sender refused: {reply.reason}")
            return  # nothing was posted, so the order is unchanged
        order = self._orders[reply.source_worker_id]
        if reply.send_seq < order.next_seq or reply.send_seq in order.waiting:
            logger.warning("duplicate pull reply %s from %s ignored", reply.transfer_id,
                           reply.source_worker_id)
            return
        order.waiting[reply.send_seq] = reply
        while order.next_seq in order.waiting:
            self._post_recv(order.waiting.pop(order.next_seq))
            order.next_seq += 1

    def _post_recv(self, reply: PullReply) -> None:
        """Post the irecv matching one accepted send; its turn in the sender's posting order has come."""
        pull = self._pulls.get((reply.source_worker_id, reply.transfer_id))
        # staging: the sender's blocks' bytes, as it sends them (accept_pull), in its element type:
        # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim × its dtype's bytes]
        source = self._sources[reply.source_worker_id]
        sent = torch.empty(block_shape(source), dtype=torch_dtype(source), device="meta").view(torch.uint8)
        staging = torch.empty((reply.num_blocks, *sent.shape), dtype=torch.uint8, device=self.kv_cache.device)
        try:
            work = dist.irecv(staging, src=self._ranks[reply.source_worker_id], group=self._group,
                              tag=reply.transfer_id)
        except Exception as exc:
            if pull is not None and pull.state == TransferState.PENDING:
                pull.fail(f"irecv could not be posted: {exc}")
            return
        completion = _Completion(work, staging.is_cuda)
        if pull is not None and pull.state == TransferState.PENDING:
            if reply.num_blocks == len(pull.dst_block_ids):
                pull.backend_state = (completion, staging)
                pull.state = TransferState.TRANSFERRING
                return
            pull.fail(f"sender sends {reply.num_blocks} blocks, the pull expects {len(pull.dst_block_ids)}")
        # The pull already FAILED (deadline), but the send is posted: match it anyway, so that the sender's
        # next send lands in our next irecv, and let the bytes go.
        self._abandoned.append((completion, staging))

    def _progress(self) -> None:
        self._abandoned = [(c, s) for c, s in self._abandoned if not c.is_done()]

    def _advance(self, pull: Pull) -> None:
        if pull.state != TransferState.TRANSFERRING:
            return
        completion, staging = pull.backend_state
        if not completion.is_done():
            return
        if completion.error:
            pull.fail(f"irecv failed: {completion.error}")
            return
        source = self._sources[pull.handle.source_worker_id]
        blocks = staging.view(torch_dtype(source)).view(len(pull.dst_block_ids), *block_shape(source))
        write_blocks(self.kv_cache, pull.dst_block_ids, blocks)  # converted where the sender's type differs
        pull.state = TransferState.DONE

    def _abort(self, pull: Pull) -> bool:
        if pull.state == TransferState.TRANSFERRING:
            self._abandoned.append(pull.backend_state)  # the irecv writes only its staging buffer
        return True
