#!/usr/bin/env python3
"""Keep one command running: start it, and start it again whenever it exits or stops answering its health URL.

    python deploy/supervise.py [--health-url URL] [--grace-s S] -- pdserve serve --config ...

    start the command (its own process group) → wait: it exits, or (with --health-url) the URL has not
    answered 2xx for --unhealthy-s after the first --grace-s → its whole group gets SIGTERM, then SIGKILL
    after --stop-s → sleep the backoff (1 s, doubling to 30 s; back to 1 s after a run that lasted 10 min)
    → start it again.
    SIGTERM / SIGINT to the supervisor: the command's group gets SIGTERM (SIGKILL after --stop-s) and the
    supervisor exits with the command's status.
Why a script and not systemd: `ray up`'s docker containers and Kubernetes pods have no init system. On
Kubernetes the kubelet is the outer supervisor (the gateway container's probes restart it); on `ray up` this
script is the only one, so there it also watches /health. Standard library only: it runs before anything
else is known to work.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

MAX_BACKOFF_S = 30.0
STABLE_RUN_S = 600.0  # a run this long was healthy: the next restart starts from the shortest backoff


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return 200 <= response.status < 300
    except (urllib.error.URLError, OSError):  # HTTPError (503) is a URLError
        return False


def stop(child: subprocess.Popen[bytes], stop_s: float) -> int:
    """SIGTERM to the child's process group, SIGKILL to whatever of the group is left after stop_s; the
    child's exit status."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGTERM)
    deadline = time.monotonic() + stop_s
    while time.monotonic() < deadline and _group_alive(child.pid):
        child.poll()  # reaps the child itself, so that only the rest of its group keeps the group alive
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(child.pid, signal.SIGKILL)
    return child.wait()


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def run_once(command: list[str], args: argparse.Namespace, stopping: list[bool]) -> int:
    """One run of the command, until it exits, turns unhealthy, or the supervisor is told to stop."""
    child = subprocess.Popen(command, start_new_session=True)  # its own group: its children stop with it
    print(f"supervise: started pid {child.pid}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    last_healthy = started
    while True:
        try:
            status = child.wait(timeout=args.check_every_s)
        except subprocess.TimeoutExpired:
            pass
        else:
            # What it left behind in its group (uvicorn's frontends, a local Ray it started) would hold its
            # port and its fleet's name: the next run starts clean.
            stop(child, min(args.stop_s, 10.0))
            return status
        if stopping[0]:
            return stop(child, args.stop_s)
        if args.health_url is None:
            continue
        now = time.monotonic()
        if is_healthy(args.health_url):
            last_healthy = now
        elif now - started > args.grace_s and now - last_healthy > args.unhealthy_s:
            print(f"supervise: {args.health_url} has not answered healthy for {args.unhealthy_s:g} s; "
                  f"restarting pid {child.pid}", flush=True)
            stop(child, args.stop_s)
            return -1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--health-url", default=None,
                        help="restart the command when this stops answering 2xx")
    parser.add_argument("--grace-s", type=float, default=1200.0,
                        help="no health checks this long after each start (model load, worker placement)")
    parser.add_argument("--unhealthy-s", type=float, default=300.0,
                        help="restart after the health URL has failed this long")
    parser.add_argument("--check-every-s", type=float, default=5.0, help="how often to look")
    parser.add_argument("--stop-s", type=float, default=90.0, help="SIGTERM's grace before SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to supervise after --")

    stopping = [False]

    def on_signal(signum: int, _frame: object) -> None:
        stopping[0] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    backoff_s = 1.0
    while True:
        started = time.monotonic()
        status = run_once(command, args, stopping)
        if stopping[0]:
            return status if status >= 0 else 1
        if time.monotonic() - started > STABLE_RUN_S:
            backoff_s = 1.0
        print(f"supervise: the command ended (status {status}); starting it again in {backoff_s:g} s",
              flush=True)
        deadline = time.monotonic() + backoff_s
        while time.monotonic() < deadline and not stopping[0]:
            time.sleep(0.2)
        if stopping[0]:
            return status if status >= 0 else 1
        backoff_s = min(2 * backoff_s, MAX_BACKOFF_S)


if __name__ == "__main__":
    sys.exit(main())
