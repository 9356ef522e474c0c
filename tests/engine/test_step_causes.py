"""A forward far slower than the worker's recent median names its cause in its step record (GET
/admin/workers/{id}/steps) and the log (issue 49): here a full garbage collection during one forward of a real
engine (the tiny random Llama)."""

from __future__ import annotations

import gc
import logging
from pathlib import Path
from typing import Any

import pytest

from llm_engine.params import SamplingParams
from llm_engine.step_causes import slow_cause
from tests.helpers.engines import make_engine


def test_a_forward_stalled_by_a_collection_says_so(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
                                                   ) -> None:
    engine = make_engine(tiny_llama_dir)
    runner = engine.runner
    execute = runner._execute
    calls = [0]
    junk = [[i] for i in range(1_500_000)]  # tracked objects: a full collection walks them all

    def collecting(batch: Any) -> Any:
        calls[0] += 1
        if calls[0] == 16:
            gc.collect()
        return execute(batch)

    runner._execute = collecting  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING, logger="llm_engine.model_runner"):
        engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    del junk
    steps = runner.timeline.since()
    slow = [s for s in steps if s.slow_cause]
    assert [s.slow_cause.split(" ")[:2] for s in slow] == [["garbage", "collection"]], slow
    assert slow[0].gc_ms >= 0.5 * slow[0].duration_ms and slow[0] is steps[15]
    assert "the recent median" in caplog.text and "garbage collection" in caplog.text


def test_the_cause_named_is_a_compile_first_then_gc_then_neither() -> None:
    assert slow_cause(900.0, 800.0, 2).startswith("compiled 2 graph(s)")
    assert slow_cause(900.0, 800.0, 0) == "garbage collection 800 ms"
    assert slow_cause(900.0, 100.0, 0).startswith("not gc (100 ms), not a compile")
