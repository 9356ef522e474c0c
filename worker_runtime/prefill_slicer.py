"""PrefillSlicer: how many prompt tokens a step may add while requests decode, from the worker's own step
times (stall-free batching, as in Sarathi-Serve).

A worker that decodes and also prefills (mixed, or a decode worker recomputing a migrated stream) would
otherwise run a whole prompt chunk (up to max_num_batched_tokens) in the step its streams wait on: a 256-token
prompt beside two streams gave them a 0.5-0.7 s gap on a CPU core. Here each step's duration is split into
its decode part (the EWMA of steps without prompt tokens) and its prompt part (the rest, per prompt token,
EWMA); the budget is the prompt tokens that fit in `target_s`, so a stream's gap grows by about `target_s`
whatever the hardware (a GPU fits thousands of tokens, a CPU core a few dozen).
    observe(duration, prompt tokens, decode tokens) after every forward → budget() before the next
"""

from __future__ import annotations

ALPHA = 0.2  # weight of the newest step in each average
MIN_TOKENS = 16  # a slice this small still makes progress on the longest prompt


class PrefillSlicer:
    def __init__(self, target_s: float, max_tokens: int) -> None:
        """Args:
        target_s: seconds of prompt work one step may add beside decoding streams (0: no limit).
        max_tokens: the forward's whole budget (max_num_batched_tokens).
        """
        self.target_s = target_s
        self.max_tokens = max_tokens
        self.decode_step_s: float | None = None
        self.prefill_token_s: float | None = None

    def observe(self, duration_s: float, num_prefill: int, num_decode: int) -> None:
        if not num_prefill:
            if num_decode:
                self.decode_step_s = _average(self.decode_step_s, duration_s)
            return
        baseline = (self.decode_step_s or 0.0) if num_decode else 0.0
        prompt_s = duration_s - baseline
        if prompt_s > 0:
            self.prefill_token_s = _average(self.prefill_token_s, prompt_s / num_prefill)

    def budget(self) -> int | None:
        """Prompt tokens the next step may carry beside decoding requests (None: no limit)."""
        if self.target_s <= 0:
            return None
        if self.prefill_token_s is None:  # nothing prefilled yet: the first prompt measures the cost
            return MIN_TOKENS
        return max(MIN_TOKENS, min(self.max_tokens, int(self.target_s / self.prefill_token_s)))


def _average(old: float | None, new: float) -> float:
    return new if old is None else (1 - ALPHA) * old + ALPHA * new
