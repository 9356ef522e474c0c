"""The prompt budget beside decoding requests follows the worker's measured step times."""

from __future__ import annotations

from worker_runtime.prefill_slicer import MIN_TOKENS, PrefillSlicer


def test_the_budget_is_the_prompt_tokens_that_fit_the_target_beside_a_decode_step() -> None:
    slicer = PrefillSlicer(target_s=0.1, max_tokens=512)
    assert slicer.budget() == MIN_TOKENS  # nothing measured yet
    slicer.observe(0.5, num_prefill=250, num_decode=0)  # 2 ms per prompt token
    assert slicer.budget() == 50
    for _ in range(50):  # decode steps of 40 ms, then prompt slices that cost 2 ms a token on top
        slicer.observe(0.04, num_prefill=0, num_decode=2)
        slicer.observe(0.04 + 0.002 * 50, num_prefill=50, num_decode=2)
    assert 48 <= (slicer.budget() or 0) <= 52
    fast = PrefillSlicer(target_s=0.1, max_tokens=512)
    fast.observe(0.01, num_prefill=1000, num_decode=0)  # a GPU: the whole forward's budget
    assert fast.budget() == 512
    assert PrefillSlicer(target_s=0, max_tokens=512).budget() is None  # off
