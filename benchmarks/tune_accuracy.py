"""How good is `pdserve tune`'s prediction on this machine? (not a test)

Runs the CLI end to end on SmolLM2: profile one worker; plan 2 workers (1P+1D, 2 mixed) and 1 worker (1 mixed)
for the Azure conversation trace at a quarter of its lengths, at three rates from light to saturated; then
`tune validate` on a live server for those layouts, predicted against measured. Also plans a larger cluster
(N = 8 and 16) from the same profile for a prefill-heavy and a decode-heavy synthetic trace at one rate.
Writes everything under --out and the summary to benchmarks/results/tune.md.

    .venv/bin/python benchmarks/tune_accuracy.py [--rates 0.3,0.7,1.1] [--num-requests 30]
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.pd_vs_colocated import TRACE, start_server
from tuner.validate import Comparison, report


def pdserve(*args: str) -> str:
    """Run `pdserve ...` (the CLI as installed), echo and return its output; stop on failure."""
    command = [sys.executable, "-m", "pdserve", *args]
    print("$ pdserve", " ".join(args), flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    print(done.stdout[-4000:], done.stderr[-2000:] if done.returncode else "", flush=True)
    if done.returncode:
        raise SystemExit(f"pdserve {args[0]} {args[1]} failed ({done.returncode})")
    return done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="0.3,0.7,1.1")
    parser.add_argument("--num-requests", type=int, default=30, help="requests per measured run")
    parser.add_argument("--out", default="benchmarks/results/tune")
    parser.add_argument("--fresh", action="store_true", help="measure again what an earlier run left")
    args = parser.parse_args()
    out = Path(args.out)
    slo = ["--ttft-slo", "3", "--itl-slo", "0.2"]
    trace = ["--trace", str(TRACE), "--length-scale", "0.25"]
    sections: list[str] = []

    profile = str(out / "profile" / "profile.json")
    if not Path(profile).exists() or args.fresh:  # a rerun keeps what an interrupted one measured
        pdserve("tune", "profile", "--out", str(out / "profile"), "--no-progress")
    for workers in ("2", "1"):
        sections.append(pdserve("tune", "plan", "--profile", profile, *trace, "--rates", args.rates,
                                "--num-requests", str(args.num_requests), "--workers", workers, *slo,
                                "--out", str(out / f"plan{workers}"), "--no-progress"))

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(["--prefill", "1", "--decode", "1", "--backend", "nixl"], port)
    url = f"http://127.0.0.1:{port}"
    validated = []
    try:
        for workers, layouts in (("2", "1P+1D,2M"), ("1", "1M")):
            done = out / f"validate{workers}" / "validation.json"
            if done.exists() and not args.fresh:
                validated.append(report([Comparison(c["label"], c["rate"], c["predicted"], c["measured"])
                                         for c in json.loads(done.read_text())]) + "\n")
                continue
            validated.append(pdserve("tune", "validate", "--url", url, "--plan",
                                     str(out / f"plan{workers}" / "plan.json"), "--layouts", layouts, "--out",
                                     str(out / f"validate{workers}"), "--no-progress"))
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(120)

    larger = []
    for name, lengths in (("prefill-heavy", ("2000", "50")), ("decode-heavy", ("200", "500"))):
        for workers, rate in (("8", "1.5"), ("16", "3")):
            printed = pdserve("tune", "plan", "--profile", profile, "--input-len", lengths[0], "--output-len",
                              lengths[1], "--rate", rate, "--num-requests", "200", "--workers", workers, *slo,
                              "--out", str(out / f"{name}-{workers}"), "--no-progress")
            larger.append(f"### {name} (input {lengths[0]}, output {lengths[1]}), N = {workers}, {rate} req/s"
                          f"\n\n```\n{printed}```\n")
    plans = sorted(out.glob("*/plan.json"))
    recommended = {p.parent.name: json.loads(p.read_text())["recommended"] for p in plans}
    lines = [
        f"# `pdserve tune` against measurement ({datetime.now(UTC):%Y-%m-%d})", "",
        "SmolLM2-135M fp32, 2 CPU cores, one torch thread per worker, nixl. Load: the Azure conversation "
        f"trace, lengths × 0.25, Poisson at {args.rates} req/s, {args.num_requests} requests per run; SLO "
        "TTFT ≤ 3 s, TPOT ≤ 0.2 s.", "Command: `.venv/bin/python benchmarks/tune_accuracy.py`", "",
        "## Predicted against measured (tune validate)", "",
        "```", *validated, "```", "",
        "## The plans", "", "```", *sections, "```", "",
        "## A larger cluster from the same profile", "", *larger,
        "Recommended layouts: " + json.dumps(recommended), "",
    ]
    summary = Path("benchmarks/results/tune.md")
    summary.parent.mkdir(parents=True, exist_ok=True)
    summary.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
