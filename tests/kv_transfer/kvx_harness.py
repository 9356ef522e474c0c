"""Test-side harness of the two-process tests: start a sender child and a receiver child, carry messages."""

from __future__ import annotations

import multiprocessing
import socket
import time
from typing import Any

from tests.kv_transfer import kvx_peers


class PeerError(Exception):
    """An exception raised inside a child, re-raised in the test with its type name."""

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(f"{type_name}: {message}")
        self.type_name = type_name


class Peer:
    """The test's end of one child process."""

    def __init__(self, role: str, backend: str, options: dict[str, Any]) -> None:
        context = multiprocessing.get_context("spawn")
        self.conn, child_conn = context.Pipe()
        self.process = context.Process(target=kvx_peers.serve, args=(child_conn, role, backend, options),
                                       daemon=True)
        self.process.start()

    def wait_ready(self, timeout: float = 60.0) -> None:
        if not self.conn.poll(timeout):
            raise TimeoutError("child did not start")
        status, value = self.conn.recv()
        assert status == "ready", value

    def call(self, command: str, *args: Any, timeout: float = 60.0) -> Any:
        self.conn.send((command, args))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"child did not answer {command}")
        status, value = self.conn.recv()
        if status == "error":
            raise PeerError(*value)
        return value

    def stop(self) -> None:
        try:
            self.call("stop", timeout=20)
        finally:
            self.process.join(10)
            if self.process.is_alive():
                self.process.kill()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Pair:
    """A prefill child (sender) and a decode child (receiver); the test carries messages between them."""

    def __init__(self, prefill: Peer, decode: Peer) -> None:
        self.prefill, self.decode = prefill, decode
        self.released: dict[int, tuple[list[int], str]] = {}

    def poll_sender(self) -> None:
        for transfer_id, block_ids, reason in self.prefill.call("sender_poll"):
            self.released[transfer_id] = (block_ids, reason)

    def pull(self, handle: bytes, dst: list[int], timeout: float = 30.0) -> tuple[str, str]:
        """Start a pull and drive both sides until the receiver reports it; returns (state, reason)."""
        self.decode.call("start_pull", handle, dst)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for request in self.decode.call("take_requests"):
                self.decode.call("on_reply", self.prefill.call("accept", request))
            results = self.decode.call("receiver_poll")
            self.poll_sender()
            if results:
                (_transfer_id, state, reason), = results
                return state, reason
            time.sleep(0.002)
        raise TimeoutError("pull did not finish")

    def wait_released(self, transfer_id: int, timeout: float = 30.0) -> tuple[list[int], str]:
        deadline = time.monotonic() + timeout
        while transfer_id not in self.released and time.monotonic() < deadline:
            self.poll_sender()
            time.sleep(0.005)
        return self.released[transfer_id]


def start_pair(backend: str, prefill_options: dict[str, Any], decode_options: dict[str, Any]) -> Pair:
    if backend == "torch":
        init_method = f"tcp://127.0.0.1:{free_port()}"
        prefill_options = {**prefill_options, "init_method": init_method, "rank": 0}
        decode_options = {**decode_options, "init_method": init_method, "rank": 1}
    prefill = Peer("prefill", backend, prefill_options)
    decode = Peer("decode", backend, decode_options)
    prefill.wait_ready()
    decode.wait_ready()
    return Pair(prefill, decode)

