"""The model body as one compiled graph per worker (`--compile {auto,on,off}`), or eager where it cannot be.

    compile_body(body, mode, ...) → torch.compile (inductor, fullgraph, the token dimension dynamic)
        → warm-up: one forward at 1 token and one at 2 (the two graphs a step can need: inductor
          specialises a size of 1, every larger count shares the dynamic graph) → the body + CompileReport
    a failure at any point: "on" → CompileError naming --compile; "auto" → the eager body, the reason logged.
    in_background (a serving worker under "auto"): the eager body at once, its report `compiling`; the
        runner then compiles on a thread of its own (BackgroundCompile) and swaps the compiled body in
        between two forwards. A worker serves from its load, not after its compile: a worker added under
        a burst, or replacing a failed one, serves at once (`--scale auto`, SmolLM2 bf16, a 2-core Intel:
        3 s after the decision instead of 29-31 s; eager and slower until the swap).
The warm-up runs with no step context, so attention computes nothing (llm_engine/custom_ops.py) and no KV
block is touched. Inductor's on-disk caches (FX graphs, AOT autograd, generated C++/Triton) go to
$TORCHINDUCTOR_CACHE_DIR, which defaults here to ~/.cache/pdserve/inductor (not torch's /tmp default, which a
container loses): a restart with a warm cache re-traces but does not re-generate code. On KubeRay, mount a
volume there (deploy/README.md, "The compile cache on every node").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch
from torch import nn

from llm_engine.hardware import cpu_has_native_bf16

logger = logging.getLogger(__name__)

CACHE_DIR_ENV = "TORCHINDUCTOR_CACHE_DIR"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "pdserve" / "inductor"
# The token counts the warm-up compiles for: 1 (a lone decode: its own graph) and 2 (the dynamic graph that
# serves every larger batch).
WARMUP_TOKENS = (1, 2)
# vLLM's CPU options (its wheel, 2026-12): no size/NaN asserts in the generated code, epilogue fusion, and
# OpenMP threads chosen at run time (a worker's thread count is set after import).
INDUCTOR_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {
    "size_asserts": False,
    "nan_asserts": False,
    "epilogue_fusion": True,
    "cpp.dynamic_threads": True,
}
# Dynamo keeps one graph per value of the body's integer attributes (a layer's q_size: per model, per rank
# share) under one code object, LeanBody.forward, for the whole process; past its default of 8 the next
# compile fails under fullgraph. A worker compiles one body, but a process that builds engines of several
# models or ranks (a library user, the test suite) meets it.
RECOMPILE_LIMIT = 64

Body = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class CompileMode(StrEnum):
    AUTO = "auto"  # compile the engine's own body; a failure falls back to eager with the reason logged
    ON = "on"  # compile, and refuse to start if it fails
    OFF = "off"  # eager


class CompileError(RuntimeError):
    """--compile on, and the body did not compile (the message says why)."""


@dataclass(frozen=True)
class CompileReport:
    """What runs a worker's forward, and why."""

    requested: str  # the --compile value
    compiled: bool
    body: str  # "lean" (the engine's own body, llm_engine/lean_model.py) or "transformers"
    reason: str  # one line
    seconds: float  # compile and warm-up (0 when eager)
    cache_dir: str | None  # inductor's cache directory, when compiled
    compiling: bool = False  # compiling beside serving (eager until it is done)

    @property
    def mode(self) -> str:
        """What the worker's info shows: "compiled", "compiling", "eager"."""
        return "compiled" if self.compiled else "compiling" if self.compiling else "eager"


def inductor_cache_dir() -> str:
    """$TORCHINDUCTOR_CACHE_DIR, set to pdserve's default when unset (before inductor first reads it)."""
    os.environ.setdefault(CACHE_DIR_ENV, str(DEFAULT_CACHE_DIR))
    return os.environ[CACHE_DIR_ENV]


def _warm_up(compiled: Body, device: torch.device) -> None:
    from llm_engine.custom_ops import step_context

    with torch.inference_mode(), step_context(None):
        for num_tokens in WARMUP_TOKENS:
            ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
            compiled(ids, torch.arange(num_tokens, device=device))


def auto_declines(device: torch.device, dtype: torch.dtype, native_bf16: bool | None = None) -> str | None:
    """Why `--compile auto` runs eager here, or None where it compiles: on CUDA (a step is thousands of small
    kernel launches eager) and on a CPU in bf16 with native bf16 (elementwise work and module overhead were a
    third of a step there, issue 30's profile). Elsewhere on a CPU the compiled body gains on decode only,
    and costs minutes of start-up: SmolLM2 on an AVX2 AMD, 1 thread (docs/results/engine_step.md,
    2026-12-03), fp32 decode 1@256 64.5 → 57.2 ms and 16@256 190 → 184, prefill
    unchanged; each start 130-150 s (52 s with a warm cache in bf16) against 2-3 s eager. So auto keeps
    eager there, and `--compile on` is the choice for a server that runs long."""
    if device.type == "cuda":
        return None
    native = cpu_has_native_bf16() if native_bf16 is None else native_bf16
    if dtype == torch.bfloat16 and native:
        return None
    return (f"auto: eager on a CPU in {str(dtype).removeprefix('torch.')}"
            + ("" if dtype == torch.bfloat16 else " (compiled measured no faster there)")
            + ("" if native else ", without native bfloat16") + "; --compile on compiles anyway")


def compile_body(body: nn.Module | None, requested: CompileMode | str, device: torch.device,
                 dtype: torch.dtype = torch.float32, no_lean_reason: str | None = None,
                 compiler: Callable[[nn.Module], Body] | None = None, in_background: bool = False,
                 ) -> tuple[Body | None, CompileReport]:
    """The body to run each forward with, and the report.

    Args:
        body: the engine's own body, or None where the family has none (then `no_lean_reason` says why).
        compiler: what compiles (tests inject a failing one); torch.compile with inductor by default.
        in_background: under "auto", where it compiles: nothing compiled here; the eager body, and a report
            `compiling` (the runner hands it to BackgroundCompile).

    Returns:
        (the compiled body, or `body` itself when eager, or None when there is no lean body), report.

    Raises:
        CompileError: `requested` is "on" and compilation or its warm-up failed, or there is no lean body.
    """
    requested = CompileMode(requested)
    if body is None:
        reason = no_lean_reason or "no lean body for this model family"
        if requested is CompileMode.ON:
            raise CompileError(f"--compile on: {reason}; use --compile auto or off")
        return None, CompileReport(requested.value, False, "transformers", reason, 0.0, None)
    if requested is CompileMode.OFF:
        return body, CompileReport(requested.value, False, "lean", "asked for", 0.0, None)
    declined = auto_declines(device, dtype) if requested is CompileMode.AUTO else None
    if declined:
        return body, CompileReport(requested.value, False, "lean", declined, 0.0, None)
    cache_dir = inductor_cache_dir()
    if in_background and requested is CompileMode.AUTO:
        return body, CompileReport(requested.value, False, "lean", "inductor, compiling beside serving "
                                   "(eager until it is done)", 0.0, cache_dir, compiling=True)
    return _compile_now(body, requested, device, compiler)


def _compile_now(body: nn.Module, requested: CompileMode, device: torch.device,
                 compiler: Callable[[nn.Module], Body] | None) -> tuple[Body, CompileReport]:
    """Compile and warm up `body`; a failure: CompileError under "on", the eager body and why under "auto"."""
    cache_dir = inductor_cache_dir()
    start = time.perf_counter()
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    try:
        compiled = (compiler or _inductor)(body)
        _warm_up(compiled, device)
    except Exception as error:  # any failure of the compiler is a slower worker, never a dead one (auto)
        reason = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300]
        if requested is CompileMode.ON:
            raise CompileError(f"--compile on: the model body did not compile ({reason}); "
                               "use --compile auto to fall back to eager") from error
        logger.warning("compiling the model body failed, running it eager (--compile auto): %s", reason)
        return body, CompileReport(requested.value, False, "lean", f"compile failed: {reason}", 0.0, None)
    seconds = time.perf_counter() - start
    logger.info("model body compiled in %.1f s (inductor cache %s)", seconds, cache_dir)
    return compiled, CompileReport(requested.value, True, "lean", "inductor, one graph per step",
                                   seconds, cache_dir)


class BackgroundCompile:
    """Compiles an eager body on a thread of its own while the worker serves with it (compile_body's
    `in_background`); `swap(body, report)` is called from that thread once it is done: the compiled body, or
    the eager one again with the reason it stays so. The warm-up runs with no step context on this thread
    (the step context is per thread: llm_engine/custom_ops.py), so the forwards beside it are untouched."""

    def __init__(self, body: nn.Module, device: torch.device, swap: Callable[[Body, CompileReport], None],
                 compiler: Callable[[nn.Module], Body] | None = None) -> None:
        self._body, self._device, self._swap, self._compiler = body, device, swap, compiler
        self._thread = threading.Thread(target=self._run, name="compile-beside-serving", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the compile (and the swap); False if it still runs after `timeout_s`."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        self._swap(*_compile_now(self._body, CompileMode.AUTO, self._device, self._compiler))


def _inductor(body: nn.Module) -> Body:
    compiled: Body = torch.compile(body, backend="inductor", fullgraph=True, dynamic=True,
                                   options=INDUCTOR_OPTIONS)
    return compiled
