"""The admin routes' answers as pydantic models, so that OpenAPI shows their schema (gateway/api/admin.py).

The fleet owner (gateway/control/plane.py, in the fleet actor) builds the answer; the edge
validates it into these models and answers only the keys it set (response_model_exclude_unset), so that a
key a worker does not have yet (a pending worker's load) stays absent rather than null. extra="forbid":
a key the plane adds without a field here fails loudly in the tests, not silently in the schema.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class _Answer(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)


class WorkerView(_Answer):
    """One worker in GET /admin/pools."""

    worker_id: str
    role: str  # prefill, decode or mixed
    state: str  # pending, starting, active, changing_role, draining, failed, stopped
    node_id: str | None  # the Ray node it was placed on (None: pending)
    node_ip: str | None
    pid: int | None  # its process there
    tensor_parallel_size: int  # its ranks, fixed for its life
    next_role: str | None = None  # while it changes role
    emptying: str | None = None  # while it drains or changes role: what it still waits for
    # Tokens of requests the gateway has sent it (or is about to) and not seen come back: a drain or role
    # change waits for 0.
    tokens_on_the_way: int = 0
    pending_reason: str | None = None  # why no node takes it yet, and until when (an added one)
    runtime: dict[str, Any] | None = None  # dtype, GEMM kernel, threads, cores, KV bytes per token, KV sizing
    # Its latest load (absent while it does not report one):
    requests: int | None = None  # held in any state
    running_requests: int | None = None
    waiting_requests: int | None = None
    queued_prompt_tokens: int | None = None  # routed here, not yet prefilled
    transferring: int | None = None  # KV pulls in flight
    free_kv_blocks: int | None = None
    used_kv_blocks: int | None = None
    total_kv_blocks: int | None = None
    total_kv_tokens: int | None = None  # the most one request may hold here


class ChangeInProgress(_Answer):
    """A change of the pools being applied (PUT /admin/pools, or the ratio controller)."""

    moves: list[dict[str, Any]]  # the plan: each {action, role, from_role, worker_id}
    done: list[str]  # "added worker-5", "worker-0: prefill → mixed", ...
    error: str  # why it stopped part way ("" while it runs)
    seconds: float


class RatioDecision(_Answer):
    """One of the ratio controller's recent decisions."""

    at: float  # Unix time
    from_level: int  # prefill workers before (0: all mixed)
    to_level: int
    reason: str  # long_prompt, itl_slo, ttft_slo, prefill_idle, no_gain or plan
    detail: str
    queued_prompt_tokens: int
    prediction: dict[str, Any] | None = None  # the planner's, for "plan"
    measured: dict[str, Any] | None = None  # what followed, plan_check_s after a planned move


class ScaleDecision(_Answer):
    """One of the scale controller's recent decisions."""

    at: float  # Unix time
    from_: str = Field(alias="from")  # the layout before, as "1P+2D"
    to: str
    reason: str  # scale_out, scale_in or rebalance
    detail: str
    prediction: dict[str, Any]  # each size's best layout and its predicted attainment, goodput, latencies
    measured: dict[str, Any] | None = None  # what followed, check_s after the change (or why it stopped)


class ScaleView(_Answer):
    """The scale controller (--scale auto) in GET /admin/pools."""

    on: bool
    min_workers: int
    max_workers: int
    roles: dict[str, int | None]  # --min/--max-prefill-workers, --min/--max-decode-workers (None: no bound)
    last_error: str  # why its last change stopped part way, or was refused ("" if it did not)
    last_plan: dict[str, Any] | None  # its latest plan (the size the traffic needs, each size's prediction)
    decisions: list[ScaleDecision]  # the last 20


class PoolsResponse(_Answer):
    """GET /admin/pools."""

    prefill: int  # active workers per role
    decode: int
    mixed: int
    target: dict[str, int]  # role → workers the deployment aims at
    tensor_parallel: dict[str, int]  # role → the degree its workers start at (PUT prefill_tp/decode_tp)
    status: str  # ok, degraded or unavailable (as /health)
    backend: str  # the KV transfer backend
    torch_rendezvous: str | None  # the torch group's init address (torch backend)
    pending: int  # workers no node can take yet
    change_in_progress: ChangeInProgress | None
    auto: bool  # the ratio controller (or the scale controller) is on
    queued_prompt_tokens: int  # routed, not yet prefilled, over all workers
    ratio_decisions: list[RatioDecision]  # the last 20
    scale: ScaleView | None = None  # with --scale auto
    workers: list[WorkerView]


class StepsResponse(_Answer):
    """GET /admin/workers/{id}/steps."""

    worker_id: str
    steps: list[dict[str, Any]]  # each forward: its start (Unix time), duration, decode and prompt tokens


class AutoResponse(_Answer):
    """PUT /admin/pools {"auto": ...}."""

    auto: bool  # the ratio controller (or the scale controller) is on now


class ResizeResponse(_Answer):
    """PUT /admin/pools with worker counts: the plan and what was done."""

    layout: dict[str, int]  # role → workers asked for
    tensor_parallel: dict[str, int]  # role → the degree its workers start at from now on
    moves: list[dict[str, str]]  # the plan, in order: each {action, role[, from]}
    done: list[str]
    error: str  # why the plan stopped part way ("" if it did not)
    seconds: float
