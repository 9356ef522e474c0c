"""WorkerClient: the gateway's one typed link to one worker actor. Every call to a worker goes through it:
its methods (typed with the roles' own messages), its errors (worker_errors: WorkerLost, WrongRoleError,
SubmissionRefused; never a RayTaskError above the fleet), its output stream and its batched submissions.

    control (the deployment):  placement → start → peer_info / add_peer / remove_peer → set_role → evacuate
                               → load → close_channels (a frontend gone) → shutdown → kill
    requests (the orchestrator): subscribe(request_id) → submit_prefill | submit_decode → outputs arrive on
                               the one output stream (output_streams.py) → unsubscribe; abort, release_kv;
                               move_out (streams moved off a worker about to prefill a long prompt)
The client lives as long as the worker is in the deployment (across its role changes, like the worker's
output channels); close() when it leaves cancels the remote stream.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, TypeVar

import ray

from decode_pool.messages import DecodeRequest
from gateway.fleet.output_streams import OutputStream, RequestOutputs
from gateway.fleet.rank_groups import remove_rank_group
from gateway.fleet.ray_calls import translated
from gateway.fleet.submissions import Submissions
from gateway.fleet.worker_errors import StillBusy, WorkerLost, WrongRoleError
from kv_transfer import PeerInfo, TransferRecord
from llm_engine.step_timeline import StepRecord
from pool_worker.api import StillHoldsWork, WorkerFailed, WrongRole
from prefill_pool.messages import PrefillRequest
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role

if TYPE_CHECKING:
    from ray.actor import ActorHandle

    from pool_worker.actor import WorkerActor
    from worker_runtime.info import WorkerInfo, WorkerPlacement
    from worker_runtime.worker_setup import TorchGroupSpec

T = TypeVar("T")


class WorkerClient:
    def __init__(self, worker_id: str, handle: ActorHandle[WorkerActor], gateway_id: str,
                 actor_name: str = "") -> None:
        """Args:
        handle: the Ray actor (pool_worker.actor.WorkerActor).
        gateway_id: names this gateway to the worker (its output channel ids start with it).
        actor_name: the actor's name in Ray, which names its ranks' placement group (if it has ranks).
        """
        self.worker_id = worker_id
        self.handle = handle
        self.actor_name = actor_name
        self.outputs = OutputStream(worker_id, gateway_id, self._output_stream)
        self._prefills: Submissions[PrefillRequest] = Submissions(self._submit_prefills)
        self._decodes: Submissions[DecodeRequest] = Submissions(self._submit_decodes)

    # Requests.
    def subscribe(self, request_id: str) -> RequestOutputs:
        """Where the request's outputs will arrive: call before submitting it (no output goes unheard)."""
        return self.outputs.subscribe(request_id)

    def unsubscribe(self, outputs: RequestOutputs) -> None:
        self.outputs.unsubscribe(outputs)

    def request_ids(self) -> list[str]:
        """The requests whose outputs this gateway awaits from the worker."""
        return self.outputs.request_ids()

    async def submit_prefill(self, request: PrefillRequest, outputs: RequestOutputs) -> None:
        """Start prefilling; its PrefillResult arrives on `outputs`.

        Raises:
            SubmissionRefused, WrongRoleError, WorkerLost.
        """
        await self._prefills.submit(request, outputs.channel_id)

    async def submit_decode(self, request: DecodeRequest, outputs: RequestOutputs) -> None:
        """Start decoding; its outputs arrive on `outputs` (raises as submit_prefill)."""
        await self._decodes.submit(request, outputs.channel_id)

    def abort(self, request_id: str) -> None:
        """End the request there (idempotent; sticky: an abort that overtakes its submission still holds)."""
        self.handle.abort.remote(request_id)

    def release_kv(self, transfer_id: int, why: str) -> None:
        """Nobody will pull this KV offer: the worker may free its blocks now (fire and forget)."""
        self.handle.release_kv.remote(transfer_id, why)

    # Control.
    def close_channels(self, gateway_id: str) -> None:
        """That gateway (a frontend) is gone: the worker aborts what it was streaming to it (fire and
        forget)."""
        self.handle.close_channels.remote(gateway_id)

    async def placement(self) -> WorkerPlacement:
        return await self._call(self.handle.placement.remote())

    async def free_port(self) -> int:
        return await self._call(self.handle.free_port.remote())

    async def start(self, torch_group: TorchGroupSpec | None, cpu_slot: int | None) -> WorkerInfo:
        return await self._call(self.handle.start.remote(torch_group, cpu_slot))

    async def peer_info(self) -> PeerInfo:
        return await self._call(self.handle.peer_info.remote())

    async def add_peer(self, peer: PeerInfo, source: WorkerClient, generation: int) -> None:
        """Learn `source` as a worker to pull KV from (replacing what was known of it). `generation`: the
        deployment's wiring counter; whichever of an add and a remove of the same peer has the higher one
        wins there, whatever order Ray delivers them in."""
        await self._call(self.handle.add_peer.remote(peer, source.handle, generation))

    def remove_peer(self, worker_id: str, generation: int) -> None:
        """Forget that worker's endpoint (fire and forget; ordered against add_peer by `generation`)."""
        self.handle.remove_peer.remote(worker_id, generation)

    async def set_role(self, role: Role) -> WorkerInfo:
        return await self._call(self.handle.set_role.remote(role.value))

    async def evacuate(self) -> None:
        await self._call(self.handle.evacuate.remote())

    async def move_out(self, request_ids: list[str]) -> None:
        """Have the worker hand these streams back with their KV offered (WorkerActor.move_out)."""
        await self._call(self.handle.move_out.remote(request_ids))

    async def load(self) -> WorkerLoad:
        return await self._call(self.handle.load.remote())

    async def info(self) -> WorkerInfo:
        return await self._call(self.handle.info.remote())

    async def step_timeline(self, since: float = 0.0) -> list[StepRecord]:
        return await self._call(self.handle.step_timeline.remote(since))

    async def is_whole(self) -> bool:
        return await self._call(self.handle.is_whole.remote())

    async def transfer_records(self) -> list[TransferRecord]:
        return await self._call(self.handle.transfer_records.remote())

    async def shutdown(self) -> None:
        await self._call(self.handle.shutdown.remote())

    def close(self) -> None:
        """The worker left the deployment: stop reading its outputs (the remote stream is cancelled)."""
        self.outputs.close()

    def kill(self) -> None:
        self.close()
        with contextlib.suppress(Exception):  # already gone
            ray.kill(self.handle, no_restart=True)
        if self.actor_name:  # its ranks' resources, if it has ranks, go back to the cluster
            remove_rank_group(self.actor_name)

    # The wire.
    def _output_stream(self, channel_id: str) -> ray.ObjectRefGenerator:
        return self.handle.output_stream.remote(channel_id)

    def _submit_prefills(self, requests: list[PrefillRequest], channel_id: str) -> Any:
        return self._call(self.handle.submit_prefills.remote(requests, channel_id))

    def _submit_decodes(self, requests: list[DecodeRequest], channel_id: str) -> Any:
        return self._call(self.handle.submit_decodes.remote(requests, channel_id))

    async def _call(self, ref: Any) -> Any:
        """Await an actor call, its Ray errors translated (others raise as they are)."""
        return await translated(ref, self._when_gone, self._from_cause)

    def _when_gone(self, error: BaseException) -> BaseException:
        return WorkerLost(f"{self.worker_id} is gone: {type(error).__name__}")

    def _from_cause(self, cause: BaseException) -> BaseException | None:
        """What the worker's own refusal or failure is to the gateway (None: it raises as a RayTaskError)."""
        if isinstance(cause, WorkerFailed):
            return WorkerLost(f"{self.worker_id} failed: {cause}")
        if isinstance(cause, WrongRole):
            return WrongRoleError(str(cause))
        if isinstance(cause, StillHoldsWork):
            return StillBusy(str(cause))
        return None
