"""The record of where one request's time went, returned with the response and exported as metrics."""

from __future__ import annotations

from pydantic import BaseModel


class Timings(BaseModel):
    """Where the request's time went, in milliseconds (our extension to the OpenAI response)."""

    gateway_queue_ms: float  # waiting for admission (decode KV capacity)
    prefill_queue_ms: float  # on the prefill worker, before its first chunk ran
    prefill_ms: float  # first chunk to first token on the prefill worker
    # Prompt tokens the prefilling worker found in its prefix cache; None in responses unless the server
    # shows them (--enable-prompt-tokens-details).
    cached_tokens: int | None = 0
    transfer_ms: float  # pulling the prompt's KV into the decode worker
    transfer_bytes: int
    decode_queue_ms: float  # on the decode worker, waiting for blocks or for the next step
    decode_ms: float  # joining the running batch to the last token
    ttft_ms: float  # arrival at the gateway to the first token leaving it
    e2e_ms: float  # arrival to the last token
    token_gaps_ms: list[float]  # gaps between consecutive tokens leaving the gateway
    prefill_on: str = "prefill"  # the worker kind that prefilled: "prefill" (the pool) or "decode" (itself)
    local_prefill_reason: str | None = None  # why the decode or mixed worker prefilled the prompt itself
    # Times the stream moved to another worker, which pulled or recomputed the KV of what the client had:
    # its worker failed, changed role or left the pools.
    num_moves: int = 0
    # The hops between processes that no stage above covers (the gateway's own share of e2e_ms):
    to_prefill_ms: float = 0.0  # admitted here → the prefilling worker has the request
    # First token on the prefill worker → the decode worker has the request (for a moved stream, the
    # worker it ended on: the time on the workers it left is in here too).
    handoff_ms: float = 0.0
    delivery_ms: float = 0.0  # last token made on the decode worker → it left the gateway
