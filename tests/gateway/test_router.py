"""The router without Ray: least-loaded choice, and a bonus for the prefix a prefill worker likely holds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from gateway.fleet.config import DeploymentConfig
from gateway.fleet.workers import Worker, WorkerState
from gateway.requests.router import DecoderShape, LocalPrefillPolicy, Router, streams_to_clear
from llm_engine import EngineConfig
from worker_runtime.roles import Role


@dataclass
class FakeDeployment:
    """Just what the router reads of a PDDeployment (the test's data, not the product)."""

    workers: list[Worker]
    config: DeploymentConfig = field(
        default_factory=lambda: DeploymentConfig(EngineConfig("m", block_size=4)))
    on_remove: list[Callable[[str], None]] = field(default_factory=list)

    @property
    def block_size(self) -> int:
        return self.config.engine.block_size

    def active(self, *roles: Role) -> list[Worker]:
        return [w for w in self.workers if w.role in roles and w.state is WorkerState.ACTIVE]


def make_router() -> Router:
    workers = [Worker(name, Role(name.split("-")[0]), None, WorkerState.ACTIVE)  # type: ignore[arg-type]
               for name in ("prefill-0", "prefill-1", "decode-2", "decode-3")]
    return Router(FakeDeployment(workers))  # type: ignore[arg-type]


def test_least_loaded_workers_are_chosen() -> None:
    router = make_router()
    router.decode_tokens["decode-2"] = 100
    router.prefill_tokens["prefill-0"] = 50
    assert router.pick_decode().worker_id == "decode-3"
    assert router.pick_prefill(tuple(range(10))).worker_id == "prefill-1"


def test_what_is_on_its_way_to_a_worker_is_named_with_where_it_is() -> None:
    """A drain that waits for the routers' books says which requests hold them, and where each is now."""
    router = make_router()
    router.book_decode("decode-2", 78, "req-a")
    router.stages["req-a"] = "waiting for a prefill worker"
    router.book_prefill("decode-2", 30, "req-b")  # a mixed worker prefilling a prompt for itself
    assert router.in_flight("decode-2") == 108
    assert router.on_the_way("decode-2") == ("req-a (78 tokens): waiting for a prefill worker; "
                                              "req-b (30 tokens): between stages")
    router.unbook_decode("decode-2", 78, "req-a")
    router.unbook_prefill("decode-2", 30, "req-b")
    assert router.in_flight("decode-2") == 0 and router.on_the_way("decode-2") == ""


def test_a_shared_prefix_goes_back_to_the_worker_that_cached_it() -> None:
    router = make_router()
    system_prompt = tuple(range(100, 140))  # 10 blocks of 4
    first = router.pick_prefill((*system_prompt, 1, 2, 3))
    # The other worker is now less loaded by 30 tokens, but the first holds 40 tokens of this prefix.
    router.prefill_tokens[first.worker_id] += 30
    assert router.pick_prefill((*system_prompt, 7, 8)).worker_id == first.worker_id
    # An unrelated prompt goes to the less loaded worker.
    assert router.pick_prefill(tuple(range(500, 540))).worker_id != first.worker_id
    # --prefill-routing load: the same prompt goes to the least loaded worker, its prefix notwithstanding.
    router.local_prefill = LocalPrefillPolicy(prefix_aware=False)
    assert router.pick_prefill((*system_prompt, 7, 8)).worker_id != first.worker_id


def test_a_long_prompt_goes_to_the_mixed_worker_with_the_least_to_protect() -> None:
    """Worker A decodes three short streams (fewer tokens booked), B one long prompt: a short request goes to
    A (the fewest tokens), a long prompt to B, where its chunks stall no short stream."""
    workers = [Worker(name, Role.MIXED, None, WorkerState.ACTIVE)  # type: ignore[arg-type]
               for name in ("mixed-a", "mixed-b")]
    router = Router(FakeDeployment(workers))  # type: ignore[arg-type]
    for _ in range(3):
        router.book_decode("mixed-a", 64 + 300)
    router.book_decode("mixed-b", 1500 + 16)
    assert router.pick_decode(num_prompt_tokens=64).worker_id == "mixed-a"
    assert router.pick_decode(num_prompt_tokens=1500).worker_id == "mixed-b"
    # Off (0), or for a request moving with its tokens (no prompt to prefill): the fewest tokens.
    router.local_prefill = LocalPrefillPolicy(isolate_prompts_from_tokens=0)
    assert router.pick_decode(num_prompt_tokens=1500).worker_id == "mixed-a"
    router.unbook_decode("mixed-b", 1500 + 16)
    assert router.decode_requests["mixed-b"] == 0


def test_draining_workers_are_not_chosen() -> None:
    router = make_router()
    router.fleet.workers[3].state = WorkerState.DRAINING  # type: ignore[attr-defined]
    router.decode_tokens["decode-2"] = 10**6
    assert router.pick_decode().worker_id == "decode-2"



def test_the_queue_rule_keeps_long_prompts_in_the_prefill_pool_when_bounded() -> None:
    """As the ratio controller sets it: a short prompt behind a long queue is prefilled locally, a long one
    still goes to the prefill pool; unbounded, any size goes local."""
    router = make_router()
    router.prefill_tokens.update({"prefill-0": 1500, "prefill-1": 1200})
    short, long = tuple(range(200)), tuple(range(1000, 2500))
    router.local_prefill = LocalPrefillPolicy(min_prefill_queue_tokens=1024, queue_rule_below_tokens=1024)
    assert "prefill queue: 1200 tokens" in router.local_prefill_reason(short)
    assert router.local_prefill_reason(long) == ""
    router.local_prefill = LocalPrefillPolicy(min_prefill_queue_tokens=1024)
    assert router.local_prefill_reason(long) != ""
    router.prefill_tokens["prefill-1"] = 1000  # one worker has room: nothing goes local
    assert router.local_prefill_reason(short) == ""


def test_a_long_prompt_clears_its_host_of_streams_first() -> None:
    """Placement on a pure model of the workers: a long prompt bound for a worker decoding streams moves
    them off it (to another decode or mixed worker); a short prompt is prefilled beside them; with no other
    worker, or the rule off, nothing moves."""
    policy = LocalPrefillPolicy(move_streams_from_tokens=1024)
    host = DecoderShape("mixed-a", num_requests=3, streams=("s1", "s2", "s3"))
    other = DecoderShape("mixed-b", num_requests=4, streams=("t1", "t2", "t3", "t4"))
    assert streams_to_clear(host, [other], 1500, policy) == ("s1", "s2", "s3")
    assert streams_to_clear(host, [other], 200, policy) == ()
    assert streams_to_clear(host, [], 1500, policy) == ()
    assert streams_to_clear(host, [other], 1500, LocalPrefillPolicy(move_streams_from_tokens=0)) == ()


def test_the_router_moves_streams_and_short_prompts_not_long_ones() -> None:
    """A long prompt's host is cleared of its streams and of short prompts waiting there (the worker hands
    back only those not started), never of another long prompt (it would bounce between workers). A request
    asked to move off no longer counts as beside the long prompt (the ratio controller is not woken for it),
    and once it has left it is an ordinary request again."""
    workers = [Worker(name, Role.MIXED, FakeClient(ids), WorkerState.ACTIVE)  # type: ignore[arg-type]
               for name, ids in (("mixed-a", ["s1", "p1", "q1"]), ("mixed-b", ["t1"]))]
    router = Router(FakeFleet(workers))  # type: ignore[arg-type]
    router.start_local_prefill("mixed-a", "p1", 300)
    router.start_local_prefill("mixed-a", "q1", 1500)
    host, other = workers
    assert router.streams_to_clear(host, 300) == ()
    assert router.longest_prefill_beside_streams() == 1500  # q1 and p1 are prefilled beside the stream s1
    assert router.streams_to_clear(host, 2000) == ("s1", "p1")
    router.start_local_prefill("mixed-a", "long", 2000)
    assert router.longest_prefill_beside_streams() == 0  # s1 and p1 are on their way out
    assert router.streams_to_clear(host, 2000) == ()  # and not asked twice
    for moved in ("s1", "p1"):  # they left for mixed-b ...
        host.client.ids.remove(moved)
        other.client.ids.append(moved)
    router.end_local_prefill("mixed-a", "p1")
    router.streams_to_clear(host, 2000)
    assert router._moving_off == {}  # ... and are forgotten


class FakeFleet:
    """Just what the router reads of a fleet whose workers are found by id (the test's data)."""

    def __init__(self, workers: list[Worker]) -> None:
        self.workers = {w.worker_id: w for w in workers}
        self.on_remove: list[Callable[[str], None]] = []
        self.block_size = 4

    def active(self, *roles: Role) -> list[Worker]:
        return [w for w in self.workers.values() if w.role in roles and w.state is WorkerState.ACTIVE]


@dataclass
class FakeClient:
    """The request ids a worker client has subscribed (the test's data)."""

    ids: list[str]

    def request_ids(self) -> list[str]:
        return self.ids
