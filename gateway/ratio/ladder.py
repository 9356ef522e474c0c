"""The ratio controller's ladder of layouts and its rules, apart from any I/O (tested without a fleet).

The ladder over N workers: level 0 is N mixed workers (each prefills and decodes its own requests: no
transfer, every core decodes), level k ≥ 1 is k prefill + N-k decode workers (running streams are
protected from long prompts). Ladder.decide(): Signals (one tick's view) and the time in, a Decision (or
None) out:
      0 → 1   a long prompt (≥ long_prompt_tokens) is being prefilled by a worker that also decodes other
              streams (one that prefills it with nothing else to decode stalls no one: light traffic keeps
              both workers prefilling long prompts, which halves their wait), or
              the requests' TPOT p90 is over the ITL SLO while prompts queue and the median gap is not
              (prefill chunks cause the tail; a slow median means decoding itself is short of cores,
              which disaggregation would make worse).
      k → k+1 TTFT p90 over its SLO with prompt work piling up on every prefill worker (≥ 1 decode stays).
      k → k-1 prefill has been idle (little queued, no long prompt) for calm_s; at k = 1 that means the
              prompts that needed protection are gone, and N mixed workers serve light traffic faster.
      1 → 0   calm_s after a move for the ITL SLO the requests' TPOT is no better: back, and that rule
              stays off for a while (decoding was short of cores, not troubled by prefill).
Hysteresis: up on a high mark, down only after calm_s below a low mark; and no change within min_dwell_s
of the last.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.requests.router import LONG_PROMPT_TOKENS
from loadgen.summary import DEFAULT_ITL_SLO_S, DEFAULT_TTFT_SLO_S

NO_GAIN = 0.1  # a move for the ITL SLO must cut the requests' TPOT p90 by this fraction to stay
ITL_RULE_BACKOFF = 10  # calm periods the ITL rule stays off after a move that did not help


@dataclass(frozen=True)
class ControllerPolicy:
    interval_s: float = 1.0  # how often it looks (a long prompt wakes it at once)
    min_dwell_s: float = 2.0  # no change sooner than this after the last one (calm_s guards the way back)
    calm_s: float = 10.0  # prefill idle this long before a prefill worker goes back
    long_prompt_tokens: int = LONG_PROMPT_TOKENS  # a prompt this long interferes with decoding beside it
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S  # the SLOs every command shares (loadgen/summary.py)
    itl_slo_s: float = DEFAULT_ITL_SLO_S
    grace_s: float = 0.0  # a worker changing role hands its decode streams over at once
    plan_interval_s: float = 10.0  # how often the planner looks (with a profile)
    plan_margin: float = 0.1  # predicted goodput gain over the current layout that a move needs
    plan_confirmations: int = 2  # predictions in a row naming the same better layout
    plan_check_s: float = 30.0  # after a planned move, when the measured outcome is logged beside it

    def __post_init__(self) -> None:
        if min(self.interval_s, self.calm_s, self.ttft_slo_s, self.itl_slo_s) <= 0 or self.min_dwell_s < 0:
            raise ValueError(f"controller intervals and SLOs must be > 0, got {self}")
        if self.long_prompt_tokens < 1:
            raise ValueError(f"long_prompt_tokens must be >= 1, got {self.long_prompt_tokens}")


@dataclass(frozen=True)
class Signals:
    """What one tick saw."""

    level: int  # prefill workers aimed at (0: all mixed)
    num_workers: int
    queued_prompt_tokens: int  # routed to any worker and not yet prefilled
    num_decoding: int  # requests running on decode and mixed workers
    kv_occupancy: float  # the fullest decode or mixed worker
    ttft_p90_s: float | None  # over the recent window; None without enough requests
    tpot_p90_s: float | None  # over requests: each one's mean gap between tokens (goodput's ITL check)
    itl_p50_s: float | None  # over tokens
    longest_pending_prompt: int  # tokens of the longest prompt a decode or mixed worker is prefilling now
    longest_prompt_beside_streams: int  # ... on a worker that decodes other requests meanwhile
    seconds_since_long_prompt: float  # since one arrived (before it is routed, it is pending nowhere yet)


@dataclass(frozen=True)
class Decision:
    at: float  # time.time()
    from_level: int
    to_level: int
    reason: str  # "long_prompt", "itl_slo", "ttft_slo", "prefill_idle", "no_gain" or "plan"
    detail: str
    signals: Signals
    prediction: dict[str, object] | None = None  # the planner's, for "plan"
    measured: dict[str, object] = field(default_factory=dict)  # plan_check_s after a planned move


class Ladder:
    """The controller's decisions, apart from any I/O: signals and the time in, a Decision (or None) out;
    it keeps the hysteresis state (when the last change happened, since when prefill has been calm)."""

    def __init__(self, policy: ControllerPolicy) -> None:
        self.policy = policy
        self._last_change = float("-inf")
        self._calm_since: float | None = None
        # After a move for the ITL SLO: the TPOT p90 that caused it, until the new layout has been judged.
        self._tpot_before_itl_move: float | None = None
        self._itl_rule_off_until = float("-inf")  # a move for the ITL SLO that did not help is not retried

    def can_move(self, now: float) -> bool:
        return now - self._last_change >= self.policy.min_dwell_s

    def is_long_prompt_about(self, s: Signals) -> bool:
        """A long prompt is pending on a worker that decodes, or arrived within calm_s."""
        return (s.longest_pending_prompt >= self.policy.long_prompt_tokens
                or s.seconds_since_long_prompt < self.policy.calm_s)

    def note_change(self, now: float, decision: Decision | None = None) -> None:
        """A change was made (with the decision that made it) or ended at `now`: the dwell time and the calm
        timer start again."""
        self._last_change = now
        self._calm_since = None
        if decision is not None:
            self._tpot_before_itl_move = decision.signals.tpot_p90_s if decision.reason == "itl_slo" else None

    def decide(self, s: Signals, now: float) -> Decision | None:
        """The move the signals call for, if any (pure: no side effect but the calm timer)."""
        p = self.policy
        # Prefill is not calm while a long prompt arrives or a worker that decodes is prefilling one.
        is_long_prompt_here = (s.longest_pending_prompt >= p.long_prompt_tokens
                               or s.seconds_since_long_prompt < max(p.interval_s, 1.0))
        is_calm = s.queued_prompt_tokens < p.long_prompt_tokens // 4 and not is_long_prompt_here
        self._calm_since = (self._calm_since or now) if is_calm else None
        if now - self._last_change < p.min_dwell_s:
            return None
        level, n = s.level, s.num_workers
        if level == 0 and n >= 2:
            if s.longest_prompt_beside_streams >= p.long_prompt_tokens:
                return self._decision(s, 1, "long_prompt", f"a prompt of {s.longest_prompt_beside_streams} "
                                      f"tokens is being prefilled beside decoding streams ({s.num_decoding} "
                                      "decode)")
            # Only a tail that prefill chunks cause: with the median over the SLO too, decoding itself is
            # the bottleneck, and giving a decoding core to prefill would make it worse.
            is_tail = (s.tpot_p90_s is not None and s.itl_p50_s is not None and s.tpot_p90_s > p.itl_slo_s
                       and s.itl_p50_s <= p.itl_slo_s)
            if is_tail and s.queued_prompt_tokens and now >= self._itl_rule_off_until:
                assert s.tpot_p90_s is not None and s.itl_p50_s is not None
                return self._decision(s, 1, "itl_slo", f"TPOT p90 {s.tpot_p90_s * 1000:.0f} ms > SLO "
                                      f"{p.itl_slo_s * 1000:.0f} ms (median ITL {s.itl_p50_s * 1000:.0f} ms) "
                                      f"with {s.queued_prompt_tokens} prompt tokens queued")
            return None
        judged = self._judge_itl_move(s, now)
        if judged is not None:
            return judged
        if level >= 1 and level + 1 < n and s.ttft_p90_s is not None and s.ttft_p90_s > p.ttft_slo_s \
                and s.queued_prompt_tokens >= level * p.long_prompt_tokens:
            return self._decision(s, level + 1, "ttft_slo", f"TTFT p90 {s.ttft_p90_s:.2f} s > SLO "
                                  f"{p.ttft_slo_s:.2f} s with {s.queued_prompt_tokens} prompt tokens queued")
        if level >= 1 and self._calm_since is not None and now - self._calm_since >= p.calm_s:
            return self._decision(s, level - 1, "prefill_idle", f"under {p.long_prompt_tokens // 4} prompt "
                                  f"tokens queued and no long prompt for {p.calm_s:.0f} s")
        return None

    def _judge_itl_move(self, s: Signals, now: float) -> Decision | None:
        """calm_s after a move for the ITL SLO, did the requests' TPOT get better? If not by a tenth, the
        move cost a decoding core for nothing (decoding itself, not prefill interference, was short): go
        back, and leave the ITL rule off for ITL_RULE_BACKOFF calm periods."""
        before = self._tpot_before_itl_move
        if before is None or s.level != 1 or s.tpot_p90_s is None:
            return None
        if now - self._last_change < self.policy.calm_s:
            return None
        self._tpot_before_itl_move = None  # judged, whatever the verdict
        if s.tpot_p90_s < (1.0 - NO_GAIN) * before:
            return None
        self._itl_rule_off_until = now + ITL_RULE_BACKOFF * self.policy.calm_s
        return self._decision(s, 0, "no_gain", f"TPOT p90 {s.tpot_p90_s * 1000:.0f} ms after disaggregating, "
                              f"{before * 1000:.0f} ms before: no better")

    @staticmethod
    def _decision(s: Signals, to_level: int, reason: str, detail: str) -> Decision:
        return Decision(time.time(), s.level, to_level, reason, detail, s)
