"""(Over 300 lines: the two halves of one claim/grant protocol, which read best beside its table below; a
tensor-parallel receiver's READs on every rank are that protocol's READ step, with the same deadlines.)

NIXL backend: the receiver READs the sender's blocks over UCX, once the sender has granted the READ.

A READ is one-sided: once posted, the sender cannot stop it. So before any READ the receiver asks, and the
sender's own clock decides (NIXL notifications, kv_transfer.backends.nixl_notif):
    receiver.start_pull()  CLAIM(hold_s = time the pull has left) -> sender                 -> PENDING
    sender.poll()          lease still valid by the sender's clock: claimed (no longer expires),
                           held hold_s (capped by its transfer timeout), GRANT(hold_s) -> receiver;
                           else (expired, withdrawn, unknown, being pulled): REFUSE(reason) -> receiver
    receiver.poll()        GRANT: READ posted, PULLED attached to it                         -> TRANSFERRING
                           REFUSE                                                            -> FAILED
    receiver.poll()        READ DONE within hold_s of sending the claim                      -> DONE
                           READ ERR, or the deadline passes (READ cancelled first): DROP     -> FAILED
    sender.poll()          PULLED -> released PULLED; DROP, or the hold passed -> released FAILED
Why no clock agreement is needed: only durations cross between the hosts. The sender starts counting a hold
when it handles the claim, after the receiver sent it; the receiver trusts a READ only if it saw it DONE
within the granted hold of sending the claim. So the sender frees granted blocks on the receiver's word
(PULLED, DROP) or after every READ the receiver would trust has ended. handle.lease_deadline is only the
receiver's early-out. Cost: one notification round trip plus the wait for the sender's next poll().

Handshake once per peer: the receiver loads the sender's agent metadata and prepares a descriptor list over
all of the peer's blocks; its own blocks are prepared once at construction. Per pull only indices are passed.
The sender learns how to reach a receiver from its claims, which carry the receiver's connection info (loaded
when it is new or changed), so PeerInfo still goes one way only; it forgets a receiver idle for
idle_receiver_s with no grant outstanding.
Tensor-parallel workers (kv_transfer/backends/nixl_ranks.py): the lease, claim and grant stay with rank 0; a
pull where either side has ranks posts, on every destination rank, one READ per source rank it shares heads
with (kv_transfer/head_slices.py), with no notification attached; rank 0 sends PULLED once every rank's
READs are DONE, and DROP (after cancelling them all) when one fails. backend_metadata lists every rank's
agent metadata, rank 0's first. A pull into a cache of another element type (bfloat16 → fp8, or back) takes
the same sliced way with the one rank each side has: its READ lands in the scratch, and the copy into the
cache converts (kv_transfer/conversion.py).
Transfer handles: each READ's handle is released exactly once, when the READ is seen DONE or ERR, when the
deadline cancels it, or at close(). A release NIXL refuses is logged and retried at every poll(); a pull whose
READ could not be cancelled is reported only once it has been, so nothing lands in freed destination blocks.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import msgpack

from kv_transfer.backends.nixl_agent import NixlAgent
from kv_transfer.backends.nixl_notif import NixlNotif, NotifKind, decode_notif, encode_notif
from kv_transfer.backends.nixl_ranks import (
    CancelReads,
    ForgetAgents,
    LoadAgents,
    OpenRank,
    PollReads,
    PostReads,
    RankMemory,
)
from kv_transfer.backends.slice_reads import SliceReads
from kv_transfer.enums import BackendName, ReleaseReason, TransferState
from kv_transfer.head_slices import plan_slice_reads
from kv_transfer.layout import converts, rank_slices_layout
from kv_transfer.receiver import KVReceiver, Pull
from kv_transfer.sender import KVSender

if TYPE_CHECKING:
    from kv_transfer.messages import PeerInfo

logger = logging.getLogger(__name__)


# Numbers each endpoint this process builds: a worker that changes role builds a new one, and its agent
# needs a name no peer has seen (peers keep a loaded agent's metadata under its name).
_incarnations = itertools.count()


def _registered_agent(end: KVSender | KVReceiver) -> tuple[NixlAgent, list[bytes]]:
    """A NIXL agent named for the worker and this endpoint, with its whole KV tensor registered; and every
    rank's agent metadata, this one's first. A tensor-parallel worker's other ranks open their agents first
    (once per rank), and the endpoint's layout becomes the ranks' slices."""
    config = end.config
    others: list[RankMemory] = [] if end.ranks is None else end.ranks(OpenRank(config))
    own = end.layout
    if others:
        end.layout = rank_slices_layout(
            [(0, own.num_kv_heads, own.regions[0]),
             *((m.first_kv_head, m.num_kv_heads, m.region) for m in others)], own)
    name = f"{end.worker_id}#{os.getpid()}.{next(_incarnations)}"
    agent = NixlAgent(name, config.nixl_progress_delay_us, config.nixl_error_mode, config.ucx_cma_seg_size)
    agent.register(end.layout, own.regions)
    return agent, [agent.metadata(), *(m.agent_metadata for m in others)]


@dataclass
class _Grant:
    """Sender side: a claimed lease that one receiver may READ (internal, never sent)."""

    agent_name: str  # the receiver's NIXL agent; only its PULLED / DROP end the grant
    hold_until: float  # time.monotonic() after which no READ the receiver trusts can still run


class NixlSender(KVSender):
    """Sender whose blocks are read by the receiver's NIXL agent, after it granted the receiver's claim."""

    backend: ClassVar[BackendName] = BackendName.NIXL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.agent, self._metadata = _registered_agent(self)
        self._grants: dict[int, _Grant] = {}  # by transfer id
        self._connections: dict[str, bytes] = {}  # receiver agent name -> connection info loaded for it
        self._last_claim: dict[str, float] = {}  # receiver agent name -> time.monotonic() of its last claim
        self._next_sweep = 0.0

    def _backend_metadata(self) -> bytes:
        return msgpack.packb(self._metadata, use_bin_type=True)

    def _progress(self) -> list[tuple[int, ReleaseReason, str]]:
        done: list[tuple[int, ReleaseReason, str]] = []
        for agent_name, messages in self.agent.notifications().items():
            for message in messages:
                notif = decode_notif(message, agent_name)
                if notif is None:
                    continue
                if notif.kind == NotifKind.CLAIM:
                    self._answer(agent_name, notif)
                elif notif.kind == NotifKind.PULLED and self._end_grant(agent_name, notif.transfer_id):
                    done.append((notif.transfer_id, ReleaseReason.PULLED, ""))
                elif notif.kind == NotifKind.DROP and self._end_grant(agent_name, notif.transfer_id):
                    why = f"receiver dropped the pull: {notif.reason}"
                    done.append((notif.transfer_id, ReleaseReason.FAILED, why))
        now = time.monotonic()
        for transfer_id, grant in list(self._grants.items()):
            if now > grant.hold_until:
                del self._grants[transfer_id]
                done.append((transfer_id, ReleaseReason.FAILED, "the granted READ did not end in its hold"))
        if now >= self._next_sweep:
            self._next_sweep = now + 1.0
            self._forget_idle_receivers(now)
        return done

    def _forget_idle_receivers(self, now: float) -> None:
        granted = {grant.agent_name for grant in self._grants.values()}
        idle = [name for name, at in self._last_claim.items()
                if now - at > self.config.idle_receiver_s and name not in granted]
        for agent_name in idle:
            del self._last_claim[agent_name]
            if self._connections.pop(agent_name, None) is not None:
                self.agent.forget_remote(agent_name, None)

    @property
    def num_known_receivers(self) -> int:
        """Receivers whose connection this sender holds."""
        return len(self._connections)

    def _end_grant(self, agent_name: str, transfer_id: int) -> bool:
        """Forget a grant on its receiver's word; False if there is none (e.g. DROP after the hold ended)."""
        grant = self._grants.get(transfer_id)
        if grant is None:
            return False
        if grant.agent_name != agent_name:
            logger.warning("%s ended transfer %d granted to %s; ignored", agent_name, transfer_id,
                           grant.agent_name)
            return False
        del self._grants[transfer_id]
        return True

    def _answer(self, agent_name: str, claim: NixlNotif) -> None:
        """Grant or refuse a claim; the lease's validity is decided here, by this host's clock."""
        self._last_claim[agent_name] = time.monotonic()
        if claim.connection_info and self._connections.get(agent_name) != claim.connection_info:
            try:
                self.agent.add_remote(claim.connection_info)
            except Exception as exc:  # cannot answer; the lease stays unclaimed and the pull times out
                logger.warning("connection info from %s could not be loaded: %s", agent_name, exc)
                return
            self._connections[agent_name] = claim.connection_info
        hold_s = min(claim.hold_s, self.config.transfer_timeout_s)
        if hold_s > 0:
            lease, reason = self._leases.claim(claim.transfer_id)
        else:
            lease, reason = None, "the claim left no time to read"
        if lease is None:
            refusal = encode_notif(NotifKind.REFUSE, claim.transfer_id, reason=reason)
            self.agent.send_notif(agent_name, refusal)
            return
        # Held even if the grant is lost on the way: no READ is then posted, and the hold ends it.
        self._grants[claim.transfer_id] = _Grant(agent_name, time.monotonic() + hold_s)
        self.agent.send_notif(agent_name, encode_notif(NotifKind.GRANT, claim.transfer_id, hold_s=hold_s))

    def close(self) -> None:
        self.agent.close()


@dataclass
class _Read:
    """Pull.backend_state of a NIXL pull (internal, never sent)."""

    agent_name: str  # the sender's NIXL agent
    claim_sent_at: float  # time.monotonic() when the claim left; the sender's hold counts from later
    xfer: int | None = None  # the READ's transfer handle, from posting until it is released
    is_sliced: bool = False  # READs of rank slices, on every rank (SliceReads), not one READ
    is_release_refused: bool = False  # NIXL refused to cancel it at the deadline once (logged once)


class NixlReceiver(KVReceiver):
    """Receiver that claims, then READs, blocks from NixlSenders through its own NIXL agent."""

    backend: ClassVar[BackendName] = BackendName.NIXL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.agent, _ = _registered_agent(self)
        self._connection_info = self.agent.connection_info()
        self._local_dlist = None if self.layout.ranks else self.agent.prep_blocks("", self.layout)
        self._remote_dlists: dict[str, int] = {}  # by source worker id, for one-rank to one-rank pulls
        self._agent_names: dict[str, str] = {}  # source worker id -> its NIXL agent name (rank 0's)
        self._rank_agents: dict[str, tuple[str, ...]] = {}  # source worker id -> its ranks' agents, if sliced
        self._slices = SliceReads(self.agent, self.kv_cache, self.config.rank_scratch_bytes)  # rank 0's READs
        self._slice_states: dict[tuple[str, int], str] = {}  # sliced pull -> PROC / DONE / ERR, all ranks
        self._workers: dict[str, str] = {}  # NIXL agent name -> source worker id
        self._unreleased: list[int] = []  # handles of finished READs that NIXL refused to release yet
        # Agent name of a removed peer's rank 0 → its prepared list and every rank's agent name.
        self._retiring: dict[str, tuple[int | None, tuple[str, ...]]] = {}

    def _on_add_peer(self, peer: PeerInfo) -> None:
        """Load the peer's agents (every rank's) and prepare its blocks; all or nothing: what was loaded
        before a step failed is dropped again, and the error raised (the wiring call reports it)."""
        metadata = tuple(msgpack.unpackb(peer.backend_metadata, raw=False))
        names: list[str] = []
        asked_ranks = False
        try:
            for m in metadata:
                names.append(self.agent.add_remote(m))
            # Sliced: a tensor-parallel side's heads, or blocks that convert, go through SliceReads (its
            # scratch takes the source's bytes, and the copy into the cache converts them).
            if peer.layout.ranks or self.layout.ranks or converts(peer.layout, self.layout):
                if self.ranks is not None:
                    asked_ranks = True
                    self.ranks(LoadAgents(metadata))
                self._rank_agents[peer.worker_id] = tuple(names)
            else:
                self._remote_dlists[peer.worker_id] = self.agent.prep_blocks(names[0], peer.layout)
        except Exception:
            self._rank_agents.pop(peer.worker_id, None)
            for name in names:
                self.agent.forget_remote(name, None)
            if asked_ranks and self.ranks is not None:
                with contextlib.suppress(Exception):  # the ranks that loaded them drop them
                    self.ranks(ForgetAgents(tuple(names)))
            raise
        self._agent_names[peer.worker_id] = names[0]
        self._workers[names[0]] = peer.worker_id

    def _on_remove_peer(self, worker_id: str) -> None:
        agent_name = self._agent_names.pop(worker_id, None)
        if agent_name is not None:
            self._workers.pop(agent_name, None)
            # Released once no READ of it is in flight, not leaked per role change (the worker's next
            # endpoint gets its own list and metadata).
            self._retiring[agent_name] = (self._remote_dlists.pop(worker_id, None),
                                          self._rank_agents.pop(worker_id, ()))

    def _start(self, pull: Pull, peer: PeerInfo) -> None:
        now = time.monotonic()
        # Every claim carries how to reach us: the sender may have forgotten us since (idle_receiver_s).
        claim = encode_notif(NotifKind.CLAIM, pull.handle.transfer_id, hold_s=pull.deadline - now,
                             connection_info=self._connection_info)
        pull.backend_state = _Read(self._agent_names[peer.worker_id], now)
        if not self.agent.send_notif(pull.backend_state.agent_name, claim):
            pull.fail("the claim could not be sent to the sender's NIXL agent")

    def _progress(self) -> None:
        self._unreleased = [xfer for xfer in self._unreleased if not self.agent.release(xfer)]
        if self._retiring and not self._unreleased:
            reading = {pull.backend_state.agent_name for pull in self._pulls.values()
                       if isinstance(pull.backend_state, _Read)}
            for agent_name in [name for name in self._retiring if name not in reading]:
                dlist, rank_agents = self._retiring.pop(agent_name)
                self.agent.forget_remote(agent_name, dlist)
                for name in rank_agents[1:]:
                    self.agent.forget_remote(name, None)
                if rank_agents and self.ranks is not None:
                    self.ranks(ForgetAgents(rank_agents))
        if self._slice_states:
            self._poll_slices()
        for agent_name, messages in self.agent.notifications().items():
            worker_id = self._workers.get(agent_name)
            if worker_id is None:
                continue
            for message in messages:
                answer = decode_notif(message, agent_name)
                if answer is not None:
                    self._on_answer(worker_id, agent_name, answer)

    def _on_answer(self, worker_id: str, agent_name: str, answer: NixlNotif) -> None:
        """A sender's GRANT or REFUSE of one of our claims."""
        pull = self._pulls.get((worker_id, answer.transfer_id))
        if pull is not None and pull.state == TransferState.PENDING:
            if answer.kind == NotifKind.REFUSE:
                pull.fail(f"sender refused: {answer.reason}")
            elif answer.kind == NotifKind.GRANT:
                self._read(pull, answer.hold_s)
        elif answer.kind == NotifKind.GRANT and (pull is None or pull.is_finished):
            # The pull failed before the grant came: let the sender free the blocks now.
            self._drop(agent_name, answer.transfer_id, "the pull ended before the grant arrived")

    def _read(self, pull: Pull, hold_s: float) -> None:
        """The sender granted the claim: post the READ if the grant leaves time to trust it."""
        read: _Read = pull.backend_state
        pull.deadline = min(pull.deadline, read.claim_sent_at + hold_s)
        if time.monotonic() > pull.deadline:
            self._drop(read.agent_name, pull.handle.transfer_id, "the grant arrived after its hold")
            return  # fails at this poll's deadline check
        if pull.handle.source_worker_id in self._rank_agents:
            self._read_slices(pull)
            return
        assert self._local_dlist is not None  # a one-rank receiver: sliced otherwise
        pulled = encode_notif(NotifKind.PULLED, pull.handle.transfer_id)
        try:
            read.xfer, status = self.agent.read(self._local_dlist, pull.dst_block_ids,
                                                self._remote_dlists[pull.handle.source_worker_id],
                                                pull.handle.block_ids, pulled)
        except RuntimeError as exc:
            pull.fail(str(exc))
            self._drop(read.agent_name, pull.handle.transfer_id, "the READ could not be posted")
            return
        pull.state = TransferState.TRANSFERRING
        self._settle(pull, status)

    def _read_slices(self, pull: Pull) -> None:
        """Post every rank's READs of its heads (rank 0's here, the others' through the step mirror)."""
        read: _Read = pull.backend_state
        handle, peer = pull.handle, self.peers[pull.handle.source_worker_id]
        agents = self._rank_agents[handle.source_worker_id]
        mine = [r for r in plan_slice_reads(peer.layout, self.layout, handle.block_ids, pull.dst_block_ids)
                if r.dst.rank == 0]
        read.is_sliced = True
        own: list[bool] = []

        def post_own() -> None:
            own.append(self._slices.post(pull.key, mine, agents))

        posted = True
        if self.ranks is not None:
            # This rank's READs posted while the others post theirs (a post of CMA reads copies the bytes).
            op = PostReads(pull.key, peer.layout, self.layout, handle.block_ids, pull.dst_block_ids, agents)
            try:
                posted = all(self.ranks(op, meanwhile=post_own))
            except RuntimeError as exc:  # a rank's op raised: what it posted is cancelled below
                logger.warning("a rank could not post its READs of transfer %s: %s", pull.key, exc)
                posted = False
        else:
            post_own()
        posted = posted and own == [True]
        self._slice_states[pull.key] = "PROC" if posted else "ERR"
        pull.state = TransferState.TRANSFERRING
        if not posted:  # what was posted is stopped before the pull fails (now, or at a later poll)
            self._settle_slices(pull)

    def _poll_slices(self) -> None:
        """Every rank's READs of sliced pulls: a pull is DONE once all are, ERR once one failed."""
        own = self._slices.poll()
        # The other ranks are asked (a collective, which a forward waits behind) only once this rank's READs
        # of some pull are done or failed: theirs, posted just after, end no sooner. Unasked, they keep
        # their answers for the next ask.
        ask = self.ranks is not None and any(own.get(key, "DONE") != "PROC" for key in self._slice_states)
        answers = [own, *(self.ranks(PollReads()) if ask and self.ranks is not None else [])]
        for key, state in self._slice_states.items():
            if state == "ERR":  # stays until the pull is stopped
                continue
            states = {answer.get(key, "DONE") for answer in answers}  # a rank answers DONE once, then forgets
            if self.ranks is not None and not ask:
                states.add("PROC")  # what the other ranks would say is not known yet
            self._slice_states[key] = "ERR" if "ERR" in states else "PROC" if "PROC" in states else "DONE"

    def _stop_slices(self, pull: Pull) -> bool:
        """Cancel a sliced pull's READs on every rank; True once none can write any more."""
        stopped = self._slices.cancel(pull.key)
        if self.ranks is not None:
            stopped = all(self.ranks(CancelReads(pull.key))) and stopped
        if stopped:
            self._slice_states.pop(pull.key, None)
        return stopped

    def _settle_slices(self, pull: Pull) -> None:
        read: _Read = pull.backend_state
        state = self._slice_states.get(pull.key, "PROC")
        if state == "PROC":
            return
        if state == "DONE":
            self._slice_states.pop(pull.key, None)
            if time.monotonic() <= pull.deadline:
                pulled = encode_notif(NotifKind.PULLED, pull.handle.transfer_id)
                self.agent.send_notif(read.agent_name, pulled)
                pull.state = TransferState.DONE
            else:
                pull.fail("READ completed too late to be trusted: the sender's hold was over")
        elif self._stop_slices(pull):  # one rank's READ failed: the others' stopped before the report
            pull.fail("NIXL READ of a rank's heads failed or could not be posted (peer gone or memory no "
                      "longer registered)")
            self._drop(read.agent_name, pull.handle.transfer_id, "the READ failed")

    def _advance(self, pull: Pull) -> None:
        read: _Read = pull.backend_state
        if pull.state == TransferState.TRANSFERRING and read.is_sliced:
            self._settle_slices(pull)
        elif pull.state == TransferState.TRANSFERRING and read.xfer is not None:
            self._settle(pull, self.agent.status(read.xfer))

    def _settle(self, pull: Pull, status: str) -> None:
        read: _Read = pull.backend_state
        if status == "PROC" or read.xfer is None:
            return
        self._release(read.xfer)
        read.xfer = None
        if status == "DONE" and time.monotonic() <= pull.deadline:
            pull.state = TransferState.DONE
        elif status == "DONE":
            # Seen only after the hold: it may have finished after the sender freed the blocks.
            pull.fail("READ completed too late to be trusted: the sender's hold was over")
        else:
            pull.fail("NIXL READ failed (peer gone or memory no longer registered)")
            self._drop(read.agent_name, pull.handle.transfer_id, "the READ failed")

    def _abort(self, pull: Pull) -> bool:
        read: _Read | None = pull.backend_state
        if read is None:
            return True  # no claim sent
        if read.is_sliced:
            if not self._stop_slices(pull):
                return False
            self._drop(read.agent_name, pull.handle.transfer_id, "deadline passed; READs cancelled")
            return True
        if read.xfer is None:
            # No READ posted. The claim may have been granted (or will be): tell the sender now, so that it
            # frees its blocks at once even if this receiver stops polling (a grant that still comes while
            # it polls gets another DROP, which the sender ignores).
            self._drop(read.agent_name, pull.handle.transfer_id, "the pull was stopped before its READ")
            return True
        if not self.agent.release(read.xfer):  # still in flight and NIXL could not cancel it
            if not read.is_release_refused:
                logger.warning("NIXL could not cancel the READ of transfer %d at its deadline; retrying at "
                               "each poll", pull.handle.transfer_id)
            read.is_release_refused = True
            return False
        read.xfer = None
        self._drop(read.agent_name, pull.handle.transfer_id, "deadline passed; READ cancelled")
        return True

    def _forget_rank_agents(self) -> None:
        """The other ranks drop the peers' agents this receiver had them load (their agents outlive it: a
        worker that changes role builds new endpoints over the same ranks)."""
        loaded = [*self._rank_agents.values(), *(names for _, names in self._retiring.values())]
        if self.ranks is None or not any(loaded):
            return
        try:
            for names in loaded:
                if names:
                    self.ranks(ForgetAgents(names))
        except Exception as exc:  # the ranks are gone (the worker is ending): nothing left to tidy
            logger.info("the other ranks could not drop their peers' agents: %s", exc)

    def _release(self, xfer: int) -> None:
        if not self.agent.release(xfer):
            logger.warning("NIXL refused to release transfer handle %#x; retrying at each poll", xfer)
            self._unreleased.append(xfer)

    def _drop(self, agent_name: str, transfer_id: int, reason: str) -> None:
        self.agent.send_notif(agent_name, encode_notif(NotifKind.DROP, transfer_id, reason=reason))

    def close(self) -> None:
        for pull in self._pulls.values():
            if isinstance(pull.backend_state, _Read) and pull.backend_state.is_sliced:
                self._stop_slices(pull)
        self._slices.cancel_all()
        self._forget_rank_agents()
        for pull in self._pulls.values():
            read = pull.backend_state
            if isinstance(read, _Read) and read.xfer is not None:
                self._unreleased.append(read.xfer)
                read.xfer = None
        self._unreleased = [xfer for xfer in self._unreleased if not self.agent.release(xfer)]
        if self._unreleased:
            logger.error("closing with %d NIXL transfer handles NIXL refused to release",
                         len(self._unreleased))
        self.agent.close()
