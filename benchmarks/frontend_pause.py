"""A frontend paused past the fleet's lease, on the default model (issue 48's acceptance; not a test).

`pdserve serve --prefill 1 --decode 1 --api-server-count 2` on SmolLM2: greedy streams are opened until each
frontend holds --streams of them (long enough to outlive the pause), then two long prompts are sent just
before the frontend holding the most streams is SIGSTOPped for --pause-s (past the fleet's 10 s lease: it is
"taken for dead", and every worker aborts what its channels carried), then SIGCONT. Every request's text is
compared with the same request's text from the unpaused server (temperature 0): whole, identical, or how it
ended. Writes OUT.json; the server log goes to --log-dir.

    .venv/bin/python benchmarks/frontend_pause.py [--pause-s 15] [--streams 4] [--max-tokens 400]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from benchmarks.vllm_baseline import stop_process_tree, wait_healthy
from benchmarks.vs_vllm import free_port

MIN_TOKEN_ID = 100


@dataclass
class Stream:
    prompt: list[int]
    max_tokens: int
    text: list[str] = field(default_factory=list)
    done: bool = False
    error: str = ""
    local_port: int = 0

    def run(self, url: str, model: str) -> None:
        body = {"model": model, "prompt": self.prompt, "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.Client(base_url=url, timeout=600) as client, \
                    client.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if not self.local_port:
                        stream = response.extensions.get("network_stream")
                        if stream is not None:
                            self.local_port = stream.get_extra_info("client_addr")[1]
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = f"{event['error'].get('code')}: {event['error'].get('message')}"
                        else:
                            self.text.append(event["choices"][0]["text"])
        except httpx.HTTPError as error:
            self.error = f"{type(error).__name__}: {error}"


def frontends(supervisor_pid: int) -> list[int]:
    """uvicorn's spawned children: the frontends."""
    return [c.pid for c in psutil.Process(supervisor_pid).children() if "spawn_main" in " ".join(c.cmdline())]


def owner(port: int, pids: list[int]) -> int | None:
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections("tcp")):
                return pid
    return None


def reference(url: str, model: str, prompt: list[int], max_tokens: int) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return str(httpx.post(f"{url}/v1/completions", json=body, timeout=600).json()["choices"][0]["text"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--pause-s", type=float, default=15.0)
    parser.add_argument("--streams", type=int, default=4, help="streams held by each frontend")
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--long-prompt", type=int, default=1500)
    parser.add_argument("--serve-args", default="--dtype bfloat16")
    parser.add_argument("--out", default="benchmarks/results/frontend_pause")
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/frontend_pause_logs"))
    args = parser.parse_args()
    if args.model is None:
        from llm_engine.default_model import prepare_default_model

        args.model = str(prepare_default_model())
    vocab = int(json.loads((Path(args.model) / "config.json").read_text())["vocab_size"])
    rng = random.Random(0)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [str(Path(sys.executable).with_name("pdserve")), "serve", args.model, "--prefill", "1",
               "--decode", "1", "--api-server-count", "2", "--port", str(port), *args.serve_args.split()]
    log_path = args.log_dir / "server.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env={**os.environ, "UCX_NET_DEVICES": "lo"}, stdout=log,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_healthy(process, url, 600.0, "pdserve serve")
            model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            deadline = time.monotonic() + 60
            while len(frontends(process.pid)) < 2 and time.monotonic() < deadline:
                time.sleep(0.5)
            pids = frontends(process.pid)
            streams: dict[int, list[Stream]] = {pid: [] for pid in pids}
            threads: list[threading.Thread] = []
            while min(len(s) for s in streams.values()) < args.streams and len(threads) < 8 * args.streams:
                stream = Stream([rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(64)], args.max_tokens)
                thread = threading.Thread(target=stream.run, args=(url, model), daemon=True)
                thread.start()
                threads.append(thread)
                while not stream.local_port and thread.is_alive():
                    time.sleep(0.05)
                held_by = owner(stream.local_port, pids)
                if held_by is not None:
                    streams[held_by].append(stream)
            victim = max(pids, key=lambda pid: len(streams[pid]))
            late = [Stream([rng.randrange(MIN_TOKEN_ID, vocab) for _ in range(args.long_prompt)], 16)
                    for _ in range(2)]
            for stream in late:
                threads.append(threading.Thread(target=stream.run, args=(url, model), daemon=True))
                threads[-1].start()
            time.sleep(0.3)
            os.kill(victim, signal.SIGSTOP)
            time.sleep(args.pause_s)
            os.kill(victim, signal.SIGCONT)
            for thread in threads:
                thread.join(900)
            everyone = [*streams[victim], *(s for pid in pids if pid != victim for s in streams[pid]), *late]
            rows: list[dict[str, bool | str]] = []
            for stream in everyone:
                expected = reference(url, model, stream.prompt, stream.max_tokens)
                rows.append({"on_paused_frontend": stream in streams[victim], "late": stream in late,
                             "done": stream.done, "error": stream.error,
                             "identical": "".join(stream.text) == expected})
        finally:
            stop_process_tree(process, signal.SIGINT, grace_s=60.0)
    expired = log_path.read_text(errors="replace").count("taken for dead")
    result = {"pause_s": args.pause_s, "frontend_taken_for_dead": expired, "requests": rows,
              "whole_and_identical": sum(bool(r["done"] and not r["error"] and r["identical"]) for r in rows),
              "total": len(rows), "args": {k: str(v) for k, v in vars(args).items()}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{args.out}.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "requests"}, indent=1))
    for row in rows:
        if not (row["done"] and not row["error"] and row["identical"]):
            print("NOT WHOLE:", row)


if __name__ == "__main__":
    main()
