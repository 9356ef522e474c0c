"""Profiles and simulator settings with known step times (the simulator's answers can be computed by hand),
and `pdserve tune` called in-process."""

from __future__ import annotations

import argparse
import random

from gateway.requests.router import LONG_PROMPT_TOKENS
from gateway.telemetry.traffic import Arrival
from pdserve.tune import add_tune_parser
from tuner.fits import (
    DECODE_FEATURES,
    MIXED_FEATURES,
    PREFILL_FEATURES,
    TRANSFER_FEATURES,
    LinearFit,
    StepModel,
)
from tuner.profile import Profile, WorkerShape
from tuner.simulator import SimConfig, Simulation


def step_model(prefill: tuple[float, float, float] = (0.01, 0.0, 0.0),
               decode: tuple[float, float, float] = (0.005, 0.0, 0.0),
               transfer: tuple[float, float] = (0.0, 0.0)) -> StepModel:
    """Known costs: prefill a + b·tokens + c·pairs, decode a + b·batch + c·context, transfer a + b·bytes;
    a mixed forward costs the decode intercept plus both variable parts."""
    mixed = (decode[0], decode[1], decode[2], prefill[1], prefill[2])

    def fit(features: tuple[str, ...], coefficients: tuple[float, ...]) -> LinearFit:
        return LinearFit(features, coefficients, 0.0, len(features))

    return StepModel(fit(PREFILL_FEATURES, prefill), fit(DECODE_FEATURES, decode), fit(MIXED_FEATURES, mixed),
                     fit(TRANSFER_FEATURES, transfer))


def sim_config(num_blocks: int = 4096, block_size: int = 16, budget: int = 512, max_num_seqs: int = 64,
               watermark: float = 0.0, hop_s: float = 0.0) -> SimConfig:
    shape = WorkerShape(block_size, num_blocks, 1024, budget, max_num_seqs)
    return SimConfig(shape, watermark, max_waiting=100_000, queue_timeout_s=1e9, hop_s=hop_s,
                     isolate_prompts_from_tokens=LONG_PROMPT_TOKENS,
                     move_streams_from_tokens=LONG_PROMPT_TOKENS)


def profile(model: StepModel, config: SimConfig, name: str = "tiny") -> Profile:
    return Profile(name, f"/models/{name}", 1000, "test CPU", "cpu", "float32", config.shape, "synthetic",
                   model, (), (), "2026-01-01T00:00:00+00:00")


def poisson_arrivals(prompt: int, output: int, rate: float, num: int, seed: int, end: float) -> list[Arrival]:
    """`num` requests of one shape arriving as a Poisson process of `rate`, the last at about `end`."""
    rng = random.Random(seed)
    gaps = [rng.expovariate(rate) for _ in range(num)]
    start, times = end - sum(gaps), []
    for gap in gaps:
        start += gap
        times.append(start)
    return [Arrival(t, prompt, output) for t in times]


def assert_blocks_whole(sim: Simulation) -> None:
    """Every worker's KV blocks are back (nothing leaked through preemption, transfer or finish)."""
    for worker in [*sim.prefills, *sim.decodes]:
        assert worker.num_free == sim.config.shape.num_blocks, worker.name


def tune(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pdserve")
    add_tune_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tune", *argv])
    return int(args.handler(args))
