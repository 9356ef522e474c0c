"""A request's stage Timings, from the times the workers report and the times its tokens left the gateway;
the hops between processes (to the prefill worker, prefill → decode, decode → out of the gateway) are what
the stages leave out, so that the gateway's own share of a request's time is visible per request. Worker
and gateway clocks are compared: on several hosts, the hops include their clock skew.

Tokens are counted one by one (a worker may send several in one event); each gets its own time: the
worker's spacing between them, anchored at the moment the gateway received the event.
"""

from __future__ import annotations

import itertools
import time

from decode_pool.messages import DecodeOutput
from gateway.requests.events import StreamEvent
from gateway.telemetry.timings import Timings
from prefill_pool.messages import PrefillResult


def stage_timings(
    arrival: float,
    admitted: float,
    sent: list[float],
    prefill: PrefillResult | None,
    decode: DecodeOutput | None,
) -> Timings:
    def ms(start: float | None, end: float | None) -> float:
        return 0.0 if start is None or end is None else max(0.0, 1000 * (end - start))

    p = prefill.times if prefill is not None else None
    d = decode.times if decode is not None else None
    if p is None and d is not None and d.transfer_started is None:
        # Colocated: one worker queued, prefilled and decoded; its prefill span runs from arrival on
        # the worker to the first token (queueing included), the rest is decode.
        return Timings(
            gateway_queue_ms=ms(arrival, admitted),
            prefill_queue_ms=0.0,
            prefill_ms=ms(d.queued, d.admitted),
            transfer_ms=0.0,
            transfer_bytes=0,
            decode_queue_ms=0.0,
            decode_ms=ms(d.admitted, d.finished),
            ttft_ms=ms(arrival, sent[0] if sent else None),
            e2e_ms=ms(arrival, sent[-1] if sent else time.time()),
            token_gaps_ms=[ms(a, b) for a, b in itertools.pairwise(sent)],
            to_prefill_ms=ms(admitted, d.queued),
            delivery_ms=ms(d.finished, sent[-1] if sent else None),
        )
    return Timings(
        gateway_queue_ms=ms(arrival, admitted),
        prefill_queue_ms=ms(p.queued, p.started) if p else 0.0,
        prefill_ms=ms(p.started, p.finished) if p else 0.0,
        transfer_ms=ms(d.transfer_started, d.transfer_finished) if d else 0.0,
        transfer_bytes=decode.transfer_bytes if decode is not None else 0,
        decode_queue_ms=(ms(d.queued, d.transfer_started) + ms(d.transfer_finished, d.admitted))
        if d
        else 0.0,
        decode_ms=ms(d.admitted, d.finished) if d else 0.0,
        ttft_ms=ms(arrival, sent[0] if sent else None),
        e2e_ms=ms(arrival, sent[-1] if sent else time.time()),
        token_gaps_ms=[ms(a, b) for a, b in itertools.pairwise(sent)],
        to_prefill_ms=ms(admitted, p.queued) if p else 0.0,
        handoff_ms=ms(p.finished, d.queued) if p and d else 0.0,
        delivery_ms=ms(d.finished, sent[-1] if sent else None) if d else 0.0,
    )

def token_times(event: StreamEvent, received: float) -> list[float]:
    """One gateway-clock time per token of the event: the worker's spacing, ending when it arrived here."""
    num = len(event.token_ids)
    if not num:
        return []
    if len(event.token_times) != num:
        return [received] * num
    last = event.token_times[-1]
    return [received - (last - t) for t in event.token_times]
