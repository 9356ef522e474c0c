"""(Over 300 lines: every remote method of the one actor class, each a thin call into its worker.)

WorkerActor: the one Ray actor class every pool worker runs. It loads the model and sizes the KV cache
once, then serves in a role (prefill, decode or mixed) and can change role without reloading anything.

Lifecycle:  WorkerActor(role): cheap, so that the gateway learns at once that Ray placed it and on which node
    (placement(); the torch group's first rank also offers a free port on its node: free_port())
    → start(torch_group): the model is found on this node (ModelSource), the engine loads (weights + KV
    cache, once per process; a tensor-parallel worker starts its other ranks on this node first and loads
    its slice: pool_worker/tp_ranks.py), the torch group (if any) is joined → the role's worker is built
    over it (worker_runtime/step_worker.py; PrefillWorker: sender + prefill scheduler; DecodeWorker:
    receiver + decode scheduler). Each remote method is one call into the worker, which calls the engine.
    → serves (every role sends its outputs through output_stream(), one per gateway reader: prefill results,
      decode tokens; every
      role offers KV through peer_info()'s endpoint: prefill its prompts, decode and mixed their evacuated
      streams where the backend allows)
    → set_role(other):
        decode ⇄ mixed: the same DecodeWorker; only the label changes (the gateway routes differently);
        prefill ⇄ decode/mixed: the worker must hold nothing (the gateway drained it, evacuating decode
            streams to other workers); the old worker closes (step loop stopped, transfer endpoint
            deregistered), the new one is built over the same engine: free blocks and their cached
            prefixes stay, the model is not touched
    → shutdown().
Calls meant for another role (submit_prefills on a decode worker, ...) raise WrongRole: the gateway picks
another worker (this one changed role since it was picked).
Aborts are sticky: an abort that overtakes its submission (Ray does not order an async actor's calls) is
remembered, and the submission is refused when it comes (worker_runtime/aborted.py, submissions.py).
Wrapped with ray.remote(...) by the pool, which sets its resources and name. Ray imports this module wherever
a handle of the actor is unpickled (frontends too): what imports torch is imported by start() only
(pool_worker/engine_start.py).
"""

from __future__ import annotations

import os
import socket
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any, cast

import ray

from kv_transfer import (
    BackendName,
    PeerInfo,
    PullReply,
    PullRequest,
    TransferConfig,
    TransferRecord,
    capabilities,
)
from llm_engine.config import EngineConfig
from llm_engine.step_timeline import STEP_TOKEN_BUCKETS, StepRecord
from pool_worker.api import StillHoldsWork, WrongRole
from pool_worker.submissions import is_final, submit_batch
from worker_runtime.aborted import AbortedIds
from worker_runtime.info import WorkerInfo, WorkerPlacement, WorkerRuntime, WorkerStanding
from worker_runtime.keeper_watch import KeeperWatch
from worker_runtime.load import StepTokens, WorkerLoad
from worker_runtime.model_source import ModelSource
from worker_runtime.output_channels import OutputBatch, OutputChannels
from worker_runtime.peer_client import PeerClient
from worker_runtime.process_heap import freeze_startup_heap
from worker_runtime.roles import Role
from worker_runtime.worker_setup import TorchGroupSpec, setup_worker_process

if TYPE_CHECKING:  # the torch side: pool_worker/engine_start.py, imported by start()
    from decode_pool.messages import DecodeRequest
    from decode_pool.worker import DecodeWorker
    from llm_engine.engine import LLMEngine
    from pool_worker.tp_ranks import TPRanks
    from prefill_pool.messages import PrefillRequest
    from prefill_pool.worker import PrefillWorker


class WorkerActor:
    def __init__(self, worker_id: str, role: Role, engine_config: EngineConfig, backend: BackendName,
                 transfer_config: TransferConfig, watermark: float, num_threads: int = 1,
                 model_source: ModelSource | None = None, keeper: str | None = None) -> None:
        """Args:
            keeper: the name of the fleet actor this (detached) worker outlives a restart of; the worker ends
                itself once no actor has that name (worker_runtime/keeper_watch.py). None: Ray ends it with
                its owner.
        """
        self.worker_id = worker_id
        self._engine_config = engine_config
        self._model_source = model_source or ModelSource(engine_config.model_dir)
        self._backend = BackendName(backend)  # the gateway may send the value, as it once did
        self._transfer_config = transfer_config
        self._watermark = watermark
        self._num_threads = num_threads
        self._num_role_changes = 0
        self._cpu_ids: tuple[int, ...] = ()
        # Outlives the roles: a gateway's output stream stays open across role changes.
        self._outputs = OutputChannels(abort=self.abort, is_final=is_final)
        self._aborted = AbortedIds()  # aborts of requests perhaps not here yet
        # Peer worker id → the wiring generation of the last add_peer or remove_peer applied for it: Ray does
        # not keep an async actor's call order, so a remove sent before an add may arrive after it; the
        # higher generation wins whatever the order (kept across role changes, like the worker).
        self._peer_generations: dict[str, int] = {}
        self.role = Role(role)  # likewise
        self._placement = WorkerPlacement(ray.get_runtime_context().get_node_id(),
                                          ray.util.get_node_ip_address(), os.getpid())
        self._worker: PrefillWorker | DecodeWorker | None = None  # built by start()
        self._cpu_slot: int | None = None
        self._keeper = KeeperWatch(keeper).start() if keeper else None
        self._tp_ranks: TPRanks | None = None  # ranks 1.. of a tensor-parallel worker (start() makes them)
        self._rank_loss_told = False  # a gone rank was posted to the step loop (it fails the worker)
        self._num_model_loads = 0  # in this process, as of start()

    def placement(self) -> WorkerPlacement:
        return self._placement

    def free_port(self) -> int:
        """A port free on this node's address now: the torch group's first rank listens there."""
        with socket.socket() as s:
            s.bind((self._placement.node_ip, 0))
            return int(s.getsockname()[1])

    def start(self, torch_group: TorchGroupSpec | None = None, cpu_slot: int | None = None) -> WorkerInfo:
        """Load the model found on this node, join the torch group (if any), and serve in the role.

        Args:
            cpu_slot: this worker's slot among the live workers of its node: it pins itself to that slot's
                cores (worker_runtime/worker_setup.py); None: not pinned.

        Raises:
            FileNotFoundError: the model is not on this node (the message names the node).
        """
        node = f"{self._placement.node_ip} (node id {self._placement.node_id[:12]})"
        model_dir = self._model_source.resolve_here(node)  # before the group: a rank without it fails alone
        self._cpu_ids = setup_worker_process(self._num_threads, torch_group, cpu_slot)
        self._cpu_slot = cpu_slot
        # No staging cache where the backend reads each rank's heads where they live; its scratch instead.
        slices = capabilities(self._backend).reads_rank_slices
        config = replace(self._engine_config, model_dir=model_dir, tp_staging=not slices,
                         transfer_scratch_bytes=self._transfer_config.rank_scratch_bytes
                         if slices and self._engine_config.tensor_parallel_size > 1 else 0)
        from pool_worker.engine_start import load_engine

        loaded = load_engine(self.worker_id, config, self._placement, self._num_threads)
        self.engine, self._tp_ranks = loaded.engine, loaded.tp_ranks
        self._num_model_loads = loaded.num_model_loads
        self._worker = self._build_worker(self.role)
        freeze_startup_heap()  # a full collection over the model's heap would stall the step loop
        return self.info()

    def _build_worker(self, role: Role) -> PrefillWorker | DecodeWorker:
        from pool_worker.engine_start import build_worker

        return build_worker(role, self.worker_id, self.engine, self._backend, self._transfer_config,
                            self._outputs, self._watermark, self._num_threads)

    @property
    def worker(self) -> PrefillWorker | DecodeWorker:
        """The current role's worker; tests reach the engine through it."""
        return self._started()

    def info(self) -> WorkerInfo:
        actor_id = ray.get_runtime_context().get_actor_id() or ""
        return WorkerInfo(self.worker_id, self.role, actor_id, os.getpid(), self._num_model_loads,
                          self._num_role_changes, self._runtime())

    def standing(self) -> WorkerStanding:
        """Who and where this worker is and whether it serves: for a restarted fleet actor to adopt it."""
        return WorkerStanding(self.info(), self._placement, self._cpu_slot, self._worker is not None)

    def _runtime(self) -> WorkerRuntime | None:
        engine: LLMEngine | None = getattr(self, "engine", None)
        pids = tuple(self._tp_ranks.pids) if self._tp_ranks is not None else ()
        return None if engine is None else WorkerRuntime.of(engine, self._num_threads, self._cpu_ids, pids)

    async def set_role(self, role: Role) -> WorkerInfo:
        """Serve as `role` from now on (see the lifecycle); raises StillHoldsWork if the worker still holds
        work and the change needs a new front."""
        new = Role(role)
        if new is self.role:
            return self.info()
        if new.can_decode and self.role.can_decode:  # decode ⇄ mixed: the same front
            self.role = new
        else:
            load = self._started().load()
            if load.num_requests or not self.engine.block_pool.is_whole():
                raise StillHoldsWork(
                    f"{self.worker_id} still holds {load.num_requests} requests and "
                    f"{self.engine.block_pool.num_used_blocks} KV blocks; drain it before it changes role"
                )
            self._started().close()
            self._worker = self._build_worker(new)
            self.role = new
        self._num_role_changes += 1
        return self.info()

    # Both roles.
    def abort(self, request_id: str) -> None:
        """End the request; if it has not arrived yet, refuse it when it does."""
        self._aborted.remember(request_id)
        self._started().abort(request_id)

    def load(self) -> WorkerLoad:
        """The worker's latest load (`failure` is set once its step loop has died), with how long its
        running step has run (answered here, on the actor's loop: a hung step cannot stop it)."""
        worker = self._started()
        self._check_ranks(worker)
        compilation = self.engine.compilation
        return replace(worker.load(), role=self.role, step_running_s=worker.loop.running_s(),
                       longest_step_s=worker.loop.longest_step_s,
                       step_tokens=self._step_tokens(), compile=compilation.mode,
                       compile_reason=f"{compilation.body} body: {compilation.reason}")

    def _check_ranks(self, worker: PrefillWorker | DecodeWorker) -> None:
        # An idle tensor-parallel worker runs no all-reduce that would fail on a dead rank: without this it
        # stays routable and its pulls wait out their deadlines (review P7). Told once; the loop then fails.
        if self._tp_ranks is not None and not self._rank_loss_told and (gone := self._tp_ranks.ended()):
            from llm_engine.step_faults import WorkerFault  # torch: the started worker's side only

            self._rank_loss_told = True
            worker.fail_at_next_step(WorkerFault(f"tensor-parallel rank(s) {gone} of {self.worker_id} ended"))

    def _step_tokens(self) -> StepTokens:
        counts = self.engine.runner.timeline.tokens
        return StepTokens(STEP_TOKEN_BUCKETS, counts.bucket_counts, counts.num_tokens, counts.num_steps)

    def step_timeline(self, since: float = 0.0) -> list[StepRecord]:
        """This worker's forwards that started at or after `since` (time.time()), in any role."""
        return self.engine.runner.timeline.since(since)

    def is_whole(self) -> bool:
        """No block held: for tests and drains."""
        return self.engine.block_pool.is_whole()

    def transfer_records(self) -> list[TransferRecord]:
        return self._started().transfer_records()

    def shutdown(self) -> None:
        if self._keeper is not None:
            self._keeper.stop()
        if self._worker is not None:
            self._worker.close()
        if self._tp_ranks is not None:
            self.engine.stop_followers()
            self._tp_ranks.kill()

    def peer_info(self) -> PeerInfo:
        """The endpoint other workers pull KV from: a prefill worker's prompts, or a decode or mixed
        worker's evacuated streams (where the backend can move KV between decode workers)."""
        return self._started().peer_info()

    def release_kv(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this transfer: free its blocks now. A late release after a role change finds
        nothing (the change waited until every lease had ended; each sender starts its ids at random)."""
        self._started().release_kv(transfer_id, why)

    # Prefill role.

    async def submit_prefills(self, requests: list[PrefillRequest], channel_id: str) -> list[str]:
        """Start prefilling each prompt, in order; each PrefillResult goes to the output stream of
        `channel_id` (the gateway batches what it submits in one event-loop turn:
        gateway/fleet/submissions.py).
        Returns, per request, why it was refused ("" if it started); WorkerFailed (the step loop died) is
        raised for the whole batch."""
        prefill = self._prefill()
        return await submit_batch(requests, lambda request: prefill.submit_to(request, channel_id),
                                  self._aborted, self.engine.runner.grammar_mask.cache)

    def accept_pull(self, pull: PullRequest) -> PullReply:
        return self._prefill().accept_pull(pull)

    # Decode and mixed roles.
    async def add_peer(self, peer: PeerInfo, actor: Any = None, generation: int = 0) -> None:
        """Learn a worker to pull KV from (its peer_info() and actor), unless a later wiring of that worker
        (a higher `generation`) has been applied already."""
        decode = self._decode()
        if not self._is_newest_wiring(peer.worker_id, generation):
            return
        decode.add_peer(peer, PeerClient(peer.worker_id, actor) if actor is not None else None)

    def remove_peer(self, worker_id: str, generation: int = 0) -> None:
        """Forget a worker's endpoint, unless a later wiring of it has been applied already."""
        if not self._is_newest_wiring(worker_id, generation):
            return
        if self._worker is not None and self.role.can_decode:  # a prefill worker knows no peers
            self._decode().remove_peer(worker_id)

    def _is_newest_wiring(self, worker_id: str, generation: int) -> bool:
        if generation and generation <= self._peer_generations.get(worker_id, 0):
            return False
        self._peer_generations[worker_id] = max(generation, self._peer_generations.get(worker_id, 0))
        return True

    async def output_stream(self, channel_id: str) -> AsyncIterator[OutputBatch]:
        """The outputs of every request submitted with `channel_id` (prefill results, decode outputs), one
        item per step (or several steps, for a reader behind); held open by the gateway in any role.
        Closing it aborts those requests."""
        async for batch in self._outputs.stream(channel_id):
            yield batch

    def close_channels(self, gateway_id: str) -> int:
        """A gateway is gone (a frontend process that died): end its output channels, aborting the requests
        they carry, so that none holds KV here for a reader that will never come back."""
        return self._outputs.close_channels(gateway_id + "-")

    async def submit_decodes(self, requests: list[DecodeRequest], channel_id: str) -> list[str]:
        """Start decoding each request, in order; its outputs go to the output stream of `channel_id` (the
        gateway batches what it submits in one event-loop turn: gateway/fleet/submissions.py). Returns, per
        request, why it was refused ("" if it started); WorkerFailed (the step loop died) is raised for the
        whole batch."""
        decode = self._decode()
        return await submit_batch(requests, lambda request: decode.submit_to(request, channel_id),
                                  self._aborted, self.engine.runner.grammar_mask.cache)

    def evacuate(self) -> None:
        """End every request here with finish_reason "migrate": the gateway continues them elsewhere."""
        if self._worker is not None and self.role.can_decode:
            self._decode().evacuate()

    def move_out(self, request_ids: list[str]) -> None:
        """Hand these running streams back with their KV offered (finish_reason "migrate"), for the gateway
        to continue elsewhere: it clears this worker for a long prompt. Streams whose KV cannot move stay."""
        if self._worker is not None and self.role.can_decode:
            self._decode().move_out(request_ids)

    def _started(self) -> PrefillWorker | DecodeWorker:
        if self._worker is None:
            raise RuntimeError(f"{self.worker_id} has not started (start() loads the model)")
        return self._worker

    # The role says which worker this is (set_role changes both together).
    def _prefill(self) -> PrefillWorker:
        if self._worker is None or self.role is not Role.PREFILL:
            raise WrongRole(f"{self.worker_id} serves as {self.role.value}, not prefill")
        return cast("PrefillWorker", self._worker)

    def _decode(self) -> DecodeWorker:
        if self._worker is None or not self.role.can_decode:
            raise WrongRole(f"{self.worker_id} serves as prefill, not decode or mixed")
        return cast("DecodeWorker", self._worker)
