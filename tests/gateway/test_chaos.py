"""The chaos run, short (issue 19's acceptance test): a real server (local Ray, tiny Llama, nixl) under mixed
traffic for about 75 s while a driver changes layouts, toggles the ratio controller (also mid-move), SIGKILLs
busy workers and sets a drain grace past the drain timeout (tests/reliability/chaoslib/). Every invariant
holds: each request ends within its deadline with all its tokens (greedy ones equal to transformers') or a
clear error; no worker stays outside `active` past its bound; the last accepted layout is reached; 0 KV blocks
are used once idle. The bounds are generous hang bounds, never speed targets."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import psutil
import pytest

from gateway.config import ServeConfig
from tests.helpers.servers import MODEL, free_port, serving
from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.report import write_report
from tests.reliability.chaoslib.run import run_chaos

pytestmark = pytest.mark.slow

CHAOS = ChaosConfig(
    duration_s=75.0, rate=3.0, first_kill_s=6.0, fault_min_s=2.0, fault_max_s=6.0, max_workers=3,
    max_greedy_tokens=48, state_bound_s=45.0, settle_s=40.0, hang_grace_s=15.0,
    # Deadlines that catch a hang within the test's time: slack 20 s a stage, 0.25 s an output token.
    deadline_slack_s=20.0, deadline_decode_s_per_token=0.25,
    rss_growth_limit_mib=None,  # the gateway shares this process with the clients: its RSS says little
)


def test_chaos_keeps_every_invariant_under_kills_layout_changes_and_auto_toggles(
        tiny_chat_model_dir: Path, ray_local: None, tmp_path: Path) -> None:
    pytest.importorskip("nixl")
    config = ServeConfig(
        model=str(tiny_chat_model_dir), served_model_name=MODEL, dtype="float32", backend="nixl", prefill=1,
        decode=1, port=free_port(), kv_cache_mib=8, max_num_batched_tokens=64,
        deadline_slack_s=CHAOS.deadline_slack_s,
        deadline_prefill_s_per_token=CHAOS.deadline_prefill_s_per_token,
        deadline_decode_s_per_token=CHAOS.deadline_decode_s_per_token)
    me = psutil.Process()

    def owns(pid: int) -> bool:  # Ray's processes (and so the workers) are this process's descendants
        return any(child.pid == pid for child in me.children(recursive=True))

    with serving(config) as (url, _):
        result = asyncio.run(run_chaos(CHAOS, ChaosTarget(url, tiny_chat_model_dir, os.getpid(), owns)))
    _, text = write_report(result, tmp_path / "chaos")
    assert result.num_busy_kills >= 1, text
    assert result.num_migrations >= 1, text
    assert sum(r.outcome == "ok" and r.kind == "greedy" for r in result.records) > 0, text
    assert not result.violations, text
