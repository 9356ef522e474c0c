"""A real HTTP server of the tests' own that stands in for an OpenAI-compatible one where only the client is
under test (`pdserve bench`, vLLM's `vllm bench serve`): uvicorn on a thread, a FastAPI app that records every
request body and answers each completion with the event stream it is given."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

MODEL = "recorded-model"

# One answer of three tokens and its usage, framed as every server frames it.
PLAIN_STREAM = [
    'data: {"choices": [{"index": 0, "text": "a", "token_ids": [11]}]}\n\n',
    'data: {"choices": [{"index": 0, "text": "b", "token_ids": [12]}]}\n\n',
    'data: {"choices": [{"index": 0, "text": "c", "token_ids": [13]}]}\n\n',
    'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}\n\n',
    "data: [DONE]\n\n",
]


@dataclass
class Recorder:
    """The server's memory: what it was sent, and what it streams back."""

    bodies: list[dict[str, Any]] = field(default_factory=list)
    frames: list[str] = field(default_factory=lambda: list(PLAIN_STREAM))
    media_type: str = "text/event-stream"  # another: a whole JSON answer instead of a stream


def recording_app(recorder: Recorder) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "root": MODEL}]}

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def complete(request: Request) -> Response:
        recorder.bodies.append(await request.json())
        if recorder.media_type != "text/event-stream":
            return JSONResponse({"choices": [{"text": "whole"}]})
        return StreamingResponse(iter(recorder.frames), media_type=recorder.media_type)

    return app


@contextlib.contextmanager
def recording_server(recorder: Recorder) -> Iterator[str]:
    """Serve `recorder`'s app on a free port of 127.0.0.1; yields its base URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    uv = uvicorn.Server(uvicorn.Config(recording_app(recorder), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the recording server did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        thread.join(30)
