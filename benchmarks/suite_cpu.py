"""Where the test suite's CPU goes: every process's CPU, charged to the test module its pytest worker ran.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/suite_cpu.py [pytest args ...]   # default: the whole suite
A sampler reads every process's CPU time from /proc twice a second while pytest runs on two xdist workers;
a pytest plugin (benchmarks/suite_cpu/module_log_plugin.py) logs when each worker starts each test. Each
process belongs to the worker whose PYTEST_XDIST_WORKER it inherited (its Ray, actors, subprocesses); the
worker processes themselves are the two `-c import sys;exec(...)` ones. Prints CPU-seconds by process kind,
by module, and by module and kind. Costs a whole suite run (~25 min on 2 cores); raw files under
benchmarks/results/suite_cpu/.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "suite_cpu"
HZ = os.sysconf("SC_CLK_TCK")


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def sample(stop: threading.Event, out_path: Path) -> None:
    """Every 0.5 s: each process's cumulative CPU; a process's worker and command line when first seen."""
    seen: dict[str, str] = {}
    with out_path.open("w") as out:
        while not stop.is_set():
            rows = {}
            for pid in filter(str.isdigit, os.listdir("/proc")):
                try:
                    stat = _read(f"/proc/{pid}/stat").decode()
                    rest = stat[stat.rindex(")") + 2:].split()
                    rows[pid] = (int(rest[11]) + int(rest[12])) / HZ
                    cmd = _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace")[:200]
                    if seen.get(pid) != cmd:  # new, or Ray retitled it (ray::IDLE → ray::WorkerActor)
                        env = _read(f"/proc/{pid}/environ").split(b"\0")
                        worker = next((e.split(b"=", 1)[1].decode() for e in env
                                       if e.startswith(b"PYTEST_XDIST_WORKER=")), "")
                        if pid not in seen or not worker:
                            worker = worker or ("self" if int(pid) == os.getpid() else "")
                        out.write(json.dumps({"pid": pid, "worker": worker, "cmd": cmd}) + "\n")
                        seen[pid] = cmd
                except (OSError, ValueError):
                    pass
            out.write(json.dumps({"t": time.time(), "cpu": rows}) + "\n")
            time.sleep(0.5)


def kind(cmd: str) -> str:
    if cmd.startswith("ray::"):
        title = cmd.split()[0]
        if "FleetActor" in title or "supervised" in title:
            return "fleet actor"
        if "Worker" in title or "pdserve-worker" in title or "pdserve-fleet" in title:
            return "worker actor (serving)"
        return "worker actor (starting: ray::IDLE)" if "IDLE" in title else title.split("(")[0][:40]
    if "exec(eval(sys.stdin.readline()))" in cmd:
        return "pytest worker"
    for name in ("gcs_server", "raylet", "log_monitor", "dashboard", "runtime_env", "monitor.py",
                 "default_worker", "cc1plus", "pdserve", "ray start"):
        if name in cmd:
            return name
    return cmd.split()[0].rsplit("/", 1)[-1] if cmd else "?"


def analyse(samples: Path, module_logs: list[Path]) -> str:
    starts: dict[str, tuple[list[float], list[str]]] = {}
    worker_of_pid: dict[str, str] = {}
    for log in module_logs:
        rows = [line.split(" ", 1) for line in log.read_text().splitlines()]
        worker_of_pid.update({n.split()[1]: log.stem for _, n in rows if n.startswith("PID ")})
        rows = [(t, n) for t, n in rows if not n.startswith("PID ")]
        starts[log.stem] = ([float(t) for t, _ in rows], [n.split("::")[0] for _, n in rows])
    procs: dict[str, tuple[str, str]] = {}
    prev: dict[str, float] = {}
    by_kind: collections.Counter[str] = collections.Counter()
    by_module: collections.Counter[str] = collections.Counter()
    by_both: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in samples.read_text().splitlines():
        row = json.loads(line)
        if "pid" in row:
            worker = row["worker"] or procs.get(row["pid"], ("", ""))[0]
            procs[row["pid"]] = (worker, row["cmd"])
            continue
        for pid, cpu in row["cpu"].items():
            spent, prev[pid] = cpu - prev.get(pid, 0.0), cpu
            worker, cmd = procs.get(pid, ("", ""))
            what = kind(cmd)
            worker = worker or worker_of_pid.get(pid, "")  # xdist names a worker after its exec
            if not worker or worker == "self":
                continue
            times, names = starts.get(worker, ([], []))
            i = bisect.bisect_right(times, row["t"]) - 1
            module = names[i] if i >= 0 else "(collection)"
            by_kind[what] += spent
            by_module[module] += spent
            by_both[(module, what)] += spent
    lines = [f"total {sum(by_kind.values()):.0f} CPU-s", "", "by process kind:"]
    lines += [f"{v:8.1f}  {k}" for k, v in by_kind.most_common(20)]
    lines += ["", "by module:"] + [f"{v:8.1f}  {k}" for k, v in by_module.most_common(40)]
    lines += ["", "by module and kind:"] + [f"{v:8.1f}  {m}  {k}" for (m, k), v in by_both.most_common(40)]
    return "\n".join(lines)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("gw*.log"):
        old.unlink()
    stop = threading.Event()
    sampler = threading.Thread(target=sample, args=(stop, OUT / "samples.jsonl"), daemon=True)
    sampler.start()
    env = {**os.environ, "PDSERVE_SUITE_CPU_LOGS": str(OUT),
           "PYTHONPATH": os.pathsep.join([str(HERE / "suite_cpu"), os.environ.get("PYTHONPATH", "")])}
    args = sys.argv[1:] or ["-q", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder"]
    began = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "module_log_plugin", *args], env=env,
                            check=False)
    stop.set()
    sampler.join()
    report = analyse(OUT / "samples.jsonl", sorted(OUT.glob("gw*.log")))
    (OUT / "report.txt").write_text(report)
    print(f"pytest exited {result.returncode} after {time.monotonic() - began:.0f} s\n{report}")


if __name__ == "__main__":
    main()
