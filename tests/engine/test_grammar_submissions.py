"""Review P5: grammars compiled at submission stay with their requests. More distinct schemas live on one
worker than its compiled-grammar cache holds, the requests waiting for blocks and preempted: the step thread
compiles none of them again (each compiled exactly once, at submission). A batch's requests without a grammar
are submitted before its grammars compile. The tiny random Llama with SmolLM2's tokenizer, the real cache."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from pathlib import Path

import jsonschema

from llm_engine import SamplingParams
from llm_engine.structured import MAX_CACHED_GRAMMARS, GrammarSpec
from pool_worker.submissions import compile_grammars, submit_batch
from prefill_pool.messages import PrefillRequest
from tests.helpers.engines import make_engine
from tests.helpers.reference import random_prompts
from worker_runtime.aborted import AbortedIds

EOS = 2  # SmolLM2's <|im_end|>: the tiny model's config names none (requests name it, as the gateway does)
NUM_SCHEMAS = MAX_CACHED_GRAMMARS + 16


def schema(index: int) -> dict[str, object]:
    return {"type": "object", "additionalProperties": False, "required": [f"k{index}"],
            "properties": {f"k{index}": {"type": "integer", "minimum": 0, "maximum": 9}}}


def test_more_live_grammars_than_the_cache_holds_compile_once_each(tiny_chat_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    # 24 blocks of 16 tokens for 80 requests of a block or two each: most wait, some are preempted.
    engine = make_engine(tiny_chat_model_dir, num_blocks=24)
    cache = engine.runner.grammar_mask.cache
    prompts = random_prompts([6] * NUM_SCHEMAS, 49152, seed=11)
    requests = [PrefillRequest(f"r{i}", tuple(prompt), SamplingParams(
        max_tokens=24, temperature=1.0, seed=i, stop_token_ids=(EOS,),
        grammar=GrammarSpec.of_schema(schema(i)))) for i, prompt in enumerate(prompts)]
    assert asyncio.run(compile_grammars(cache, requests)) == {}  # the submission's compiles
    assert cache.num_compiled == NUM_SCHEMAS and len(cache) == MAX_CACHED_GRAMMARS  # 16 evicted already
    ids = [engine.add_request(r.prompt_token_ids, r.sampling, r.request_id) for r in requests]
    tracked = [engine.scheduler.requests[i] for i in ids]
    while engine.has_unfinished():
        engine.step()
    assert cache.num_compiled == NUM_SCHEMAS  # none on the step thread, however often each registered
    for index, request in enumerate(tracked):
        assert request.output_token_ids[-1] == EOS
        jsonschema.validate(json.loads(tokenizer.decode(request.output_token_ids[:-1])), schema(index))
    assert engine.block_pool.is_whole()


def test_a_batchs_plain_requests_are_submitted_before_its_grammars_compile(tiny_chat_model_dir: Path
                                                                           ) -> None:
    cache = make_engine(tiny_chat_model_dir, num_blocks=4).runner.grammar_mask.cache
    hold = cache.hold
    compiling = threading.Event()

    def slow_hold(spec: GrammarSpec) -> None:  # a grammar that takes its time
        compiling.set()
        time.sleep(0.5)
        hold(spec)

    cache.hold = slow_hold  # type: ignore[method-assign]
    structured = PrefillRequest("structured", (5, 6, 7), SamplingParams(
        stop_token_ids=(EOS,), grammar=GrammarSpec.of_schema(schema(0))))
    plain = PrefillRequest("plain", (5, 6, 7), SamplingParams())
    submitted: list[tuple[str, bool]] = []
    reasons = asyncio.run(submit_batch(
        [structured, plain], lambda r: submitted.append((r.request_id, compiling.is_set())), AbortedIds(),
        cache))
    assert reasons == ["", ""]  # in the batch's order
    assert submitted == [("plain", False), ("structured", True)]  # plain first, before any compile began
