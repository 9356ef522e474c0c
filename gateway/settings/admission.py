"""What a request may wait for, and how long: the admission line, deadlines, shutdown, the step watchdog,
conditional disaggregation and prefill routing."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class AdmissionSettings(BaseModel):
    scheduling_policy: Literal["fcfs", "priority"] = Field(
        "fcfs",
        description="fcfs: requests are admitted in arrival order and a request's priority other than 0 is "
                    "refused (400, as vLLM); priority: the admission line orders by the request's priority "
                    "(lower first), then arrival")
    max_waiting: int = Field(
        256, ge=0,
        description="requests that may wait for decode KV capacity before 429")
    max_waiting_tokens: int | None = Field(
        None, ge=0,
        description="tokens (prompt + max_tokens) that may wait before 429 (default: the KV capacity)")
    queue_timeout_s: float = Field(
        60.0, gt=0,
        description="seconds a request may wait for capacity before 429")
    shutdown_grace_s: int = Field(
        30, ge=1,
        description="on SIGTERM/SIGINT, requests in flight may finish this long, s; those still open at "
                    "0.8 of it end with a clear 503 (code shutting_down)")
    step_watchdog_s: float = Field(
        120.0, ge=0,
        description="a worker whose step has run this long, and 10x its longest finished step, is taken "
                    "for hung: replaced, its requests moved (0: never)")
    deadline_slack_s: float | None = Field(
        None, gt=0,
        description="request deadlines: slack per stage, s (default: gateway/requests/deadlines.py's)")
    deadline_prefill_s_per_token: float | None = Field(
        None, ge=0,
        description="request deadlines: seconds per prompt token (default: deadlines.py's)")
    deadline_decode_s_per_token: float | None = Field(
        None, ge=0,
        description="request deadlines: seconds per output token (default: deadlines.py's)")
    # Conditional disaggregation (gateway/requests/router.py LocalPrefillPolicy).
    local_prefill_max_tokens: int | None = Field(
        None, ge=0,
        description="decode workers prefill prompts with at most this many uncached tokens themselves "
                    "(default: off)")
    local_prefill_queue_tokens: int | None = Field(
        None, ge=0,
        description="... or any prompt while every prefill worker has this many tokens queued (default: off)")
    prefill_routing: Literal["prefix", "load"] = Field(
        "prefix",
        description="how a prompt's prefill worker is picked: prefix (the fewest prompt tokens queued less "
                    "those its prefix cache probably holds) or load (the fewest queued: least loaded)")
