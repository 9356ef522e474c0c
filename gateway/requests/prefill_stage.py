"""The prefill stage of one request: a prefill worker computes the prompt's KV and first token.

    pick a prefill worker (the router's, not one tried already; waits for a replacement until prefill_by)
      → its prompt tokens booked on it (the router's prefill_tokens) → subscribe to its outputs → submit
      → PrefillResult (first token + KVHandle) → the booking released.
    A worker lost (actor or step loop dead, output stream ended) or answering finish "error" is marked
    failed and the request tried once more elsewhere (MAX_PREFILL_ATTEMPTS); one that changed role
    (WrongRoleError), or whose stream the fleet closed (ChannelClosed), is simply passed over; a refusal
    (a grammar it cannot compile, too few KV blocks) goes to another worker, and is a 400 when none is
    left. The deadline passing, or the client leaving, aborts it there.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from gateway.fleet.worker_errors import ChannelClosed, SubmissionRefused, WorkerLost, WrongRoleError
from gateway.fleet.workers import Worker
from gateway.requests.events import RequestFailed
from prefill_pool.messages import PrefillRequest, PrefillResult
from worker_runtime.roles import Role

if TYPE_CHECKING:
    from gateway.requests.orchestrator import RequestRun

MAX_PREFILL_ATTEMPTS = 2  # the first try and one retry on another worker


async def prefill(run: RequestRun) -> tuple[Worker, PrefillResult]:
    """The worker that prefilled the prompt and its result (RequestFailed: none could)."""
    tried: set[str] = set()
    num_prompt = len(run.prompt_token_ids)
    for _ in range(MAX_PREFILL_ATTEMPTS):
        prefill = await run.wait_for_worker("prefill", run.deadlines.prefill_by, tried)
        tried.add(prefill.worker_id)
        client = prefill.client
        attempt_id = run.new_attempt_id()  # a retry is never taken for the attempt the worker aborted
        try:
            outputs = client.subscribe(attempt_id)  # before submitting: no result unheard
        except WorkerLost:
            continue  # it left the deployment since it was picked
        # Booked only now, so that every booking is released in the `finally` below: a worker's drain or
        # role change waits for its books to read 0.
        run.router.book_prefill(prefill.worker_id, num_prompt, run.request_id)
        run.at(f"prefilling on {prefill.worker_id}")
        try:
            async with asyncio.timeout(run.time_left(run.deadlines.prefill_by)):
                await client.submit_prefill(PrefillRequest(attempt_id, run.prompt_token_ids, run.sampling),
                                            outputs)
                result = await outputs.prefill_result()
        except TimeoutError:
            client.abort(attempt_id)
            raise RequestFailed(run.late("prefill", run.deadlines.prefill_by), "deadline_exceeded"
                                ) from None
        except WorkerLost as error:  # its actor or step loop died, or its output stream ended
            run.fleet.mark_failed(prefill.worker_id, f"prefill worker lost: {error}")
            continue
        except WrongRoleError:  # it changed role since it was picked: another one
            continue
        except ChannelClosed:  # the worker is fine and aborted it: submit it again, there or elsewhere
            tried.discard(prefill.worker_id)
            continue
        except SubmissionRefused as refused:  # a grammar that does not compile, too few KV blocks there
            if not any(w.worker_id not in tried for w in run.fleet.active(Role.PREFILL)):
                raise RequestFailed(f"the request was refused: {refused}", "refused", 400) from None
            continue  # another worker may take it (one started later may have fewer blocks)
        except asyncio.CancelledError:  # the client went away: stop the prefill (and free its KV)
            client.abort(attempt_id)
            raise
        finally:
            client.unsubscribe(outputs)
            run.router.unbook_prefill(prefill.worker_id, num_prompt, run.request_id)
        if result.finish_reason == "error":
            run.fleet.mark_failed(prefill.worker_id, result.error)
            continue
        return prefill, result
    raise RequestFailed(
        f"the prompt could not be prefilled: {MAX_PREFILL_ATTEMPTS} prefill workers failed",
        "worker_failed",
    )
