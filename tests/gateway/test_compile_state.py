"""A worker that compiles its body beside serving (llm_engine/compilation.py) tells the fleet when the
compiled body is in: the fleet's every-second load poll (gateway/fleet/recovery.py) updates the worker's
runtime (what /admin/pools and pdserve:worker_runtime_info show) and says so, once.

No Ray: the fleet's table is a plain namespace holding one Worker whose client answers load() as the actor
does.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from gateway.fleet.recovery import Recovery
from gateway.fleet.workers import Worker, WorkerState
from worker_runtime.info import WorkerRuntime
from worker_runtime.load import WorkerLoad
from worker_runtime.roles import Role

RUNTIME = WorkerRuntime("bfloat16", "onednn-packed", "probe", 1.5, "paged-kernel", "compiling",
                        "lean body: inductor, compiling beside serving (eager until it is done)", 1, (0,),
                        4096, 100, 1600, 1 << 20, "given")


class Answers:
    """The actor's load() as it runs: compiling, then compiled."""

    def __init__(self) -> None:
        self.mode, self.reason = "compiling", RUNTIME.compile_reason

    async def load(self) -> WorkerLoad:
        return WorkerLoad("w0", Role.MIXED, 0, 0, 0, 0, 100, 100, 0, compile=self.mode,
                          compile_reason=self.reason)


def test_the_fleet_learns_when_a_body_compiled_beside_serving_is_in() -> None:
    answers = Answers()
    worker = Worker("w0", Role.MIXED, answers, WorkerState.ACTIVE, runtime=RUNTIME)  # type: ignore[arg-type]
    changes: list[None] = []
    table = SimpleNamespace(workers={"w0": worker}, changed=lambda: changes.append(None))
    recovery = Recovery(table, step_watchdog_s=0.0)  # type: ignore[arg-type]
    asyncio.run(recovery.loads())
    assert worker.runtime.compile == "compiling" and not changes  # as it started
    answers.mode, answers.reason = "compiled", "lean body: inductor, one graph per step"
    asyncio.run(recovery.loads())
    asyncio.run(recovery.loads())
    assert worker.runtime.compile == "compiled" and worker.runtime.compile_reason == answers.reason
    assert len(changes) == 1 and worker.state is WorkerState.ACTIVE  # told once; nothing else moved
