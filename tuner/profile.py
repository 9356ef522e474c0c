"""profile.json: what `pdserve tune profile` measured on one worker, and what `plan` reads back.

A Profile is written once (measure.py builds it) and read by the planner; it carries the fits the simulator
prices forwards and transfers with, the raw points they came from (so a fit can be questioned later), and
the worker's engine settings the simulator must mirror (block size, KV blocks, the step's token budget).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from tuner.fits import StepModel, StepPoint, TransferPoint

PROFILE_VERSION = 1


@dataclass(frozen=True)
class WorkerShape:
    """The engine settings of the profiled worker that scheduling depends on."""

    block_size: int  # tokens per KV block
    num_blocks: int  # KV blocks one worker holds
    block_bytes: int  # bytes of one block (all layers, K and V): what a transfer moves per block
    max_num_batched_tokens: int  # tokens one forward may carry (the prefill chunk budget)
    max_num_seqs: int  # requests one forward may carry (new admissions stop there)


@dataclass(frozen=True)
class Profile:
    model: str  # the model's name as a server lists it (its directory's name)
    model_dir: str  # where it was loaded from
    vocab_size: int  # token ids a load generator may send it
    hardware: str  # CPU model and threads, or the GPU's name
    device: str  # "cpu" or "cuda[:N]"
    dtype: str  # "float32" or "bfloat16"
    shape: WorkerShape
    transfer_method: str  # how transfer times were measured (a real backend, or a memcpy stand-in)
    fits: StepModel
    steps: tuple[StepPoint, ...]  # raw forward timings
    transfers: tuple[TransferPoint, ...]  # raw transfer timings
    created: str  # ISO time of the measurement

    def save(self, path: Path) -> None:
        data = {
            "version": PROFILE_VERSION,
            **{f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("shape", "fits",
                                                                                     "steps", "transfers")},
            "shape": asdict(self.shape),
            "fits": self.fits.to_dict(),
            "steps": [asdict(p) for p in self.steps],
            "transfers": [asdict(p) for p in self.transfers],
        }
        path.write_text(json.dumps(data, indent=1))


def load_profile(path: str | Path) -> Profile:
    """Read a profile.json.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a profile this version writes (the message names the file and the problem).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict) or data.get("version") != PROFILE_VERSION:
        raise ValueError(f"{path}: not a pdserve profile (version {PROFILE_VERSION}); "
                         "write one with `pdserve tune profile`")
    try:
        shape = WorkerShape(**data["shape"])
        profile = Profile(
            model=str(data["model"]), model_dir=str(data["model_dir"]), vocab_size=int(data["vocab_size"]),
            hardware=str(data["hardware"]),
            device=str(data["device"]), dtype=str(data["dtype"]), shape=shape,
            transfer_method=str(data["transfer_method"]), fits=StepModel.from_dict(data["fits"]),
            steps=tuple(StepPoint(**p) for p in data["steps"]),
            transfers=tuple(TransferPoint(**p) for p in data["transfers"]), created=str(data["created"]),
        )
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"{path}: malformed profile ({type(error).__name__}: {error})") from None
    if min(shape.block_size, shape.num_blocks, shape.block_bytes, shape.max_num_batched_tokens,
           shape.max_num_seqs) < 1:
        raise ValueError(f"{path}: worker shape values must be >= 1, got {shape}")
    return profile
