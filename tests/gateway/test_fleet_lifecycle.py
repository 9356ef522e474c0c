"""The fleet's lifecycle on real worker actors (local Ray, tiny Llama, nixl): sticky aborts, the decode
reservation booked at pick time, role changes and drains that are cancelled roll back, an add that fails
leaves nothing behind, the output stream is kept across role changes and cancelled when the worker leaves,
and turning auto off mid-change strands no worker."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from decode_pool.messages import DecodeRequest
from gateway.fleet import drain
from gateway.fleet.deployment import PDDeployment
from gateway.fleet.worker_errors import SubmissionRefused
from gateway.fleet.workers import WorkerState
from gateway.ratio.controller import RatioController
from gateway.ratio.ladder import ControllerPolicy
from gateway.ratio.pool_layout import PoolLayout
from gateway.ratio.resize import Move, PoolResizer, ResizeConflict, ResizeRefused
from gateway.requests.router import Router
from gateway.telemetry.recent import RecentLatencies
from llm_engine import SamplingParams
from llm_engine.choices import FirstToken
from prefill_pool.messages import PrefillRequest
from tests.helpers import actor_faults as faults
from tests.helpers.fleets import SharedDeployment, call_on, events_of, tokens, until, with_deployment
from tests.helpers.reference import random_prompts
from worker_runtime.model_source import ModelSource
from worker_runtime.roles import Role

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
LONG = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)


def num_channels(actor: Any) -> int:
    return len(actor._outputs._channels)


def test_a_moved_streams_kv_is_freed_at_once_when_the_worker_it_was_handed_to_dies(tiny_llama_dir: Path
                                                                                   ) -> None:
    """L11: a stream evacuated from A is handed to B with its KV (A offers it); B dies before pulling it.
    The stream goes on (recomputed on C, the same tokens), and A frees the offered blocks at once rather
    than when the offer's 30 s lease ends."""
    async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
        a, b, c = deployment.active(Role.MIXED)
        prompt = random_prompts([40], 1000, seed=11)[0]
        reference = tokens(await events_of(router, "reference", prompt, LONG))
        router.book_decode(b.worker_id, 10**6)  # the stream starts on A
        router.book_decode(c.worker_id, 10**7)
        await call_on(a, faults.slow_steps, 0.05)
        run = asyncio.ensure_future(events_of(router, "moved", prompt, LONG))
        await until(lambda: "moved" in a.client.request_ids())
        await asyncio.sleep(0.5)  # decoding on A
        router.unbook_decode(b.worker_id, 10**6)  # B is where it goes next ...
        router.book_decode(a.worker_id, 10**8)  # ... and never back to A
        await call_on(b, faults.stall_pulls)  # B takes the stream and never finishes pulling its KV
        await a.client.evacuate()
        # Its next attempt there, under an id of its own (moved~1: gateway/requests/state.py).
        await until(lambda: any(r.split("~")[0] == "moved" for r in b.client.request_ids()))
        await asyncio.sleep(0.3)  # B's pull is posted, and hangs
        ray.kill(b.client.handle, no_restart=True)
        events = await run
        # The stream is whole; A's offer of its KV was released at once: A holds no block (well before the
        # 30 s lease would have freed it).
        freed_after = -1.0
        started = time.monotonic()
        while time.monotonic() - started < 10:
            if await a.client.is_whole():
                freed_after = time.monotonic() - started
                break
            await asyncio.sleep(0.05)
        return {"reference": reference, "events": events, "freed_after": freed_after,
                "num_moves": events[-1].num_moves, "num_migrations": events[-1].num_migrations}

    result = with_deployment(tiny_llama_dir, scenario, num_prefill=0, num_decode=0, num_mixed=3)
    assert tokens(result["events"]) == result["reference"]
    assert (result["num_moves"], result["num_migrations"]) == (1, 1)  # evacuated from A, then B failed
    assert result["freed_after"] >= 0, "A still held the moved stream's KV 10 s after it moved on"


def known_peers(actor: Any) -> list[str]:
    return sorted(actor.worker._peers)


def test_role_changes_keep_the_output_stream_and_leaving_cancels_it(tiny_llama_dir: Path) -> None:
    """M5: the gateway's one stream to a worker outlives its role changes (no parked generator per change);
    a worker that leaves has its stream cancelled on the worker's side."""
    async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
        [prefill], [moving, other] = deployment.active(Role.PREFILL), deployment.active(Role.DECODE)
        router.book_decode(other.worker_id, 10**6)  # requests decode on `moving` while it decodes
        router.prefill_tokens[prefill.worker_id] += 10**6  # ... and prefill there while it prefills
        prompt = random_prompts([12], 1000, seed=9)[0]
        counts = []
        for index in range(3):
            for role in (Role.DECODE, Role.PREFILL):  # the role it serves in now
                await events_of(router, f"r{index}-{role.value}", prompt, GREEDY)
                counts.append(await call_on(moving, num_channels))
                await deployment.change_role(moving.worker_id, Role.PREFILL if role is Role.DECODE
                                             else Role.DECODE, router)
        moving.client.close()
        closed = -1
        for _ in range(500):
            closed = await call_on(moving, num_channels)
            if closed == 0:
                break
            await asyncio.sleep(0.02)
        return {"counts": counts, "closed": closed}

    result = with_deployment(tiny_llama_dir, scenario, num_prefill=1, num_decode=2)
    assert result["counts"] == [1] * 6
    assert result["closed"] == 0


def test_turning_auto_off_mid_change_strands_no_worker(tiny_llama_dir: Path) -> None:
    """H1: the controller moves a mixed worker that holds a stream to prefill (it waits for the stream);
    auto is turned off meanwhile. The worker is ACTIVE again, the target matches the roles, the resizer is
    free, and requests are served. M3: a decode worker no node can take (PENDING) does not keep the
    controller from acting."""
    async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
        [pending] = [w for w in deployment.workers.values() if w.state is WorkerState.PENDING]
        workers = deployment.active(Role.MIXED)
        await asyncio.gather(*(call_on(w, faults.slow_steps, 0.1) for w in workers))
        resizer = PoolResizer(deployment, router)
        controller = RatioController(deployment, router, resizer, RecentLatencies(),
                                     ControllerPolicy(long_prompt_tokens=16, min_dwell_s=0.0, grace_s=200.0))
        streams = [asyncio.ensure_future(events_of(router, f"s{i}", random_prompts([10], 1000, seed=i)[0],
                                                    LONG)) for i in range(2)]
        await until(lambda: all(router.decode_tokens.get(w.worker_id) for w in workers))
        controller.start()
        # Prefilled in chunks of 32 tokens beside the stream there: the controller sees it and moves that
        # worker to prefill, which waits for the stream (grace 200 s).
        long = asyncio.ensure_future(events_of(router, "long", random_prompts([320], 1000, seed=3)[0],
                                               GREEDY))
        await until(lambda: any(w.state is WorkerState.CHANGING_ROLE for w in workers))
        await controller.stop()
        states = {w.worker_id: (w.state, w.role, w.next_role) for w in workers}
        target = {role: n for role, n in deployment.target.items() if n}
        roles = collections.Counter(w.role for w in [*workers, pending])
        await asyncio.gather(*(call_on(w, faults.heal) for w in workers))
        served = await asyncio.gather(long, *streams)
        after = await events_of(router, "after", random_prompts([10], 1000, seed=4)[0], GREEDY)
        return {"states": states, "target": target, "roles": dict(roles), "busy": resizer.is_busy,
                "pending": pending.state,
                "decisions": len(controller.decisions), "served": served, "after": after}

    result = with_deployment(tiny_llama_dir, scenario, num_prefill=0, num_decode=1, num_mixed=2,
                             max_num_batched_tokens=32, role_resources={Role.DECODE: {"pdserve_nowhere": 1}})
    assert result["decisions"] == 1 and result["pending"] is WorkerState.PENDING
    assert all(state is WorkerState.ACTIVE and next_role is None
               for state, _, next_role in result["states"].values()), result["states"]
    assert result["target"] == result["roles"]
    assert not result["busy"]
    assert [len(tokens(e)) for e in result["served"]] == [6, 120, 120]
    assert len(tokens(result["after"])) == 6


def test_a_layout_that_moves_a_worker_still_starting_is_refused_before_anything_moves(
        tiny_llama_dir: Path) -> None:
    """The target counts a decode worker that is not placed yet (PENDING); a layout whose plan changes that
    decode worker's role is refused (409) up front, instead of stopping part way with "no active decode
    worker" after earlier moves ran."""
    async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
        resizer = PoolResizer(deployment, router)
        before = dict(deployment.target)
        with pytest.raises(ResizeConflict, match="decode worker"):
            resizer.check(PoolLayout(prefill=2, mixed=1))
        moves = resizer.check(PoolLayout(prefill=1, decode=1, mixed=2))  # adds only: fine
        # L5: an added decode worker asks for its role's custom resource, which no node offers.
        with pytest.raises(ResizeRefused, match="1 pdserve_nowhere"):
            resizer.check(PoolLayout(prefill=1, decode=2, mixed=1))
        return {"before": before, "after": dict(deployment.target), "moves": [m.action for m in moves]}

    result = with_deployment(tiny_llama_dir, scenario, num_prefill=1, num_decode=1, num_mixed=1,
                             role_resources={Role.DECODE: {"pdserve_nowhere": 1}})
    assert result["before"] == result["after"]
    assert result["moves"] == ["add"]


def test_a_request_taken_into_a_running_step_shows_in_the_workers_load(tiny_llama_dir: Path) -> None:
    """A mixed worker, idle, takes a request from its inbox and prefills it in the same step; while that step
    runs (held here), its load report counts the request (before: neither arriving nor held, 0)."""
    async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
        [worker] = deployment.active(Role.MIXED)
        await call_on(worker, faults.hold_steps)
        prompt = random_prompts([12], 1000, seed=5)[0]
        stream = asyncio.ensure_future(events_of(router, "held", prompt, GREEDY))
        seen = []
        for _ in range(300):  # 6 s: the request reaches the worker within milliseconds
            seen.append((await worker.client.load()).num_requests)
            if seen[-1]:
                break
            await asyncio.sleep(0.02)
        await call_on(worker, faults.release_steps)
        events = await stream
        return {"seen": seen[-1], "tokens": tokens(events)}

    result = with_deployment(tiny_llama_dir, scenario, num_prefill=0, num_decode=0, num_mixed=1)
    assert result["seen"] == 1
    assert len(result["tokens"]) == 6


class TestOnOneSharedDeploymentOf1P1D:
    """Scenarios that leave 1 prefill + 1 decode worker as they found them share one deployment (the
    class's); SharedDeployment fails a scenario that does not."""

    @pytest.fixture(scope="class")
    def shared(self, tiny_llama_dir: Path, ray_local: None) -> Iterator[SharedDeployment]:
        deployment = SharedDeployment(tiny_llama_dir, num_prefill=1, num_decode=1)
        yield deployment
        deployment.close()

    def test_an_abort_that_overtakes_its_submission_still_holds(self, shared: SharedDeployment) -> None:
        """M1: Ray may run an async actor's abort before the submission sent ahead of it. The worker remembers
        the abort and refuses the submission when it comes; it holds nothing for it."""
        async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
            [prefill], [decode] = deployment.active(Role.PREFILL), deployment.active(Role.DECODE)
            prompt = tuple(random_prompts([30], 1000)[0])
            refusals = {}
            # Review N6: a group of choices (n > 1) is aborted under its choices' ids, not its own.
            group = DecodeRequest("gone-3", prompt, dataclasses.replace(LONG, n=2),
                                  choices=(FirstToken(0, 5, None), FirstToken(1, 6, None)))
            for worker, submit, request in (
                    (decode, decode.client.submit_decode, DecodeRequest("gone-1", prompt, LONG)),
                    (prefill, prefill.client.submit_prefill, PrefillRequest("gone-2", prompt, LONG)),
                    (decode, decode.client.submit_decode, group)):
                for request_id in getattr(request, "output_request_ids", (request.request_id,)):
                    worker.client.abort(request_id)
                await worker.client.is_whole()  # the abort has run on the worker
                outputs = worker.client.subscribe(request.request_id)
                try:
                    await submit(request, outputs)  # type: ignore[operator]
                except SubmissionRefused as refusal:
                    refusals[request.request_id] = str(refusal)
                finally:
                    worker.client.unsubscribe(outputs)
            loads = {w.role: await w.client.load() for w in (prefill, decode)}
            whole = {w.role: await w.client.is_whole() for w in (prefill, decode)}
            served = await events_of(router, "after", list(prompt), GREEDY)  # the workers serve on
            return {"refusals": refusals, "loads": loads, "whole": whole, "served": served}

        result = shared.run(scenario)
        assert set(result["refusals"]) == {"gone-1", "gone-2", "gone-3"}
        assert all("aborted before it arrived" in r for r in result["refusals"].values())
        assert all(load.num_requests == 0 for load in result["loads"].values())
        assert all(result["whole"].values())
        assert len(tokens(result["served"])) == 6

    def test_a_peer_removal_that_arrives_after_a_later_add_is_ignored(self, shared: SharedDeployment) -> None:
        """Ray does not keep an async actor's call order: a fire-and-forget remove_peer sent before an
        add_peer of the same worker may land after it. The higher wiring generation wins, whatever the
        order."""
        async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
            [prefill], [decode] = deployment.active(Role.PREFILL), deployment.active(Role.DECODE)
            peer, handle = await prefill.client.peer_info(), decode.client.handle
            before = await call_on(decode, known_peers)
            # As delivered out of order: the add first, then the older remove (generations above the
            # deployment's own, which count from the clock in microseconds).
            later = time.time_ns()
            await decode.client.add_peer(peer, prefill.client, later + 2)
            handle.remove_peer.remote(prefill.worker_id, later + 1)
            await handle.load.remote()  # after the remove
            kept = await call_on(decode, known_peers)
            prompt = random_prompts([24], 1000, seed=12)[0]
            events = await events_of(router, "after-peers", prompt, GREEDY)  # pulled from the prefill worker
            decode.client.remove_peer(prefill.worker_id, later + 3)  # a newer removal does apply
            await handle.load.remote()
            gone = await call_on(decode, known_peers)
            # A handle from a peer the decode worker does not know: it recomputes the prompt and cannot tell
            # the sender, so the gateway releases the offer at the request's end, not the 30 s lease.
            unknown = await events_of(router, "unknown-peer", prompt, GREEDY)
            released_in = time.monotonic()
            while not await prefill.client.is_whole() and time.monotonic() - released_in < 10:
                await asyncio.sleep(0.05)
            released_in = time.monotonic() - released_in
            await decode.client.add_peer(peer, prefill.client, later + 4)  # wired again, as it started
            return {"before": before, "kept": kept, "gone": gone, "prefill_on": events[0].prefill is not None,
                    "finish": events[-1].finish_reason, "prefill": prefill.worker_id,
                    "same_tokens": tokens(unknown) == tokens(events), "released_in": released_in,
                    "unknown_bytes": unknown[-1].decode.transfer_bytes if unknown[-1].decode else -1}

        result = shared.run(scenario)
        assert result["before"] == result["kept"] == [result["prefill"]]
        assert result["prefill_on"] and result["finish"] == "length"
        assert result["gone"] == []
        assert result["same_tokens"] and result["unknown_bytes"] == 0
        assert result["released_in"] < 5, result  # the offer's lease is 30 s

    def test_an_add_that_fails_to_start_leaves_nothing_behind(self, shared: SharedDeployment) -> None:
        """M3, L3: the new worker's model is missing on its node: its actor is killed (its CPU free again), it
        is forgotten, the target is as before; the resizer's answer names the move, not the remote
        traceback."""
        async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
            before = (set(deployment.workers), dict(deployment.target))
            cpus = ray.available_resources().get("CPU", 0.0)
            config = deployment.config
            missing = ModelSource("/nonexistent/pdserve-model")
            deployment.table.config = dataclasses.replace(config, model_source=missing)
            try:
                result = await PoolResizer(deployment, router).apply([Move("add", Role.DECODE)])
            finally:
                deployment.table.config = config
            await until(lambda: ray.available_resources().get("CPU", 0.0) == cpus)
            return {"before": before, "after": (set(deployment.workers), dict(deployment.target)),
                    "error": result.error, "health": deployment.health().status}

        result = shared.run(scenario)
        assert result["after"] == result["before"]
        assert result["health"] == "ok"
        assert result["error"].startswith("the move 1 of 1 (add decode) failed")
        assert "nonexistent" not in result["error"] and "Traceback" not in result["error"]


class TestOnOneSharedDeploymentOf1P2D:
    """Scenarios on 1 prefill + 2 decode workers that put back what they change share one deployment."""

    @pytest.fixture(scope="class")
    def shared(self, tiny_llama_dir: Path, ray_local: None) -> Iterator[SharedDeployment]:
        deployment = SharedDeployment(tiny_llama_dir, num_prefill=1, num_decode=2)
        yield deployment
        deployment.close()

    def test_a_burst_books_its_decode_workers_at_pick_time_and_spreads(self, shared: SharedDeployment
                                                                      ) -> None:
        """H2: requests that arrive while others prefill see those requests' decode reservations, so a burst
        spreads across the decode workers instead of all picking the one that looked idle."""
        async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
            [prefill] = deployment.active(Role.PREFILL)
            await call_on(prefill, faults.slow_steps, 0.2)
            prompts = random_prompts([24] * 8, 1000, seed=5)
            runs = [asyncio.ensure_future(events_of(router, f"burst-{i}", p, GREEDY))
                    for i, p in enumerate(prompts)]
            await until(lambda: sum(router.prefill_tokens.values()) == 24 * 8)  # all 8 picked, none prefilled
            booked = {w: n for w, n in router.decode_tokens.items() if n > 0}
            in_flight = {w.worker_id: router.in_flight(w.worker_id) for w in deployment.active(Role.DECODE)}
            await call_on(prefill, faults.heal)
            served = await asyncio.gather(*runs)
            return {"booked": booked, "in_flight": in_flight, "served": served,
                    "after": dict(router.decode_tokens)}

        result = shared.run(scenario)
        assert len(result["booked"]) == 2, result["booked"]  # both decode workers carry part of the burst
        assert sum(result["booked"].values()) == 8 * (24 + 6)
        assert all(n > 0 for n in result["in_flight"].values())  # a drain or role change would wait for them
        assert all(len(tokens(events)) == 6 for events in result["served"])
        assert not any(result["after"].values())  # every booking released

    def test_a_decode_worker_that_changes_role_after_the_pick_sends_the_request_elsewhere(
            self, shared: SharedDeployment) -> None:
        """H2: the picked decode worker becomes prefill while the request prefills; its decode submission
        meets WrongRole, and the request goes on to the other decode worker (no error, the same tokens)."""
        async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
            [prefill] = deployment.active(Role.PREFILL)
            prompt = random_prompts([40], 1000, seed=7)[0]
            reference = tokens(await events_of(router, "reference-moved", prompt, GREEDY))
            await call_on(prefill, faults.slow_steps, 0.3)
            run = asyncio.ensure_future(events_of(router, "moved", prompt, GREEDY))
            await until(lambda: sum(router.prefill_tokens.values()) > 0)
            [picked] = [w for w, n in router.decode_tokens.items() if n > 0]
            # As an operator's change would without the gateway's in-flight count: it does not wait.
            await deployment.change_role(picked, Role.PREFILL)
            await call_on(prefill, faults.heal)
            events = await run
            role = deployment.workers[picked].role
            failed = [w.worker_id for w in deployment.workers.values() if w.state is not WorkerState.ACTIVE]
            await deployment.change_role(picked, Role.DECODE, router)  # back, as it started
            return {"reference": reference, "events": events, "picked": picked, "role": role,
                    "failed": failed}

        result = shared.run(scenario)
        assert result["role"] is Role.PREFILL
        assert tokens(result["events"]) == result["reference"]
        assert result["events"][-1].finish_reason == "length"
        assert result["failed"] == []  # a worker in another role is not a failed worker

    def test_a_worker_in_another_role_than_the_gateway_believes_is_passed_over(
            self, shared: SharedDeployment) -> None:
        """H2: the gateway's view of a worker's role is behind the worker's own (the race the re-pick before
        submitting cannot close): the worker answers WrongRole, and the request goes on to another decode
        worker; no 503, and the worker is not taken for failed."""
        async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
            stale, other = deployment.active(Role.DECODE)
            router.book_decode(other.worker_id, 10**6)  # the pick goes to `stale`
            prompt = random_prompts([16], 1000, seed=11)[0]
            reference = tokens(await events_of(router, "reference-passed", prompt, GREEDY))
            await stale.client.set_role(Role.PREFILL)  # behind the deployment's back: it still says decode
            events = await events_of(router, "passed-over", prompt, GREEDY)
            # Back, as it started: the actor's new front knows no peer until the deployment wires it again.
            await stale.client.set_role(Role.DECODE)
            await deployment.wiring.connect([stale])
            return {"reference": reference, "events": events, "state": stale.state}

        result = shared.run(scenario)
        assert tokens(result["events"]) == result["reference"]
        assert result["state"] is WorkerState.ACTIVE

    def test_a_cancelled_role_change_or_drain_puts_the_worker_back(self, shared: SharedDeployment,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
        """H1: a change or drain waiting for a worker's stream is cancelled (auto turned off, the request
        handler gone): the worker is ACTIVE in its old role again, the target as it was, and it serves on.
        Meanwhile the worker says what it still holds (emptying); and a change whose calls to the worker go
        unanswered ends within the call bound, rolled back, instead of holding the fleet's changes for
        good."""
        monkeypatch.setattr(drain, "CALL_TIMEOUT_S", 1.0)

        async def scenario(deployment: PDDeployment, router: Router) -> dict[str, Any]:
            decodes = deployment.active(Role.DECODE)
            await asyncio.gather(*(call_on(w, faults.slow_steps, 0.1) for w in decodes))
            target = dict(deployment.target)
            stream = asyncio.ensure_future(events_of(router, "held", random_prompts([20], 1000)[0], LONG))
            await until(lambda: any(router.decode_tokens.values()))
            [held] = [deployment.workers[w] for w, n in router.decode_tokens.items() if n > 0]
            seen = []
            # Booked at pick time, before its prefill: wait until the worker decodes it, or a change started
            # now would send the request elsewhere (a worker changing role takes no new request) and succeed.
            for _ in range(3000):
                if (await held.client.load()).num_running:
                    break
                await asyncio.sleep(0.02)
            # First, while the stream surely runs: the change says what it waits for; cancelled, rolled back.
            change = asyncio.ensure_future(deployment.change_role(held.worker_id, Role.PREFILL, router,
                                                                  grace_s=200))
            await until(lambda: held.emptying.startswith("1 requests"))
            emptying = held.emptying
            change.cancel()
            await asyncio.gather(change, return_exceptions=True)
            seen.append((held.state, held.role, held.next_role, dict(deployment.target) == target))
            for leave in (lambda: deployment.change_role(held.worker_id, Role.PREFILL, router,
                                                         grace_s=200),
                          lambda: deployment.drain_worker(held.worker_id, router, grace_s=200)):
                task = asyncio.ensure_future(leave())
                await until(lambda: held.state is not WorkerState.ACTIVE)
                seen.append(held.state)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                seen.append((held.state, held.role, held.next_role, dict(deployment.target) == target))
            held.client.handle.__ray_call__.remote(faults.hang_loads, 3.0)
            started = time.monotonic()
            unanswered = await asyncio.gather(
                deployment.change_role(held.worker_id, Role.PREFILL, router, grace_s=200),
                return_exceptions=True)
            unanswered_s = time.monotonic() - started
            await call_on(held, faults.heal)
            seen.append((held.state, held.role, held.next_role, dict(deployment.target) == target))
            events = await stream
            await asyncio.gather(*(call_on(w, faults.heal) for w in decodes))
            return {"seen": seen, "events": events, "in": held.worker_id in deployment.workers,
                    "emptying": emptying, "after": held.emptying, "unanswered": unanswered[0],
                    "unanswered_s": unanswered_s}

        result = shared.run(scenario)
        back = (WorkerState.ACTIVE, Role.DECODE, None, True)
        assert result["seen"] == [back, WorkerState.CHANGING_ROLE, back, WorkerState.DRAINING, back, back]
        assert result["emptying"].startswith("1 requests, ") and "tokens on their way" in result["emptying"]
        assert result["after"] == ""
        assert isinstance(result["unanswered"], TimeoutError) and "no answer" in str(result["unanswered"])
        assert result["unanswered_s"] < 10
        assert result["in"] and len(tokens(result["events"])) == 120
