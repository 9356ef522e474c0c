"""SoakConfig: the settings of one soak run, read once from the command line (benchmarks/soak.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SoakConfig:
    duration_s: float
    out_dir: Path
    model: str | None  # None: tiny random Llama; "default": SmolLM2; else a model directory
    num_prefill: int
    num_decode: int
    rate: float  # requests/s, Poisson
    cancel_fraction: float  # of requests the client gives up on
    kill_every_s: float  # 0: no kills
    warmup_s: float
    sample_every_s: float
    hang_after_s: float  # a request still open this long after it left is hung
    settle_s: float  # how long to wait at the end for used KV blocks to reach 0
    seed: int
    serve_args: tuple[str, ...]  # extra `pdserve serve` flags
    num_ray_cpus: int = 0  # CPUs the Ray head offers; 0: one per starting worker + 1
    kill_busy: bool = False  # kill only a worker with requests running (waits up to kill_every_s for one)
