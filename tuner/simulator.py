"""A discrete-event simulation of this system's policies over a trace, for one layout of workers.

A request's way (the gateway's, gateway/requests/service.py and gateway/requests/orchestrator.py):
    ARRIVE → admission (gateway/requests/admission.py: reserve prompt + max_tokens of decode KV, FIFO line
    bounded in
      requests and tokens, a timeout; an oversize request is refused) → route (gateway/requests/router.py:
      the decode
      or mixed worker with the fewest tokens of requests decoding there, or for a long prompt the mixed
      worker with the fewest such requests; then, unless that worker is mixed or no prefill worker exists,
      the prefill worker with the fewest prompt tokens in flight)
    → prefill worker (one hop) → first token → gateway (one hop; the client sees it) → decode worker (one
      hop) → pull → decode → each token to the gateway (one hop) → last token: reservation released.
    A mixed worker (or a decode worker with no prefill pool) gets the request directly and prefills it itself.
Workers are in sim_workers.py. Events are (time, is_last, seq, callback, argument) in one heap; a worker's
forward is one event whatever its batch, so a plan of hundreds of layouts runs in seconds. Not modelled:
prefix-cache hits (the load generator's prompts are random), request deadlines (far looser than any SLO),
worker failures, the decode step's token budget when more requests decode than it holds (never, at 512).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from loadgen.workload import RequestShape
from tuner.fits import StepModel
from tuner.profile import WorkerShape
from tuner.sim_workers import DecodeWorkerSim, PrefillWorkerSim, SimRequest

# One Ray actor call or reply plus the gateway's own work around it (the actor round trip alone is ~0.8 ms
# here, DESIGN.md); every stage boundary of a request crosses one.
DEFAULT_HOP_S = 0.001
PREFILL_SLICE_MIN_TOKENS = 16  # worker_runtime/prefill_slicer.py's floor


@dataclass(frozen=True, order=True)
class Layout:
    """How many workers of each kind (the body of PUT /admin/pools)."""

    prefill: int
    decode: int
    mixed: int = 0

    @property
    def num_workers(self) -> int:
        return self.prefill + self.decode + self.mixed

    @property
    def can_serve(self) -> bool:
        """Someone prefills and someone decodes: the gateway's rule for a layout (gateway/fleet/config.py
        can_serve), written again here because the tuner never imports the gateway."""
        return self.prefill + self.mixed >= 1 and self.decode + self.mixed >= 1

    def label(self) -> str:
        parts = [f"{n}{k}" for n, k in ((self.prefill, "P"), (self.decode, "D"), (self.mixed, "M")) if n]
        return "+".join(parts) or "none"

    def to_dict(self) -> dict[str, int]:
        return {"prefill": self.prefill, "decode": self.decode, "mixed": self.mixed}


@dataclass(frozen=True)
class SimConfig:
    """The serving settings the simulation mirrors; the gateway's own defaults are passed in, not copied."""

    shape: WorkerShape  # each worker's engine (from the profile)
    watermark: float  # fraction of decode blocks kept free when admitting (gateway/fleet/config.py)
    max_waiting: int  # requests that may wait for decode KV capacity (gateway/config.py)
    queue_timeout_s: float  # how long one may wait before a 429
    hop_s: float = DEFAULT_HOP_S
    # Seconds of prompt work a step may add beside decoding requests (EngineConfig's; 0: no limit).
    max_prefill_s_beside_decode: float = 0.0
    # A prompt this long goes to the mixed worker with the fewest requests (the router's LocalPrefillPolicy
    # isolate_prompts_from_tokens; 0: off). No default: the gateway's (gateway/requests/router.py
    # LONG_PROMPT_TOKENS) is handed in by whoever simulates it, so that the bound has one home.
    isolate_prompts_from_tokens: int = field(kw_only=True)
    # ... and the streams decoding there move to the other workers first (move_streams_from_tokens; 0: off).
    move_streams_from_tokens: int = field(kw_only=True)

    def __post_init__(self) -> None:
        is_valid = 0.0 <= self.watermark < 1.0 and self.max_waiting >= 0 and self.hop_s >= 0
        if not is_valid or self.queue_timeout_s <= 0:
            raise ValueError(f"invalid simulation settings: {self}")

    def prefill_slice_tokens(self, model: StepModel) -> int | None:
        """Prompt tokens a step may carry beside decoding requests, at the fitted cost of a chunk of the
        forward's whole budget (the worker measures the same cost from its own steps)."""
        if self.max_prefill_s_beside_decode <= 0:
            return None
        chunk = self.shape.max_num_batched_tokens
        per_token_s = model.step_s(0, 0, chunk, chunk * chunk) / chunk
        return max(PREFILL_SLICE_MIN_TOKENS, min(chunk, int(self.max_prefill_s_beside_decode / per_token_s)))

    @property
    def max_request_tokens(self) -> int:
        """KV tokens one decode worker holds for requests (less its watermark): admission's unit."""
        return int(self.shape.num_blocks * self.shape.block_size * (1.0 - self.watermark))


@dataclass(frozen=True)
class SimResult:
    """What a run would have measured, per request (seconds, client-side) and per token."""

    layout: Layout
    arrival_s: tuple[float, ...]  # when each request was sent
    ttft_s: tuple[float | None, ...]  # None: it failed (refused or timed out in admission's line)
    e2e_s: tuple[float | None, ...]
    num_output_tokens: tuple[int, ...]
    itl_steps: tuple[tuple[float, int], ...]  # (gap, tokens that had it): a step's tokens share its length
    itl_gaps: tuple[float, ...]  # gaps of single tokens (a request's first decode token, recomputations)
    backlog: tuple[tuple[float, int], ...]  # (arrival time, requests in the system then, that one included)
    num_preemptions: int
    busy_s: dict[str, float]  # kind ("prefill", "decode", "mixed") → seconds its workers ran forwards, summed


class Simulation:
    def __init__(self, layout: Layout, config: SimConfig, model: StepModel) -> None:
        if not layout.can_serve:
            raise ValueError(f"layout {layout.label()} cannot serve: it needs a prefill or mixed worker "
                             "and a decode or mixed worker")
        self.layout, self.config, self.model = layout, config, model
        shape, watermark, prefill_slice = config.shape, config.watermark, config.prefill_slice_tokens(model)
        self.prefills = [PrefillWorkerSim(self, f"prefill-{i}", shape) for i in range(layout.prefill)]
        self.decodes = [DecodeWorkerSim(self, f"decode-{i}", shape, False, watermark, prefill_slice)
                        for i in range(layout.decode)]
        self.decodes += [DecodeWorkerSim(self, f"mixed-{i}", shape, True, watermark, prefill_slice)
                         for i in range(layout.mixed)]
        # The router's counts: prompt tokens sent to each prefill worker and not back; tokens of requests
        # decoding on each decode or mixed worker.
        self.prefill_tokens = dict.fromkeys(self.prefills, 0)
        self.decode_tokens: dict[DecodeWorkerSim, int] = dict.fromkeys(self.decodes, 0)
        self.decode_requests: dict[DecodeWorkerSim, int] = dict.fromkeys(self.decodes, 0)
        self.capacity = config.max_request_tokens * len(self.decodes)
        self.reserved = self.waiting_tokens = 0
        self.line: deque[SimRequest] = deque()
        self.num_in_system = 0
        self._heap: list[tuple[float, bool, int, Callable[[Any, float], None], Any]] = []
        self._seq = itertools.count()
        self.itl_steps: list[tuple[float, int]] = []
        self.itl_gaps: list[float] = []
        self.backlog: list[tuple[float, int]] = []
        self.num_preemptions = 0
        self._requests: list[SimRequest] = []

    def at(self, time: float, callback: Callable[[Any, float], None], argument: Any, *,
           is_last: bool = False) -> None:
        """Call callback(argument, time) then; `is_last`: after every other event of that instant."""
        heapq.heappush(self._heap, (time, is_last, next(self._seq), callback, argument))

    def run(self, requests: Sequence[RequestShape]) -> SimResult:
        self._requests = [SimRequest(i, s.arrival_s, s.input_len, s.output_len)
                          for i, s in enumerate(requests)]
        if self._requests:
            self.at(self._requests[0].arrival, self._arrive, self._requests[0])
        heap, pop = self._heap, heapq.heappop
        while heap:
            time, _, _, callback, argument = pop(heap)
            callback(argument, time)
        hop = self.config.hop_s
        done = [r for r in self._requests if not r.error]
        if any(r.last_token < 0 for r in done):
            raise RuntimeError("simulation ended with requests unfinished")  # a policy bug, not a result
        return SimResult(
            self.layout,
            tuple(r.arrival for r in self._requests),
            tuple(None if r.error else r.first_token + hop - r.arrival for r in self._requests),
            tuple(None if r.error else r.last_token + hop - r.arrival for r in self._requests),
            tuple(0 if r.error else r.output_len for r in self._requests),
            tuple(self.itl_steps), tuple(self.itl_gaps), tuple(self.backlog), self.num_preemptions,
            {"prefill": sum(w.busy_s for w in self.prefills),
             "decode": sum(w.busy_s for w in self.decodes if not w.is_mixed),
             "mixed": sum(w.busy_s for w in self.decodes if w.is_mixed)},
        )

    # Gateway: admission.
    def _arrive(self, r: SimRequest, now: float) -> None:
        if r.index + 1 < len(self._requests):
            following = self._requests[r.index + 1]
            self.at(following.arrival, self._arrive, following)
        if r.reserved > self.config.max_request_tokens:
            r.error = "prompt + max_tokens exceed one decode worker's KV (400)"
        elif not self.line and self.reserved + r.reserved <= self.capacity:
            self._admit(r, now)
        elif len(self.line) >= self.config.max_waiting or (
                self.line and self.waiting_tokens + r.reserved > self.capacity):
            r.error = "admission line full (429)"
        else:
            self.line.append(r)
            self.waiting_tokens += r.reserved
        if not r.error:
            self.num_in_system += 1
        self.backlog.append((now, self.num_in_system))

    def _release(self, r: SimRequest, now: float) -> None:
        self.reserved -= r.reserved
        self.num_in_system -= 1
        while self.line:
            head = self.line[0]
            if now - head.arrival > self.config.queue_timeout_s:  # it gave up (429) while capacity was short
                self.line.popleft()
                self.waiting_tokens -= head.reserved
                self.num_in_system -= 1
                head.error = "no KV capacity within the queue timeout (429)"
                continue
            if self.reserved + head.reserved > self.capacity:
                return
            self.line.popleft()
            self.waiting_tokens -= head.reserved
            self._admit(head, now)

    # Gateway: routing and the hops between stages.
    def _admit(self, r: SimRequest, now: float) -> None:
        self.reserved += r.reserved
        threshold = self.config.isolate_prompts_from_tokens
        mixed = [d for d in self.decodes if d.is_mixed]
        if threshold and r.prompt >= threshold and mixed:
            decode = min(mixed, key=lambda d: (self.decode_requests[d], self.decode_tokens[d]))
            moving = self.config.move_streams_from_tokens
            if moving and r.prompt >= moving and len(self.decodes) > 1:
                self._clear(decode, now)
        else:
            decode = min(self.decodes, key=self.decode_tokens.__getitem__)
        r.decode_worker = decode
        if decode.is_mixed or not self.prefills:
            self.decode_tokens[decode] += r.reserved
            self.decode_requests[decode] += 1
            self.at(now + self.config.hop_s, decode.submit_local, r)
            return
        prefill = min(self.prefills, key=self.prefill_tokens.__getitem__)
        r.prefill_worker = prefill
        self.prefill_tokens[prefill] += r.prompt
        self.at(now + self.config.hop_s, prefill.submit, r)

    def _clear(self, host: DecodeWorkerSim, now: float) -> None:
        """Move the streams decoding on `host` to the other workers before it prefills a long prompt."""
        others = [d for d in self.decodes if d is not host]
        for moved in host.movable():
            host.hand_back(moved, now)
            target = min(others, key=self.decode_tokens.__getitem__)
            self.decode_tokens[host] -= moved.reserved
            self.decode_requests[host] -= 1
            self.decode_tokens[target] += moved.reserved
            self.decode_requests[target] += 1
            moved.decode_worker = target
            self.at(now + 2 * self.config.hop_s, target.submit_handoff, moved)

    def prefill_done(self, r: SimRequest, now: float) -> None:
        r.first_token = r.last_token = now
        r.num_emitted = 1
        self.at(now + self.config.hop_s, self._prefill_result, r)

    def _prefill_result(self, r: SimRequest, now: float) -> None:
        assert r.prefill_worker is not None and r.decode_worker is not None
        self.prefill_tokens[r.prefill_worker] -= r.prompt
        if r.output_len == 1:  # the first token ends it: no handoff, the prefill blocks are freed at once
            r.prefill_worker.release(r, now)
            r.decode_worker = None
            self._done(r, now)
            return
        self.decode_tokens[r.decode_worker] += r.reserved
        self.decode_requests[r.decode_worker] += 1
        self.at(now + self.config.hop_s, r.decode_worker.submit_handoff, r)

    def pull_done(self, r: SimRequest, now: float) -> None:
        if r.kv_tokens:  # a moved stream: its source freed its blocks when it handed it back
            return
        assert r.prefill_worker is not None
        r.prefill_worker.release(r, now)

    def first_token(self, r: SimRequest, now: float) -> None:
        r.first_token = now

    def finish(self, r: SimRequest, now: float) -> None:
        r.last_token = now
        self.at(now + self.config.hop_s, self._done, r)

    def _done(self, r: SimRequest, now: float) -> None:
        if r.decode_worker is not None:
            self.decode_tokens[r.decode_worker] -= r.reserved
            self.decode_requests[r.decode_worker] -= 1
        self._release(r, now)


def simulate(layout: Layout, requests: Sequence[RequestShape], config: SimConfig, model: StepModel
             ) -> SimResult:
    """Run one layout over the requests to the end (every request finished or failed)."""
    return Simulation(layout, config, model).run(requests)
