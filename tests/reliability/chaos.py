"""Chaos benchmark (issue 19's acceptance run): a real `pdserve serve` under mixed traffic while a driver
changes layouts, toggles the ratio controller (also mid-move), SIGKILLs busy workers and sets a drain grace
past the drain timeout; invariants are checked throughout and at the end.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/chaos.py --duration-s 300 --out benchmarks/results/chaos

The deployed configuration (issue 31): `--frontends 2` serves with `--api-server-count 2 --fleet-name chaos`
and also SIGKILLs and SIGSTOPs (4, 6, 12, 15 s) frontends, sends loop-heavy bursts (80 large distinct
schemas, MiB-sized /tokenize), SIGKILLs and SIGSTOPs (6, 12 s) the fleet actor, SIGSTOPs busy workers,
sends one prompt as two tenants with different cache salts (no block shared: tenants.py), and plants faults in
the workers and their KV transfers through Ray (hung and raising steps, a query of death, stalled pulls,
lost releases with expiring leases, a peer of another KV layout, forged claims:
tests/reliability/chaoslib/worker_faults.py); each kind at least --min-each times. Every request opens its own
connection (the frontends share one listening socket).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/chaos.py --frontends 2 --duration-s 600 --out ...

A run, in order:
  1. starts its own Ray head and `pdserve serve --address` on it (soaklib/cluster.py: its own
     ports and temp dir), 1 prefill + 1 decode, nixl, float32, serving a tiny random Llama with SmolLM2's
     tokenizer (--model default: SmolLM2 itself; --model DIR); with --frontends N, waits for N frontends;
  2. computes the greedy reference with transformers on the same model in float32;
  3. runs chaoslib/run.py: --duration-s of Poisson traffic (short and long prompts, streamed and
     not, greedy / sampled / chat, client cancellations, clients that stop reading mid-stream) and faults;
  4. checks the invariants (tests/reliability/chaoslib/: every request ends within its deadline with all its
     tokens, greedy-identical, or a clear error (or, its connection struck by a frontend fault, cut); no
     worker outside `active` past its bound; no worker replaced but by a fault that may kill one; /health
     503 within 15 s of a fleet kill, 200 again within 120 s; the last accepted layout reached; 0 KV
     blocks used once idle; the gateway's RSS flat);
  5. writes summary.md, summary.json, requests.jsonl, events.jsonl, server.log and ray_head.log under --out
     (a worker replaced for no fault: the server log's lines naming it, in the violation), prints
     summary.md, and stops only the processes it started.
Exit status 1 when an invariant was violated.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.reliability.chaoslib.config import ChaosConfig, ChaosTarget
from tests.reliability.chaoslib.departures import server_log_lines
from tests.reliability.chaoslib.driver import WEIGHTS
from tests.reliability.chaoslib.report import write_report
from tests.reliability.chaoslib.run import ChaosResult, run_chaos
from tests.reliability.soaklib.cluster import BIN, REPO, SoakSystem, prepare_model
from tests.reliability.soaklib.config import SoakConfig


def parse_args() -> tuple[ChaosConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    default = ChaosConfig()
    parser.add_argument("--duration-s", type=float, default=default.duration_s)
    parser.add_argument("--out", default="benchmarks/results/chaos")
    parser.add_argument("--model", default=None,
                        help="model dir, or 'default' (SmolLM2); default: tiny Llama")
    parser.add_argument("--prefill", type=int, default=1, help="prefill workers at start")
    parser.add_argument("--decode", type=int, default=1, help="decode workers at start")
    parser.add_argument("--max-workers", type=int, default=default.max_workers,
                        help="workers in a random layout, at most")
    parser.add_argument("--rate", type=float, default=default.rate, help="requests/s (Poisson)")
    parser.add_argument("--seed", type=int, default=default.seed)
    parser.add_argument("--state-bound-s", type=float, default=default.state_bound_s,
                        help="how long a worker may stay outside active (plus its change's grace)")
    parser.add_argument("--settle-s", type=float, default=default.settle_s)
    parser.add_argument("--fault-min-s", type=float, default=default.fault_min_s)
    parser.add_argument("--fault-max-s", type=float, default=default.fault_max_s)
    parser.add_argument("--skip-fault", action="append", default=[], choices=list(WEIGHTS),
                        help="a fault kind never drawn, repeatable")
    parser.add_argument("--frontends", type=int, default=1,
                        help="N > 1: serve with --api-server-count N --fleet-name chaos, and draw the "
                        "frontend, fleet and hung-worker faults too")
    parser.add_argument("--min-each", type=int, default=None,
                        help="each fault kind at least this often where time allows (default: 2 with "
                        "--frontends N > 1, else 0)")
    parser.add_argument("--serve-arg", action="append", default=[],
                        help="extra `pdserve serve` flag, repeatable (e.g. --serve-arg=--kv-cache-mib=64)")
    a = parser.parse_args()
    config = ChaosConfig(duration_s=a.duration_s, seed=a.seed, rate=a.rate, max_workers=a.max_workers,
                         state_bound_s=a.state_bound_s, settle_s=a.settle_s, fault_min_s=a.fault_min_s,
                         fault_max_s=a.fault_max_s, skip_faults=tuple(a.skip_fault),
                         num_frontends=a.frontends,
                         min_each_fault=a.min_each if a.min_each is not None else 2 * (a.frontends > 1))
    return config, a


def has_serve_flag(flag: str) -> bool:
    """Whether this checkout's `pdserve serve` knows `flag` (a run against an older commit: the report of the
    code before a fix is made with the same harness)."""
    pdserve = [str(BIN / "pdserve")] if (BIN / "pdserve").exists() else [sys.executable, "-m", "pdserve"]
    help_text = subprocess.run([*pdserve, "serve", "--help"], capture_output=True, text=True, cwd=REPO).stdout
    return flag in help_text


def serve_args(config: ChaosConfig, is_tiny: bool) -> list[str]:
    """float32 (greedy parity with transformers in batches), nixl (layouts change at runtime), and the
    deadline policy the clients' hang bounds are computed from; several frontends over a named fleet (as
    deploy/serve.multi-node.yaml runs)."""
    args = ["--dtype", "float32", "--backend", "nixl", "--deadline-slack-s", str(config.deadline_slack_s),
            "--deadline-prefill-s-per-token", str(config.deadline_prefill_s_per_token),
            "--deadline-decode-s-per-token", str(config.deadline_decode_s_per_token)]
    if is_tiny:  # prompts take several steps: workers are busy long enough to be caught busy
        args += ["--kv-cache-mib", "8", "--max-num-batched-tokens", "64"]
    if config.has_frontends:
        # The step watchdog's floor low enough that hang_step's hung worker is replaced within the run.
        args += ["--api-server-count", str(config.num_frontends), "--fleet-name", "chaos"]
        if has_serve_flag("--step-watchdog-s"):
            args += ["--step-watchdog-s", "10"]
        if has_serve_flag("--enable-prompt-tokens-details"):  # salted_tenants reads cached_tokens
            args += ["--enable-prompt-tokens-details"]
    return args


def wait_for_frontends(system: SoakSystem, num: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(system.frontend_pids()) < num:
        if time.monotonic() > deadline:
            raise SystemExit(f"{num} frontends did not come up: {system.frontend_pids()}")
        time.sleep(0.5)


def attach_server_log(result: ChaosResult, server_log: Path) -> None:
    """Each worker replaced for no fault: the server log's lines that name it (the fleet's why)."""
    for violation in result.violations:
        if violation["invariant"] == "no_healthy_worker_replaced":
            violation["server_log"] = server_log_lines(server_log, violation["worker_id"])


def main() -> None:
    config, a = parse_args()
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="pdchaos-", dir="/tmp"))
    soak = SoakConfig(config.duration_s, out_dir, a.model, a.prefill, a.decode, config.rate, 0.0, 0.0, 0.0,
                      5.0, 600.0, config.settle_s, config.seed,
                      (*serve_args(config, a.model is None), *a.serve_arg),
                      num_ray_cpus=config.max_workers + 2)  # room for replacements beside a full layout
    system = SoakSystem(soak, work_dir)
    try:
        model_dir = prepare_model(a.model, work_dir)  # step 1
        system.start_ray()
        system.start_server(model_dir)
        assert system.server is not None
        if config.has_frontends:
            wait_for_frontends(system, config.num_frontends)
        own = {p.pid for p in system.processes()}

        def owns(pid: int) -> bool:
            """A process under this run's server or Ray head, now (workers start after `own` was taken)."""
            return pid in own or pid in {p.pid for p in system.processes()}

        target = ChaosTarget(system.url, model_dir, system.server.pid, owns)
        if config.has_frontends:
            def restart_server(extra_args: tuple[str, ...]) -> float:
                system.stop_server()
                return system.start_server(model_dir, extra_args, append_log=True)

            target = ChaosTarget(system.url, model_dir, system.server.pid, owns, system.frontend_pids,
                                 system.fleet_actor_pid, f"127.0.0.1:{system.ray_port}", restart_server,
                                 lambda: system.server.pid if system.server else None, out_dir / "server.log")
        result = asyncio.run(run_chaos(config, target))  # steps 2 to 4
    except BaseException:
        print(f"the chaos run failed; Ray's logs are kept in {work_dir / 'ray'}", file=sys.stderr, flush=True)
        raise
    finally:
        system.stop()
    attach_server_log(result, out_dir / "server.log")
    _, text = write_report(result, out_dir)  # step 5
    print(text, flush=True)
    if result.violations:
        print(f"Ray's logs of this run are kept in {work_dir / 'ray'}", flush=True)
        sys.exit(1)
    shutil.rmtree(work_dir, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
