"""The prefill stage of one request: a prefill worker computes the prompt's KV and first token.

    pick a prefill worker (the router's, not one tried already; waits for a replacement until prefill_by)
      → subscribe to its outputs under a new attempt id → its prompt tokens booked on it while it works →
      submit → PrefillResult (first token + KVHandle) → the booking released.
    A worker lost (actor or step loop dead, output stream ended) or answering finish "error" is marked
    failed and the request tried once more elsewhere (MAX_PREFILL_ATTEMPTS); one that changed role
    (WrongRoleError), or whose stream the fleet closed (ChannelClosed), is simply passed over; a refusal
    (a grammar it cannot compile, too few KV blocks) goes to another worker, and is a 400 when none is
    left. The deadline passing, or the client leaving, aborts it there.
"""

from __future__ import annotations

import asyncio

from gateway.fleet.worker_errors import ChannelClosed, SubmissionRefused, WorkerLost, WrongRoleError
from gateway.fleet.workers import Worker
from gateway.requests.events import FailureCode, RequestFailed
from gateway.requests.route import RequestRoute
from gateway.requests.state import RequestState
from llm_engine.finish_reason import FinishReason
from prefill_pool.messages import PrefillRequest, PrefillResult
from worker_runtime.roles import Role

MAX_PREFILL_ATTEMPTS = 2  # the first try and one retry on another worker


async def prefill(state: RequestState, route: RequestRoute) -> tuple[Worker, PrefillResult]:
    """The worker that prefilled the prompt and its result (RequestFailed: none could)."""
    tried: set[str] = set()
    prefill_by = state.deadlines.prefill_by
    for _ in range(MAX_PREFILL_ATTEMPTS):
        prefill = await route.wait_for_worker(Role.PREFILL, deadline=prefill_by, exclude=tried)
        tried.add(prefill.worker_id)
        client = prefill.client
        attempt_id = state.new_attempt_id()  # a retry is never taken for the attempt the worker aborted
        try:
            outputs = client.subscribe(attempt_id)  # before submitting: no result unheard
        except WorkerLost:
            continue  # it left the deployment since it was picked
        # Booked only now, and released however the block ends: a worker's drain or role change waits for
        # its books to read 0.
        route.at(f"prefilling on {prefill.worker_id}")
        try:
            with route.prefill_booking(prefill):
                async with asyncio.timeout(state.time_left(prefill_by)):
                    await client.submit_prefill(PrefillRequest(attempt_id, state.prompt_token_ids,
                                                               state.sampling), outputs)
                    result = await outputs.prefill_result()
        except TimeoutError:
            client.abort(attempt_id)
            raise RequestFailed(state.late("prefill", prefill_by), FailureCode.DEADLINE_EXCEEDED) from None
        except WorkerLost as error:  # its actor or step loop died, or its output stream ended
            # The fleet's probe may find the worker alive (only its stream ended): stop the prompt there, or
            # it runs on and its KV waits out the lease (review LOW).
            client.abort(attempt_id)
            route.fleet.mark_failed(prefill.worker_id, f"prefill worker lost: {error}")
            continue
        except WrongRoleError:  # it changed role since it was picked: another one
            continue
        except ChannelClosed:  # the worker is fine and aborted it: submit it again, there or elsewhere
            tried.discard(prefill.worker_id)
            continue
        except SubmissionRefused as refused:  # a grammar that does not compile, too few KV blocks there
            if not any(w.worker_id not in tried for w in route.fleet.active(Role.PREFILL)):
                raise RequestFailed(f"the request was refused: {refused}", FailureCode.REFUSED, 400) from None
            continue  # another worker may take it (one started later may have fewer blocks)
        except asyncio.CancelledError:  # the client went away: stop the prefill (and free its KV)
            client.abort(attempt_id)
            raise
        finally:
            client.unsubscribe(outputs)
        if result.finish_reason == FinishReason.ERROR:
            route.fleet.mark_failed(prefill.worker_id, result.error)
            continue
        return prefill, result
    raise RequestFailed(f"the prompt could not be prefilled: {MAX_PREFILL_ATTEMPTS} prefill workers failed",
                        FailureCode.WORKER_FAILED)
