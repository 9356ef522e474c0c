"""`pdserve serve --api-server-count 2`: two HTTP frontends on one port over one fleet actor.

One real server for the module, in its own process group (the supervisor, its frontends, the fleet actor and
the workers), serving HTTPS under a proxy prefix as vLLM's HTTP flags ask; raw-socket SSE clients (over TLS),
so that each stream's connection can be traced to the frontend process that holds it.
SIGKILL one frontend mid-stream: only its streams are cut; the other frontend's finish whole and identical;
the dead frontend is back within seconds; once idle no worker holds a KV block or a request, and no
admission reservation is left. SIGTERM one mid-stream: a graceful stop, its streams end with a clear error
before its grace ends, the other frontend's finish whole.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.helpers.servers import MODEL, free_port

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

MAX_TOKENS = 1000  # 1000 steps, seconds for six streams on this tiny model: the kill lands mid-stream
# A stopped frontend's streams outlive it: they end with the clear error at 1.6 s. The decode worker's steps
# are slowed for that part (STOPPED_STEP_S, at least 5 s for 1000 tokens): unslowed, 1000 tokens took under
# 1.6 s on CI's machine, and the streams then ended whole before the grace.
SHUTDOWN_GRACE_S = 2
STOPPED_STEP_S = 0.005
KILLED_STEP_S = 0.01  # a killed frontend's test: the survivor's 1000 tokens take at least 10 s
PROMPT = "The quick brown fox"


@dataclass
class Stream:
    """One streamed completion over a raw socket (its local port names its connection)."""

    sock: socket.socket
    texts: list[str] = field(default_factory=list)
    done: bool = False  # "data: [DONE]" arrived
    error: str = ""
    error_code: str = ""  # of an error event

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    def read(self) -> None:
        buffer = b""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    data = event.split(b"data: ", 1)[-1]
                    if data == b"[DONE]":
                        self.done = True
                        return
                    if data.startswith(b"{"):
                        body = json.loads(data)
                        if "choices" in body:
                            self.texts.append(body["choices"][0]["text"])
                        if "error" in body:
                            self.error_code = body["error"]["code"]
        except OSError as error:
            self.error = type(error).__name__


def open_stream(port: int, tls: ssl.SSLContext, max_tokens: int = MAX_TOKENS) -> Stream:
    sock = tls.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    return Stream(sock)


def frontend_pids(supervisor: psutil.Process) -> list[int]:
    """uvicorn's spawned children (the frontends), not Ray's processes; one that has exited (a zombie until
    uvicorn reaps it) is not a frontend."""
    pids = []
    for child in supervisor.children():
        with contextlib.suppress(psutil.Error):
            if "spawn_main" in " ".join(child.cmdline()):
                pids.append(child.pid)
    return pids


def ray_address(supervisor: psutil.Process) -> str:
    """The GCS address of the Ray instance the server started (its raylet's command line)."""
    for process in supervisor.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            for arg in process.cmdline():
                if arg.startswith(("--gcs-address=", "--gcs_address=")):
                    return arg.split("=", 1)[1]
    raise AssertionError("no raylet among the server's processes")


def probe(supervisor: psutil.Process, *args: str) -> None:
    """tests/cluster/probe.py against the server's Ray: --slow WORKER_ID SECONDS, --heal WORKER_ID. It runs
    with Ray's token auth on (the head the server started requires the token it wrote to ~/.ray)."""
    done = subprocess.run([sys.executable, "-m", "tests.cluster.probe", ray_address(supervisor), *args],
                          env={**os.environ, "RAY_AUTH_MODE": "token"}, cwd=Path(__file__).parents[2],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]


def owner(port: int, pids: list[int]) -> int | None:
    """The frontend holding the connection from the client's `port`."""
    for pid in pids:
        if any(c.raddr and c.raddr.port == port for c in psutil.Process(pid).net_connections("tcp")):
            return pid
    return None


@dataclass
class Server:
    port: int
    supervisor: psutil.Process  # uvicorn's supervisor: the gateway process, the frontends' parent
    log: Path
    tls: ssl.SSLContext  # trusts the server's self-signed certificate
    starting: list[dict[str, Any]]  # /health's answers while the fleet actor started (503 "starting")
    refused: httpx.Response | None  # a completion sent meanwhile

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def client(self, timeout_s: float = 120) -> httpx.Client:
        """A new client: new connections, spread over both frontends by the kernel."""
        return httpx.Client(base_url=self.url, timeout=timeout_s, verify=self.tls)

    def get(self, path: str) -> httpx.Response:
        """GET `path` over a connection of its own."""
        with self.client(10) as client:
            return client.get(path)


def until(condition: object, timeout_s: float, what: str, state: Callable[[], object] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}" + (f": {state()}" if state else ""))
        time.sleep(0.2)


def two_streams_on_each(server: Server, pids: list[int]
                        ) -> tuple[dict[int, list[Stream]], list[threading.Thread]]:
    """Streams opened until each frontend holds two (the kernel hands each connection to whichever accepts
    first), their readers started, every stream running; by frontend pid. A frontend just restarted holds the
    shared socket before it accepts (its imports, under the suite's load, take seconds): once one frontend
    has its two, the next connections wait a little each, for the other to take one."""
    streams: dict[int, list[Stream]] = {pid: [] for pid in pids}
    for _ in range(40):
        if all(len(s) >= 2 for s in streams.values()):
            break
        stream = open_stream(server.port, server.tls)
        until(lambda port=stream.port: owner(port, pids) is not None, 10,
              "the connection to be accepted")
        accepted_by = streams[owner(stream.port, pids)]  # type: ignore[index]
        accepted_by.append(stream)
        if len(accepted_by) > 2:
            time.sleep(0.5)
    assert all(len(s) >= 2 for s in streams.values()), {pid: len(s) for pid, s in streams.items()}
    everyone = [s for group in streams.values() for s in group]
    readers = [threading.Thread(target=s.read, daemon=True) for s in everyone]
    for reader in readers:
        reader.start()
    until(lambda: all(len(s.texts) >= 5 for s in everyone), 60, "every stream to be running",
          lambda: {pid: [(len(s.texts), s.done, s.error) for s in group] for pid, group in streams.items()})
    return streams, readers


@pytest.fixture(scope="module")
def two_frontends(tiny_chat_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One server for the module's tests, which hurt its frontends and its fleet actor: each test leaves it
    serving with two frontends (what it killed, uvicorn or Ray started again). HTTPS with a self-signed
    certificate (each frontend loads it), --root-path, CORS for one origin."""
    from tests.helpers.tls import self_signed

    directory = tmp_path_factory.mktemp("frontends")  # pytest keeps it: read server.log on a failure
    keyfile, certfile = self_signed(directory)
    port = free_port()
    log_path = directory / "server.log"
    log = log_path.open("w")
    command = [sys.executable, "-m", "pdserve", "serve", str(tiny_chat_model_dir), "--served-model-name",
               MODEL, "--backend", "nixl", "--prefill", "1", "--decode", "1", "--dtype", "float32",
               "--kv-cache-mib", "32", "--port", str(port), "--api-server-count", "2",
               "--shutdown-grace-s", str(SHUTDOWN_GRACE_S), "--ssl-keyfile", str(keyfile), "--ssl-certfile",
               str(certfile), "--root-path", "/llm", "--allowed-origins", '["https://app.example"]']
    env = {**os.environ, "UCX_NET_DEVICES": "lo"}
    process = subprocess.Popen(command, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT)
    supervisor = psutil.Process(process.pid)
    tls = ssl.create_default_context(cafile=str(certfile))
    starting: list[dict[str, Any]] = []
    refusals: list[httpx.Response] = []
    try:
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", timeout=60, verify=tls) as client:
            def ready() -> bool:
                try:
                    health = client.get("/health")
                    if health.status_code == 503 and health.json().get("status") == "starting":
                        starting.append(health.json())
                        if not refusals:
                            refusals.append(client.post("/v1/completions", json={"prompt": PROMPT}))
                    return health.status_code == 200 and len(frontend_pids(supervisor)) == 2
                except httpx.HTTPError:
                    return False
            until(ready, 180, "the server and both frontends, over HTTPS")
        yield Server(port, supervisor, log_path, tls, starting, refusals[0] if refusals else None)
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)
        log.close()


def test_two_frontends_serve_https_under_a_proxy_prefix_and_say_their_start_up(
        two_frontends: Server, tiny_chat_model_dir: Path) -> None:
    """vLLM's HTTP flags through the command line to both frontends: HTTPS with the given certificate,
    --root-path in the OpenAPI description, CORS for the allowed origin; /v1/models' root is the model as
    given; while the fleet actor started, /health said how far each worker was and a completion got a clear
    503; the fleet actor's start-up lines (placed, loading, loaded) reached the log."""
    assert any(answer["total"] == 2 for answer in two_frontends.starting), two_frontends.starting
    refused = two_frontends.refused
    assert refused is not None and refused.status_code == 503
    assert "pdserve is starting" in refused.json()["error"]["message"]
    for _ in range(4):  # fresh connections, spread over both frontends by the kernel
        with two_frontends.client(60) as fresh:
            [model] = fresh.get("/v1/models").json()["data"]
            assert (model["id"], model["root"]) == (MODEL, str(tiny_chat_model_dir))
            assert fresh.get("/openapi.json").json()["servers"] == [{"url": "/llm"}]
    with two_frontends.client(60) as client:
        answer = client.post("/llm/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4})
        assert answer.status_code == 200, answer.text
        preflight = client.options("/v1/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["access-control-allow-origin"] == "https://app.example"
    # Neither frontend process holds torch (loaded, it would be mapped: libtorch_cpu and its kin).
    for pid in frontend_pids(two_frontends.supervisor):
        mapped = {m.path for m in psutil.Process(pid).memory_maps()}
        assert not [path for path in mapped if "/torch/" in path], pid
    said = two_frontends.log.read_text()
    for line in ("starting 2 workers (1 prefill, 1 decode)", "(prefill): placed on node",
                 "(decode): loading the model on its node", "(decode): model loaded in",
                 "2 of 2 workers up in", f"frontends on https://127.0.0.1:{two_frontends.port}"):
        assert line in said, said[-4000:]


def test_a_frontend_killed_mid_stream_loses_only_its_own_streams(two_frontends: Server) -> None:
    supervisor = two_frontends.supervisor
    with two_frontends.client() as client:
        reference = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT,
                                                         "max_tokens": MAX_TOKENS, "temperature": 0}).json()
        [decode_worker] = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]
                           if w["role"] == "decode"]
    expected = reference["choices"][0]["text"]
    # Slowed steps: the survivor's streams must outlast the fleet's ending of the victim's (unslowed, 1000
    # tokens took under 2 s, which a loaded machine's exit watch can take: then nothing is proven).
    probe(supervisor, "--slow", decode_worker, str(KILLED_STEP_S))
    pids = frontend_pids(supervisor)
    streams, readers = two_streams_on_each(two_frontends, pids)
    victim, survivor = pids
    os.kill(victim, signal.SIGKILL)
    with two_frontends.client() as client:
        def running_on_workers() -> int:
            return sum(w.get("requests", 0) for w in client.get("/admin/pools").json()["workers"])
        # The supervisor sees the frontend's process exit and tells the fleet, and its requests end on the
        # workers (Ray does not cancel a dead caller's stream there) at once, not after the fleet's 10 s of
        # silence: only the survivor's stay, still running.
        until(lambda: running_on_workers() <= len(streams[survivor]), 60, "the victim's requests to end")
        assert not all(s.done for s in streams[survivor]), "the survivor's streams ended first: no proof"
        until(lambda: f"-{victim}-" in "".join(line for line in two_frontends.log.read_text()
                                               .splitlines() if "exited: its streams end" in line),
              30, "the fleet's line that the frontend exited")
    for reader in readers:
        reader.join(120)
    probe(supervisor, "--heal", decode_worker)
    for stream in streams[victim]:  # cut: the connection ended without the end of the stream
        assert not stream.done and len(stream.texts) < MAX_TOKENS
    for stream in streams[survivor]:  # whole, and the same greedy text as before the kill
        assert stream.done and "".join(stream.texts) == expected
    # The dead frontend is replaced, and the fleet ends what its streams held on the workers.
    until(lambda: len(frontend_pids(supervisor)) == 2 and victim not in frontend_pids(supervisor), 60,
          "the frontend's restart")
    with two_frontends.client() as client:
        until(lambda: client.get("/health").status_code == 200, 60, "health")

        def idle() -> bool:
            pools = client.get("/admin/pools").json()
            return all(w["requests"] == 0 and w["used_kv_blocks"] == 0 for w in pools["workers"])
        until(idle, 30, "every worker idle with no KV block used")
        for _ in range(6):  # both frontends serve (connections spread over them)
            answer = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16,
                                                          "temperature": 0})
            assert answer.status_code == 200 and expected.startswith(answer.json()["choices"][0]["text"])
        metrics = client.get("/metrics").text
    reserved = [line for line in metrics.splitlines() if line.startswith("pdserve:admission_reserved_tokens")]
    assert reserved and all(float(line.rsplit(" ", 1)[1]) == 0 for line in reserved), reserved
    # Both frontends' counts, summed from the multiprocess files, under the served model's name.
    samples = [line for line in metrics.splitlines() if line.startswith("pdserve:")]
    assert samples and all(f'model_name="{MODEL}"' in line for line in samples)
    finished = [line for line in samples if line.startswith("pdserve:request_success_total{")]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in finished) >= 6, finished
    # vLLM's HTTP series (prometheus-fastapi-instrumentator's) are summed over the frontends the same way.
    answered = [line for line in metrics.splitlines() if line.startswith("http_requests_total{")
                and 'handler="/v1/completions"' in line and 'status="2xx"' in line]
    assert sum(float(line.rsplit(" ", 1)[1]) for line in answered) >= 6, answered
    # SIGTERM (how uvicorn's supervisor, and Kubernetes, stop a process) is a graceful stop: the frontend
    # takes no new connection, and each of its streams still open at 0.8 of --shutdown-grace-s ends with a
    # clear error event and [DONE] (gateway/stop_signals.py), not Ray's SIGTERM handler ending the process at
    # once with each request a bare 500. The other frontend's streams finish whole.
    with two_frontends.client() as client:
        [decode_worker] = [w["worker_id"] for w in client.get("/admin/pools").json()["workers"]
                           if w["role"] == "decode"]
    probe(supervisor, "--slow", decode_worker, str(STOPPED_STEP_S))
    pids = frontend_pids(supervisor)
    streams, readers = two_streams_on_each(two_frontends, pids)
    stopped, serving = pids
    os.kill(stopped, signal.SIGTERM)
    for reader in readers:
        reader.join(120)
    probe(supervisor, "--heal", decode_worker)
    for stream in streams[stopped]:
        assert stream.done and stream.error_code == "shutting_down", (stream.error, stream.error_code)
        assert expected.startswith("".join(stream.texts))  # what it got before is right
    for stream in streams[serving]:
        assert stream.done and "".join(stream.texts) == expected, (stream.error, len(stream.texts))
    # uvicorn's supervisor may be waiting up to FRONTEND_UNANSWERED_S (30 s) for the stopping frontend's
    # ping; the exit watch answers it once the process is gone (gateway/frontends.py), and a new one starts.
    until(lambda: len(frontend_pids(supervisor)) == 2 and stopped not in frontend_pids(supervisor), 150,
          "the stopped frontend's restart")


def worker_pids(client: httpx.Client) -> dict[str, int]:
    return {w["worker_id"]: w["pid"] for w in client.get("/admin/pools").json()["workers"]}


def fleet_actor_pid(supervisor: psutil.Process) -> int:
    """The fleet actor's process (Ray names it after the class), among the server's descendants."""
    for process in supervisor.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "FleetActor" in " ".join(process.cmdline()):
                return process.pid
    raise AssertionError("no FleetActor process")


def test_a_paused_frontend_and_a_dead_fleet_actor_kill_no_healthy_worker_and_health_tells(
        two_frontends: Server) -> None:
    """Review N1 and N2. A frontend paused for 6 s (SIGSTOP) is neither killed by uvicorn's supervisor (it
    waits FRONTEND_UNANSWERED_S) nor given up by the fleet (its 10 s lease): it resumes, and every stream on
    both frontends finishes whole; no worker is replaced. The fleet actor killed: /health turns 503 within
    seconds, Ray restarts it and it adopts the workers as they are (the same processes, no weights loaded
    again), the streams running meanwhile finish whole, and the server answers again."""
    supervisor = two_frontends.supervisor
    client = two_frontends.client()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    expected = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    before = worker_pids(client)
    pids = frontend_pids(supervisor)
    streams, readers = two_streams_on_each(two_frontends, pids)
    victim, survivor = pids
    os.kill(victim, signal.SIGSTOP)
    time.sleep(6)
    os.kill(victim, signal.SIGCONT)  # ProcessLookupError: uvicorn took the paused frontend for dead
    for reader in readers:
        reader.join(120)
    for stream in streams[survivor] + streams[victim]:
        assert stream.done and "".join(stream.texts) == expected
    assert victim in frontend_pids(supervisor), "uvicorn replaced a frontend that was only paused"
    until(lambda: client.get("/health").status_code == 200, 60, "health")
    assert worker_pids(client) == before, "a healthy worker was replaced"

    pids = frontend_pids(supervisor)  # uvicorn may have replaced the paused one
    streams, readers = two_streams_on_each(two_frontends, pids)
    os.kill(fleet_actor_pid(supervisor), signal.SIGKILL)
    # Seconds here; 30 s is a hang bound under a loaded machine (15 s was once missed in a full run).
    until(lambda: client.get("/health").status_code == 503, 30, "/health to say the fleet is gone")
    assert "fleet" in client.get("/health").json().get("reason", "")
    # Every frontend (fresh connections spread over both) says so once it follows the new fleet.
    until(lambda: all(two_frontends.get("/health").status_code == 200
                      for _ in range(6)), 180, "the restarted fleet")
    for reader in readers:
        reader.join(120)
    for group in streams.values():  # their workers lived on, streaming to the frontends
        assert all(stream.done and "".join(stream.texts) == expected for stream in group)
    answer = client.post("/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 16,
                                                  "temperature": 0})
    assert answer.status_code == 200 and expected.startswith(answer.json()["choices"][0]["text"])
    assert worker_pids(client) == before, "the restarted fleet did not adopt its workers"
    client.close()


def test_a_frontend_paused_past_the_fleets_lease_resumes_every_request_whole(two_frontends: Server) -> None:
    """Issue 48, defect 2 (review P2). A frontend SIGSTOPped for 15 s, past the fleet's 10 s lease, is taken
    for dead: every worker ends its channels and aborts what they carried. Resumed, it submits each of its
    requests again as a new attempt (its own id on the workers, never refused as "aborted before it
    arrived"): every stream, and every prompt it had just sent, ends whole with the reference text."""
    supervisor = two_frontends.supervisor
    with two_frontends.client() as client:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
        expected = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
        before = worker_pids(client)
    pids = frontend_pids(supervisor)
    streams, readers = two_streams_on_each(two_frontends, pids)
    victim, survivor = pids
    num_expired = two_frontends.log.read_text().count("taken for dead")
    # Sent just before the pause: whichever frontend takes them, the victim's may still be prefilling.
    late = [open_stream(two_frontends.port, two_frontends.tls) for _ in range(2)]
    late_readers = [threading.Thread(target=s.read, daemon=True) for s in late]
    for reader in late_readers:
        reader.start()
    os.kill(victim, signal.SIGSTOP)
    time.sleep(15)
    os.kill(victim, signal.SIGCONT)
    for reader in readers + late_readers:
        reader.join(180)
    assert two_frontends.log.read_text().count("taken for dead") > num_expired, \
        "the fleet never took the paused frontend for dead: no proof"
    for stream in streams[survivor] + streams[victim] + late:
        assert stream.done and not stream.error_code, (stream.error, stream.error_code, len(stream.texts))
        assert "".join(stream.texts) == expected
    assert victim in frontend_pids(supervisor), "uvicorn replaced a frontend that was only paused"
    with two_frontends.client() as client:
        until(lambda: client.get("/health").status_code == 200, 60, "health")
        assert worker_pids(client) == before, "a healthy worker was replaced"
