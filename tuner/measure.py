"""`pdserve tune profile --model DIR`: time the real engine's forwards and transfers, fit, build a Profile.

Every forward is the workers' own: the engine's scheduler schedules it (chunking under the token budget,
block allocation), ModelRunner.execute runs it, the scheduler's update() takes its output. Only the clock
around execute() is the profiler's. What it measures, each `repeats` times (median kept):
    prefill  whole prompts of several lengths in one forward; a long prompt cut into chunks by several budgets
    decode   batches of requests whose KV is already in their blocks (as after a transfer: add_running, so
             no prefill is needed to reach a context), at several batch sizes and contexts
    mixed    such a decode batch plus one prompt chunk in the same forward (a mixed worker's step)
    transfer the KV of n blocks between two caches of the worker's layout (transfer_probe.py)
Prefix caching is off here: a repeated prompt must cost a full prefill each time.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import torch

from llm_engine.batch import ModelInput
from llm_engine.config import EngineConfig
from llm_engine.engine import LLMEngine
from llm_engine.params import SamplingParams
from llm_engine.request import Request
from tuner.fits import StepPoint, fit_step_model
from tuner.profile import Profile, WorkerShape
from tuner.transfer_probe import measure_transfers


@dataclass(frozen=True)
class ProfileGrid:
    """Where to measure; points that do not fit the model's context or the KV cache are skipped."""

    prompt_lens: tuple[int, ...] = (16, 64, 128, 256, 512)  # whole prompts (one forward each, within budget)
    long_prompt_len: int = 1024  # prefilled in chunks of each budget below
    chunk_budgets: tuple[int, ...] = (128, 256)
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (64, 256, 1024)  # tokens per decoding request
    mixed_batches: tuple[int, ...] = (1, 4, 16)
    mixed_chunks: tuple[int, ...] = (32, 128, 256)
    mixed_context: int = 256  # tokens per decoding request in the mixed forwards
    transfer_blocks: tuple[int, ...] = (1, 4, 16, 64)
    repeats: int = 3

    def num_measurements(self) -> int:
        return (len(self.prompt_lens) + len(self.chunk_budgets)
                + len(self.decode_batches) * len(self.decode_contexts)
                + len(self.mixed_batches) * len(self.mixed_chunks) + 1)


# A grid for tests and smoke runs: seconds on the tiny model.
QUICK_GRID = ProfileGrid(prompt_lens=(8, 32, 64), long_prompt_len=96, chunk_budgets=(32,),
                         decode_batches=(1, 4, 8), decode_contexts=(16, 64), mixed_batches=(1, 4),
                         mixed_chunks=(16, 48), mixed_context=32, transfer_blocks=(1, 4), repeats=1)


def describe_hardware(device: str) -> str:
    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (CUDA)"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}; {torch.get_num_threads()} torch thread(s) of {os.cpu_count()} CPUs"


class _Timer:
    """Times the engine's forwards: schedule → execute (timed) → update, as a worker's step does."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.is_cuda = engine.config.device.startswith("cuda")
        self._ids = itertools.count()
        self._rng = random.Random(0)

    def request_id(self) -> str:
        return f"tune-{next(self._ids)}"

    def prompt(self, length: int) -> list[int]:
        return [self._rng.randrange(self.engine.spec.vocab_size) for _ in range(length)]

    def step(self) -> tuple[float, ModelInput]:
        scheduler = self.engine.scheduler
        batch = scheduler.schedule()
        if self.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        output = self.engine.runner.execute(batch)
        if self.is_cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        scheduler.update(batch, output)
        return elapsed, batch

    def add_decoding(self, batch: int, context: int) -> list[str]:
        """`batch` requests whose first `context` tokens already have KV (garbage: timing only)."""
        ids = []
        sampling = SamplingParams(max_tokens=1 << 20, temperature=0.0, ignore_eos=True)
        for _ in range(batch):
            request_id = self.request_id()
            request = Request(request_id, self.prompt(context), sampling, output_token_ids=[0])
            self.engine.kv.allocate_blocks(request_id, context)
            request.num_computed_tokens = context
            self.engine.scheduler.add_running(request)
            ids.append(request_id)
        return ids

    def abort_all(self) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.scheduler.abort(request_id)


def _point(seconds: list[float], batch: ModelInput) -> StepPoint:
    decoding = [c for c in batch.chunks if c.num_tokens == 1 and c.start_position > 0 and c.sampling]
    prefilling = [c for c in batch.chunks if c not in decoding]
    return StepPoint(statistics.median(seconds), len(decoding), sum(c.context_len for c in decoding),
                     sum(c.num_tokens for c in prefilling),
                     sum(c.num_tokens * c.context_len for c in prefilling))


def _fits(engine: LLMEngine, num_tokens: int) -> bool:
    return (num_tokens < engine.spec.max_model_len
            and engine.block_pool.can_allocate(-(-num_tokens // engine.config.block_size)))


def measure_steps(engine: LLMEngine, grid: ProfileGrid, advance: Callable[[], None]) -> list[StepPoint]:
    """Every forward of the grid; `advance` is called once per measurement (a progress bar)."""
    timer, scheduler, points = _Timer(engine), engine.scheduler, []
    budget = scheduler.max_num_batched_tokens
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # Whole prompts within the budget; then a long one chunked by smaller budgets.
    prefills = [(n, budget) for n in grid.prompt_lens if n <= budget]
    prefills += [(grid.long_prompt_len, b) for b in grid.chunk_budgets]
    for length, chunk_budget in prefills:
        if _fits(engine, length):
            scheduler.max_num_batched_tokens = chunk_budget
            by_chunk: list[list[float]] = []
            batches: list[ModelInput] = []
            for _ in range(grid.repeats):
                scheduler.add(Request(timer.request_id(), timer.prompt(length), one_token))
                chunk = 0
                while scheduler.num_unfinished:
                    elapsed, batch = timer.step()
                    if chunk == len(by_chunk):
                        by_chunk.append([])
                        batches.append(batch)
                    by_chunk[chunk].append(elapsed)
                    chunk += 1
            points += [_point(times, batch) for times, batch in zip(by_chunk, batches, strict=True)]
        advance()
    scheduler.max_num_batched_tokens = budget
    for batch_size, context in itertools.product(grid.decode_batches, grid.decode_contexts):
        if batch_size <= budget and _fits(engine, batch_size * (context + grid.repeats + 1)):
            timer.add_decoding(batch_size, context)
            times, batch = [], ModelInput(())
            for _ in range(grid.repeats):
                elapsed, batch = timer.step()
                times.append(elapsed)
            points.append(_point(times, batch))
            timer.abort_all()
        advance()
    for batch_size, chunk in itertools.product(grid.mixed_batches, grid.mixed_chunks):
        needed = batch_size * (grid.mixed_context + grid.repeats + 1) + grid.repeats * (chunk + 1)
        if _fits(engine, needed) and _fits(engine, chunk + 1):
            scheduler.max_num_batched_tokens = batch_size + chunk
            timer.add_decoding(batch_size, grid.mixed_context)
            times = []
            for _ in range(grid.repeats):
                scheduler.add(Request(timer.request_id(), timer.prompt(chunk), one_token))
                elapsed, batch = timer.step()  # the decodes plus the whole chunk; the prompt then finishes
                times.append(elapsed)
            points.append(_point(times, batch))
            timer.abort_all()
            scheduler.max_num_batched_tokens = budget
        advance()
    return points


def profile_engine(model_dir: str, config: EngineConfig, grid: ProfileGrid,
                   advance: Callable[[], None] = lambda: None, model_name: str | None = None) -> Profile:
    """Load the model as a worker does, time the grid, fit, and return the Profile (not yet written).

    `model_name`: the name the server serves it as (default: the directory's name)."""
    config = dataclasses.replace(config, model_dir=model_dir, enable_prefix_caching=False)
    engine = LLMEngine(config)
    timer = _Timer(engine)
    timer.add_decoding(1, 8)  # warm-up: first forwards allocate and pick kernels
    for _ in range(2):
        timer.step()
    timer.abort_all()
    steps = measure_steps(engine, grid, advance)
    method, transfers = measure_transfers(engine.runner.kv_cache, grid.transfer_blocks, grid.repeats)
    advance()
    if not engine.block_pool.is_whole():
        raise RuntimeError("profiling leaked KV blocks")  # a scheduler bug the profile would hide
    cache = engine.runner.cache_spec
    shape = WorkerShape(config.block_size, engine.block_pool.num_blocks, cache.block_bytes,
                        config.max_num_batched_tokens, config.max_num_seqs)
    return Profile(
        model=model_name or Path(model_dir).name, model_dir=str(model_dir), vocab_size=engine.spec.vocab_size,
        hardware=describe_hardware(config.device),
        device=config.device, dtype=config.dtype, shape=shape, transfer_method=method,
        fits=fit_step_model(steps, transfers), steps=tuple(steps), transfers=tuple(transfers),
        created=datetime.now(UTC).isoformat(timespec="seconds"),
    )
