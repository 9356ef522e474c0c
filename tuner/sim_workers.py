"""(Over 300 lines: the prefill and the decode simulation share one step-budget scheduler, _Worker; apart
they would import each other.)

The simulated workers: the step loops of prefill_pool/worker.py and decode_pool/worker.py, priced by fits.

A worker runs forwards back to back while it has work and idles otherwise; what arrives while a forward
runs waits for the next step's start (the real workers drain their inbox there). Each forward's batch is
what llm_engine/scheduler.py would build, within the same budgets:
    running requests first (decode tokens, then chunks of prompts already started), then admissions from
    WAITING while the token budget, `max_num_seqs` and free blocks (less the watermark, when something
    runs) last; no admission in a step that preempted; when blocks for the decode tokens run short the
    newest running request is preempted (blocks freed, re-queued at the front, recomputed later); while any
    request decodes, prompt tokens also fit the slice that max_prefill_s_beside_decode buys at the fitted
    prefill cost per token (worker_runtime/prefill_slicer.py does the same from measured steps).
Prefill worker: WAITING → RUNNING (chunks) → first token; its blocks stay held until the decode side's pull
    ends (the lease), so a backed-up decode pool stalls prefill, as in the real system.
Decode worker: AWAITING_BLOCKS (a handed-off request; a pull starts when its prompt's blocks plus the
    watermark are free) → TRANSFERRING → joins RUNNING at the next step. A mixed worker (and a decode worker
    when no prefill worker exists) puts the prompt in WAITING and prefills it in chunks inside its steps.
The decode batch is kept in aggregate so a step costs O(1), not O(batch): a request joining at step j with
`ctx0` tokens of KV attends to ctx0 + (s - j) + 1 tokens at step s and takes a new block when
ctx0 + (s - j) is a multiple of the block size, so counts per residue (ctx0 - j) mod block_size say how
many blocks a step takes, and a heap of last-token steps says who finishes.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from tuner.fits import StepModel
    from tuner.profile import WorkerShape


class SimEvents(Protocol):
    """What the workers call back (tuner/simulator.py Simulation, which imports this module): its clock, the
    step prices, the request lifecycle's events, and the counters a step adds to."""

    model: StepModel
    num_preemptions: int
    itl_gaps: list[float]
    itl_steps: list[tuple[float, int]]

    def at(self, time: float, callback: Callable[[Any, float], None], argument: Any, *,
           is_last: bool = False) -> None: ...
    def prefill_done(self, r: SimRequest, now: float) -> None: ...
    def pull_done(self, r: SimRequest, now: float) -> None: ...
    def first_token(self, r: SimRequest, now: float) -> None: ...
    def finish(self, r: SimRequest, now: float) -> None: ...


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class SimRequest:
    """One request's state across the simulated system (plain slots: millions of touches per plan)."""

    __slots__ = ("arrival", "blocks", "chunk", "computed", "ctx0", "decode_worker", "emitted_at_join",
                 "error", "first_token", "index", "join_step", "kv_tokens", "last_token", "num_emitted",
                 "output_len", "prefill_worker", "prompt", "reserved", "to_compute", "version")

    def __init__(self, index: int, arrival: float, prompt: int, output_len: int) -> None:
        self.index, self.arrival, self.prompt, self.output_len = index, arrival, prompt, output_len
        self.reserved = prompt + output_len  # admission's reservation and the router's decode load
        self.first_token = -1.0  # worker time of the first token (-1: none yet)
        self.last_token = -1.0  # worker time of the latest token
        self.error = ""  # why the request failed (admission), empty if it did not
        self.num_emitted = 0  # output tokens produced (as of the last time it left the decode batch)
        self.to_compute = prompt  # tokens a (re)computation must prefill: prompt + outputs so far
        self.computed = 0  # of those, done
        self.chunk = 0  # tokens of it in the current forward
        self.blocks = 0  # blocks held where it prefills (decode-side blocks of a decoding one are implicit)
        self.ctx0 = self.join_step = self.emitted_at_join = 0
        self.version = 0  # bumped on preemption or a move: stale finish-heap entries are skipped
        self.kv_tokens = 0  # tokens of KV a pull brings: 0, its prompt's; a moved stream's, all but its last
        self.prefill_worker: PrefillWorkerSim | None = None
        self.decode_worker: DecodeWorkerSim | None = None


class _Worker:
    def __init__(self, sim: SimEvents, name: str, shape: WorkerShape) -> None:
        self.sim, self.name = sim, name
        self.block_size, self.budget, self.max_num_seqs = (shape.block_size, shape.max_num_batched_tokens,
                                                           shape.max_num_seqs)
        self.num_free = shape.num_blocks
        self.block_bytes = shape.block_bytes
        self.waiting: deque[SimRequest] = deque()  # engine WAITING
        self.prefilling: list[SimRequest] = []  # RUNNING, prompt not yet computed
        self.is_busy = False
        self.is_waking = False
        self.busy_s = 0.0  # time spent in forwards (utilization, for the plan's reasoning)

    def wake(self, now: float) -> None:
        if not self.is_busy and not self.is_waking:
            # The step starts after every other event of this instant: the real loop drains its whole inbox
            # when it wakes, so requests that arrive together are batched together.
            self.is_waking = True
            self.sim.at(now, self._woken, None, is_last=True)

    def _woken(self, _: object, now: float) -> None:
        self.is_waking = False
        if not self.is_busy:
            self.begin(now)

    def begin(self, now: float) -> None:
        raise NotImplementedError

    def _schedule_prefill(self, budget: int, reserve: int, num_running: int) -> tuple[int, int, int]:
        """Chunks for started prompts, then admissions; returns (tokens, attention pairs, budget left)."""
        tokens = pairs = 0
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(r.to_compute - r.computed, budget)
            extra = blocks_for(r.computed + n, self.block_size) - r.blocks
            if extra > self.num_free:
                break  # the engine would preempt here; rare enough with admission's reservations
            self.num_free -= extra
            r.blocks += extra
            r.chunk = n
            tokens += n
            pairs += n * (r.computed + n)
            budget -= n
        while self.waiting and budget > 0 and num_running + len(self.prefilling) < self.max_num_seqs:
            r = self.waiting[0]
            n = min(r.to_compute, budget)
            needed = blocks_for(n, self.block_size)
            if needed + (reserve if num_running or self.prefilling else 0) > self.num_free:
                break
            self.waiting.popleft()
            self.num_free -= needed
            r.blocks, r.computed, r.chunk = needed, 0, n
            self.prefilling.append(r)
            tokens += n
            pairs += n * n
            budget -= n
        return tokens, pairs, budget

    def _finish_chunks(self) -> list[SimRequest]:
        """Advance the forward's chunks; returns the requests whose computation is complete."""
        done = []
        for r in self.prefilling:
            if r.chunk:
                r.computed += r.chunk
                r.chunk = 0
                if r.computed == r.to_compute:
                    done.append(r)
        if done:
            self.prefilling = [r for r in self.prefilling if r.computed < r.to_compute]
        return done


class PrefillWorkerSim(_Worker):
    """prefill_pool/worker.py: chunked prefill; blocks held from admission to the end of the pull."""

    def submit(self, r: SimRequest, now: float) -> None:
        self.waiting.append(r)
        self.wake(now)

    def release(self, r: SimRequest, now: float) -> None:
        """The pull ended (or no pull will come): the lease's blocks return."""
        self.num_free += r.blocks
        r.blocks = 0
        self.wake(now)

    def begin(self, now: float) -> None:
        tokens, pairs, _ = self._schedule_prefill(self.budget, 0, 0)
        self.is_busy = tokens > 0
        if self.is_busy:
            duration = self.sim.model.step_s(0, 0, tokens, pairs)
            self.busy_s += duration
            self.sim.at(now + duration, self.end, None)

    def end(self, _: object, now: float) -> None:
        for r in self._finish_chunks():
            self.sim.prefill_done(r, now)
        self.begin(now)


class DecodeWorkerSim(_Worker):
    """decode_pool/worker.py over the engine scheduler; `is_mixed`: a colocated worker."""

    def __init__(self, sim: SimEvents, name: str, shape: WorkerShape, is_mixed: bool, watermark: float,
                 prefill_slice: int | None) -> None:
        super().__init__(sim, name, shape)
        self.is_mixed = is_mixed
        self.watermark_blocks = int(watermark * shape.num_blocks)
        self.prefill_slice = prefill_slice  # None: no slicing
        self.awaiting: deque[SimRequest] = deque()  # AWAITING_BLOCKS
        self.num_transferring = 0
        self.arrived: list[SimRequest] = []  # pulls done; they join RUNNING at the next step
        self.joining: list[SimRequest] = []  # prompts finished this step; they decode from the next
        self.decoding: dict[SimRequest, None] = {}  # RUNNING decode requests, in join order
        self.finish_heap: list[tuple[int, int, int, SimRequest]] = []  # (last step, index, version, r)
        self.num_decoding = 0
        self.key_sum = 0  # Σ (ctx0 - join_step): the batch's context at step s is key_sum + B·(s + 1)
        self.residue = [0] * self.block_size  # decoding requests per (ctx0 - join_step) mod block_size
        self.step = 0

    def submit_handoff(self, r: SimRequest, now: float) -> None:
        self.awaiting.append(r)
        self.wake(now)

    def submit_local(self, r: SimRequest, now: float) -> None:
        self.waiting.append(r)
        self.wake(now)

    def transfer_done(self, r: SimRequest, now: float) -> None:
        self.num_transferring -= 1
        self.arrived.append(r)
        self.sim.pull_done(r, now)
        self.wake(now)

    def _start_pulls(self, now: float) -> None:
        while self.awaiting:
            r = self.awaiting[0]
            busy = self.num_decoding or self.prefilling or self.waiting or self.num_transferring
            needed = blocks_for(r.kv_tokens or r.prompt, self.block_size)
            if needed + (self.watermark_blocks if busy else 0) > self.num_free:
                return
            self.awaiting.popleft()
            self.num_free -= needed
            self.num_transferring += 1
            size = needed * self.block_bytes
            self.sim.at(now + self.sim.model.transfer_s(size), self.transfer_done, r)

    def _join(self, r: SimRequest, step: int) -> None:
        r.ctx0, r.join_step, r.emitted_at_join = r.prompt + r.num_emitted - 1, step, r.num_emitted
        key = r.ctx0 - step
        self.decoding[r] = None
        self.num_decoding += 1
        self.key_sum += key
        self.residue[key % self.block_size] += 1
        last_step = step + r.output_len - r.num_emitted - 1
        heapq.heappush(self.finish_heap, (last_step, r.index, r.version, r))

    def _leave(self, r: SimRequest, step: int) -> int:
        """Take a decoding request out of the batch after `step - 1`; returns the blocks it held."""
        key = r.ctx0 - r.join_step
        del self.decoding[r]
        self.num_decoding -= 1
        self.key_sum -= key
        self.residue[key % self.block_size] -= 1
        r.num_emitted = r.emitted_at_join + step - r.join_step
        return blocks_for(r.ctx0 + step - r.join_step, self.block_size)

    def movable(self) -> list[SimRequest]:
        """The decoding requests that can move off this worker (the router's streams_to_clear): each with at
        least two tokens to go after the step under way."""
        after = self.step + self.is_busy
        return [r for r in self.decoding if r.output_len - (r.emitted_at_join + after - r.join_step) >= 2]

    def hand_back(self, r: SimRequest, now: float) -> None:
        """Move a decoding request off this worker after the step under way, its KV offered to the next."""
        self.num_free += self._leave(r, self.step + self.is_busy)
        r.version += 1
        r.last_token = now
        r.kv_tokens = r.prompt + r.num_emitted - 1

    def _preempt_newest(self, now: float) -> None:
        newest_decoding = next(reversed(self.decoding)) if self.decoding else None
        if self.prefilling and (newest_decoding is None or self.prefilling[-1].index > newest_decoding.index):
            r = self.prefilling.pop()
            self.num_free += r.blocks
        else:
            assert newest_decoding is not None
            r = newest_decoding
            self.num_free += self._leave(r, self.step)
            r.version += 1
            r.last_token = now
        r.blocks = r.computed = r.chunk = 0
        r.to_compute = r.prompt + r.num_emitted
        self.waiting.appendleft(r)
        self.sim.num_preemptions += 1

    def begin(self, now: float) -> None:
        self._start_pulls(now)
        step = self.step
        joined = self.arrived + self.joining
        for r in joined:
            self._join(r, step)
        self.arrived, self.joining = [], []
        needed = self.residue[-step % self.block_size]
        is_preempted = False
        while needed > self.num_free and (self.decoding or self.prefilling):
            self._preempt_newest(now)
            is_preempted = True
            needed = self.residue[-step % self.block_size]
        batch = self.num_decoding
        self.num_free -= needed
        context = self.key_sum + batch * (step + 1)
        budget = max(0, self.budget - batch)
        if batch and self.prefill_slice is not None:
            budget = min(budget, self.prefill_slice)
        if is_preempted:  # no admission in a step that preempted: the freed blocks are the victims'
            waiting, self.waiting = self.waiting, deque()
            tokens, pairs, _ = self._schedule_prefill(budget, self.watermark_blocks, batch)
            self.waiting = waiting
        else:
            tokens, pairs, _ = self._schedule_prefill(budget, self.watermark_blocks, batch)
        self.is_busy = bool(batch or tokens)
        if not self.is_busy:
            return
        duration = self.sim.model.step_s(batch, context, tokens, pairs)
        self.busy_s += duration
        end = now + duration
        num_joined = 0
        for r in joined:  # their first decode token's gap runs from their previous token
            if r in self.decoding:
                self.sim.itl_gaps.append(end - r.last_token)
                num_joined += 1
        self.sim.itl_steps.append((duration, batch - num_joined))
        self.sim.at(end, self.end, None)

    def end(self, _: object, now: float) -> None:
        step = self.step
        heap = self.finish_heap
        while heap and heap[0][0] == step:
            _, _, version, r = heapq.heappop(heap)
            if version != r.version or r not in self.decoding:
                continue
            self.num_free += self._leave(r, step + 1)
            self.sim.finish(r, now)
        for r in self._finish_chunks():
            if r.num_emitted == 0:
                self.sim.first_token(r, now)
            else:
                self.sim.itl_gaps.append(now - r.last_token)
            r.num_emitted += 1
            r.last_token = now
            if r.num_emitted >= r.output_len:
                self.num_free += r.blocks
                self.sim.finish(r, now)
            else:
                self.num_free += r.blocks - blocks_for(r.to_compute, self.block_size)  # kept for decoding
                self.joining.append(r)
            r.blocks = 0
        self.step += 1
        self.begin(now)
