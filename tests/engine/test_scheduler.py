"""The scheduler without a model: chunking, admission by blocks, preemption, abort."""

from __future__ import annotations

from llm_engine.batch import ModelInput, ModelOutput, SampledToken
from llm_engine.block_pool import BlockPool
from llm_engine.kv_cache_manager import KVCacheManager
from llm_engine.params import SamplingParams
from llm_engine.request import Request, RequestStatus
from llm_engine.scheduler import Scheduler

BLOCK = 4


def make(num_blocks: int = 64, budget: int = 16, max_seqs: int = 8, prefix_caching: bool = True) -> Scheduler:
    return Scheduler(KVCacheManager(BlockPool(num_blocks), BLOCK, prefix_caching), budget, max_seqs)


def fake_forward(batch: ModelInput) -> ModelOutput:
    # The test's stand-in for the model's choice: token 7 for every chunk that samples.
    return ModelOutput(tuple(SampledToken(c.request_id, 7, None) for c in batch.chunks if c.sampling))


def add(scheduler: Scheduler, request_id: str, prompt_len: int, max_tokens: int = 4) -> Request:
    request = Request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=max_tokens))
    scheduler.add(request)
    return request


def run_to_end(scheduler: Scheduler, max_steps: int = 500) -> list[ModelInput]:
    batches = []
    for _ in range(max_steps):
        if not scheduler.num_unfinished:
            break
        batch = scheduler.schedule()
        batches.append(batch)
        scheduler.update(batch, fake_forward(batch))
    return batches


def test_chunking_bounds_tokens_per_step_and_lets_decodes_through() -> None:
    scheduler = make(budget=16)
    add(scheduler, "short", 3, max_tokens=10)
    long = add(scheduler, "long", 100)
    batches = run_to_end(scheduler)
    assert all(b.num_tokens <= 16 for b in batches)
    # While the long prompt is being chunked, the short request decodes in every step.
    chunked_steps = [
        b for b in batches if any(c.request_id == "long" and c.sampling is None for c in b.chunks)
    ]
    assert len(chunked_steps) >= 6
    assert all(any(c.request_id == "short" for c in b.chunks) for b in chunked_steps[1:7])
    assert long.status is RequestStatus.FINISHED_LENGTH and long.num_output_tokens == 4
    assert scheduler.kv.pool.is_whole()


def test_admission_waits_for_blocks_and_sequence_slots() -> None:
    scheduler = make(num_blocks=6, budget=64, max_seqs=2)
    for i in range(3):
        add(scheduler, f"r{i}", 8)  # 2 blocks each, plus growth
    first = scheduler.schedule()
    assert [c.request_id for c in first.chunks] == ["r0", "r1"]  # max_seqs = 2
    assert [r.request_id for r in scheduler.waiting] == ["r2"]
    scheduler.update(first, fake_forward(first))
    run_to_end(scheduler)
    assert scheduler.kv.pool.is_whole()


def test_preemption_requeues_newest_and_keeps_its_tokens() -> None:
    scheduler = make(num_blocks=5, budget=64, prefix_caching=False)
    old = add(scheduler, "old", 8, max_tokens=9)  # grows to 17 tokens: 5 blocks
    new = add(scheduler, "new", 7, max_tokens=9)
    batches = run_to_end(scheduler)
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert old.output_token_ids == [7] * 9 and new.output_token_ids == [7] * 9
    # Recomputation re-sends prompt and generated tokens in one prefill chunk.
    recompute = [c for b in batches for c in b.chunks if c.request_id == "new" and c.start_position == 0]
    assert len(recompute) == 2 and recompute[1].num_tokens > 7
    assert scheduler.kv.pool.is_whole()


def test_abort_in_every_state_frees_blocks() -> None:
    scheduler = make(num_blocks=16, budget=8)
    add(scheduler, "queued", 30)
    add(scheduler, "prefilling", 30)
    batch = scheduler.schedule()  # "queued" takes the whole budget: "prefilling" still waits
    scheduler.update(batch, fake_forward(batch))
    batch = scheduler.schedule()
    assert scheduler.abort("queued") is not None  # mid-prefill, while its forward "runs"
    scheduler.update(batch, fake_forward(batch))
    assert scheduler.abort("prefilling") is not None
    assert scheduler.abort("missing") is None
    assert scheduler.num_unfinished == 0
    assert scheduler.kv.pool.is_whole()


def test_admission_keeps_the_watermark_free_while_others_run() -> None:
    scheduler = Scheduler(KVCacheManager(BlockPool(10), BLOCK), 64, 8, watermark_blocks=3)
    add(scheduler, "first", 16, max_tokens=2)  # 4 blocks (+1 to grow): admitted even into the reserve
    add(scheduler, "second", 12, max_tokens=2)  # 3 more would leave 3 free: exactly the watermark, admitted
    add(scheduler, "third", 4, max_tokens=2)  # 1 more would leave 2 < 3: waits
    batch = scheduler.schedule()
    assert [c.request_id for c in batch.chunks] == ["first", "second"]
    assert scheduler.kv.pool.num_free_blocks == 3
    scheduler.update(batch, fake_forward(batch))
    run_to_end(scheduler)
    assert scheduler.kv.pool.is_whole()


def test_token_slices_match_the_whole_token_list() -> None:
    request = Request("x", [1, 2, 3, 4], SamplingParams(), output_token_ids=[5, 6, 7])
    every = request.all_token_ids
    for start in range(8):
        for end in range(start, 8):
            assert request.token_ids_between(start, end) == tuple(every[start:end])


def test_prompts_beside_decoding_requests_are_sliced_to_the_prefill_budget() -> None:
    """Stall-free batching: while a request decodes, a step carries at most prefill_budget_beside_decode
    prompt tokens (the decoding request's own token on top); with nothing decoding, the whole budget."""
    scheduler = make(budget=64)
    scheduler.prefill_budget_beside_decode = 8
    first = add(scheduler, "first", 40, max_tokens=30)
    batch = scheduler.schedule()  # nothing decodes yet: the prompt takes the whole budget
    assert batch.num_tokens == 40
    scheduler.update(batch, fake_forward(batch))
    second = Request("second", list(range(100, 130)), SamplingParams(max_tokens=5))  # no shared prefix
    scheduler.add(second)
    steps = []
    while second.num_output_tokens == 0:
        batch = scheduler.schedule()
        steps.append({c.request_id: c.num_tokens for c in batch.chunks})
        scheduler.update(batch, fake_forward(batch))
    # Every step decodes "first" and adds at most 8 prompt tokens of "second": 30 tokens in 4 slices.
    assert steps == [{"first": 1, "second": 8}] * 3 + [{"first": 1, "second": 6}]
    assert first.num_output_tokens == 5
    run_to_end(scheduler)
    assert scheduler.kv.pool.is_whole()


def test_a_suspect_computes_alone_and_every_request_finishes() -> None:
    """Review N5: a request that was in a failed step's batch on another worker is recomputed here alone,
    never beside another request, so a second failure names it and no innocent request shares the blame."""
    scheduler = make(budget=64)
    innocents = [add(scheduler, f"r{i}", 6, max_tokens=6) for i in range(3)]
    scheduler.schedule()  # (the innocents' prompts, batched)
    suspect = Request("q", list(range(9)), SamplingParams(max_tokens=6), suspect_group="w1/7")
    scheduler.add(suspect)  # it arrives while the others run, as a migrated request does
    batches = run_to_end(scheduler)
    with_suspect = [b for b in batches if any(c.request_id == "q" for c in b.chunks)]
    # Alone until its recompute has given a token; then it is cleared and batches with the others.
    first = batches.index(with_suspect[0])
    [recompute] = with_suspect[0].chunks
    assert recompute.start_position + recompute.num_tokens == 9  # its whole prompt (past a cached block)
    assert not suspect.is_suspect
    assert any(len(b.chunks) > 1 for b in with_suspect[1:])
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in [*innocents, suspect])
    assert len(suspect.output_token_ids) == 6
    assert any(c.request_id.startswith("r") for b in batches[first + 1:] for c in b.chunks)


def test_suspects_of_one_failure_compute_together_and_never_beside_others() -> None:
    """Issue 48, defect 3 (review P1): the suspects of one failed step are tried as one group (one forward
    for all of them, not one forward each), apart from the other requests and from another failure's
    suspects; each is cleared once it has computed a token in its group's forward."""
    scheduler = make(budget=256)
    innocents = [add(scheduler, f"r{i}", 6, max_tokens=8) for i in range(2)]
    scheduler.update(batch := scheduler.schedule(), fake_forward(batch))
    group_a = [Request(f"a{i}", list(range(10 * i, 10 * i + 7)), SamplingParams(max_tokens=4),
                       suspect_group="w1/3") for i in range(4)]
    group_b = [Request(f"b{i}", list(range(100 + 10 * i, 100 + 10 * i + 5)), SamplingParams(max_tokens=4),
                       suspect_group="w2/9") for i in range(2)]
    for request in group_a + group_b:
        scheduler.add(request)
    batches = run_to_end(scheduler)
    suspect_ids = {r.request_id for r in group_a + group_b}
    for batch in batches:
        # A forward with a suspect's recompute (its chunk of prompt + tokens, computed while still a
        # suspect) holds that suspect's group and nobody else.
        if any(c.request_id in suspect_ids and c.num_tokens > 1 for c in batch.chunks):
            assert len({c.request_id[0] for c in batch.chunks}) == 1, [c.request_id for c in batch.chunks]
    first_a = next(b for b in batches if any(c.request_id == "a0" for c in b.chunks))
    assert {c.request_id for c in first_a.chunks} == {f"a{i}" for i in range(4)}  # the group at once
    assert all(not r.is_suspect for r in group_a + group_b)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in [*innocents, *group_a, *group_b])
    assert scheduler.kv.pool.is_whole()


def test_a_suspect_waiting_does_not_hold_back_the_others_admission() -> None:
    """A suspect at the head of WAITING used to stop every admission on the others' turns: now the others
    are admitted past it."""
    scheduler = make(budget=256)
    add(scheduler, "r0", 6, max_tokens=8)
    scheduler.update(batch := scheduler.schedule(), fake_forward(batch))
    scheduler.add(Request("q", list(range(50, 57)), SamplingParams(max_tokens=3), suspect_group="w1/1"))
    late = add(scheduler, "late", 6, max_tokens=3)
    seen: list[set[str]] = []
    for _ in range(2):
        batch = scheduler.schedule()
        seen.append({c.request_id for c in batch.chunks})
        scheduler.update(batch, fake_forward(batch))
    assert {"r0", "late"} in seen and {"q"} in seen, seen
    assert late.num_output_tokens >= 1
    run_to_end(scheduler)
    assert scheduler.kv.pool.is_whole()
