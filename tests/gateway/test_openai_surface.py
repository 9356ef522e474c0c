"""The OpenAI surface through the real two-stage path (1 prefill + 2 decode Ray actors, tiny random Llama with
SmolLM2's tokenizer, float32), with the openai SDK where it can say it: penalties and logit_bias equal the
engine alone and change the output, also across a forced migration (a third worker recomputes prompt +
tokens so far); top_logprobs and echoed prompt logprobs are transformers' log-softmax; lm-eval's
local-completions requests; batches of prompts, /tokenize, /detokenize, /version and /v1/models."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from llm_engine import SamplingParams
from tests.helpers import two_stage_server
from tests.helpers.engines import make_engine
from tests.helpers.forced_migration import stream_across_a_failure
from tests.helpers.reference import random_prompts
from tests.helpers.servers import MODEL

# The shared server shape's fixtures (tests/helpers/two_stage_server.py), under the names the tests ask for.
server, sdk, client = two_stage_server.shared_two_stage_server, two_stage_server.sdk, two_stage_server.client
VOCAB = 49152
PENALISED = {"presence_penalty": 1.5, "frequency_penalty": 0.8, "logit_bias": {"5": 6.0, "17": -100.0}}
REPETITION = {"repetition_penalty": 0.5}  # < 1 favours seen tokens (this random model never repeats alone)


@pytest.fixture(scope="module")
def engine_alone(tiny_chat_model_dir: Path) -> Any:
    return make_engine(tiny_chat_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_chat_model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()


def log_softmax(model: torch.nn.Module, token_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)  # [T, V]


def reference(engine: Any, prompt: list[int], max_tokens: int, **fields: Any) -> list[int]:
    bias = tuple((int(k), v) for k, v in fields.pop("logit_bias", {}).items())
    params = SamplingParams(max_tokens=max_tokens, temperature=0, logit_bias=bias, **fields)
    [completion] = engine.generate([prompt], params)
    return list(completion.output_token_ids)


def test_penalties_and_logit_bias_equal_the_engine_alone_and_change_the_output(
        sdk: openai.OpenAI, engine_alone: Any, client: httpx.Client) -> None:
    prompt = random_prompts([40], VOCAB, seed=21)[0]

    def tokens(**fields: Any) -> list[int]:
        extra = {k: fields.pop(k) for k in ("repetition_penalty",) if k in fields}
        completion = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"return_token_ids": True, **extra}, **fields)
        return list(completion.choices[0].token_ids)  # type: ignore[attr-defined]

    plain = tokens()
    for fields in (PENALISED, REPETITION):
        served = tokens(**fields)
        assert served == reference(engine_alone, prompt, 24, **fields)
        assert served != plain, f"{fields} changed nothing"
    biased = tokens(logit_bias={str(plain[3]): -100})
    assert plain[3] not in biased  # banned
    forced = tokens(logit_bias={"77": 100})
    assert forced == [77] * 24


def test_min_tokens_and_stop_token_ids(sdk: openai.OpenAI, engine_alone: Any, client: httpx.Client) -> None:
    prompt = random_prompts([20], VOCAB, seed=22)[0]
    plain = reference(engine_alone, prompt, 10)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0, "return_token_ids": True,
            "stop_token_ids": [plain[1]]}
    stopped = client.post("/v1/completions", json=body).json()["choices"][0]
    assert stopped["token_ids"] == plain[:2] and stopped["finish_reason"] == "stop"
    held = client.post("/v1/completions", json={**body, "min_tokens": 5}).json()["choices"][0]
    assert held["token_ids"] == reference(engine_alone, prompt, 10, stop_token_ids=(plain[1],), min_tokens=5)
    assert len(held["token_ids"]) >= 5


def test_chat_top_logprobs_are_transformers_log_softmax(sdk: openai.OpenAI, hf_model: torch.nn.Module,
                                                        client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    prompt = client.post("/tokenize", json={"model": MODEL, "messages": messages}).json()["tokens"]
    whole = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
                                        logprobs=True, top_logprobs=5, extra_body={"return_token_ids": True})
    choice = whole.choices[0]
    generated = list(choice.token_ids)  # type: ignore[attr-defined]
    expected = log_softmax(hf_model, prompt + generated)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    texts = client.post("/detokenize", json={"tokens": generated}).json()
    assert "".join(e.token for e in choice.logprobs.content) == texts["prompt"]
    for i, entry in enumerate(choice.logprobs.content):
        row = expected[len(prompt) - 1 + i]
        assert entry.logprob == pytest.approx(row[generated[i]].item(), abs=1e-4)
        values, indices = torch.topk(row, 5)
        assert [t.logprob for t in entry.top_logprobs] == pytest.approx(values.tolist(), abs=1e-4)
        decoded = [client.post("/detokenize", json={"tokens": [t]}).json()["prompt"]
                   for t in indices.tolist()]
        assert [t.token for t in entry.top_logprobs] == decoded  # text, not BPE pieces
        assert entry.bytes == list(entry.token.encode())
    streamed = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,  # type: ignore[arg-type]
                                           logprobs=True, top_logprobs=5, stream=True)
    entries = [e for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for e in chunk.choices[0].logprobs.content or []]
    assert [e.token for e in entries] == [e.token for e in choice.logprobs.content]
    # Not bit-equal: the second request reads the first's cached prefix, a different (equally exact) sum.
    whole_logprobs = [e.logprob for e in choice.logprobs.content]
    assert [e.logprob for e in entries] == pytest.approx(whole_logprobs, abs=1e-4)


def test_echo_with_max_tokens_zero_scores_the_prompt_as_transformers(
        sdk: openai.OpenAI, hf_model: torch.nn.Module, client: httpx.Client) -> None:
    text = "The quick brown fox jumps over the lazy dog, and then it runs back home again for a while."
    prompt = client.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert len(prompt) > 16
    scored = sdk.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2,
                                    temperature=0)
    choice = scored.choices[0]
    assert choice.text == text and scored.usage is not None and scored.usage.completion_tokens == 0
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == len(prompt) and logprobs.token_logprobs[0] is None
    expected = log_softmax(hf_model, prompt)
    for position in range(1, len(prompt)):
        assert logprobs.token_logprobs[position] == pytest.approx(
            expected[position - 1, prompt[position]].item(), abs=1e-4)
        assert len(logprobs.top_logprobs[position]) == 2
    assert logprobs.tokens is not None and "".join(logprobs.tokens) == text
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(len(prompt))]
    # lm-eval's loglikelihood request: echo, logprobs 1, max_tokens 1; it drops the generated token.
    body = {"model": MODEL, "prompt": text, "max_tokens": 1, "echo": True, "logprobs": 1, "temperature": 0}
    lm_eval = client.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert lm_eval["token_logprobs"][:-1] == logprobs.token_logprobs
    assert all(max(top.values()) >= lp for top, lp in zip(lm_eval["top_logprobs"][1:-1],
                                                           lm_eval["token_logprobs"][1:-1], strict=True))


def test_lm_evals_local_completions_requests_as_it_sends_and_reads_them(
        client: httpx.Client, hf_model: torch.nn.Module) -> None:
    """lm-eval 0.4's local-completions, pinned: its loglikelihood payload (a batch of token-id prompts,
    context + continuation, with `seed`), read as its parse_logprobs reads it (the continuation's
    token_logprobs, greedy when each equals its position's top_logprobs maximum); and its generate_until
    payload (text prompts, `stop` list, `seed`)."""
    contexts, continuations = random_prompts([9, 14], VOCAB, seed=41), random_prompts([3, 1], VOCAB, seed=42)
    prompts = [c + x for c, x in zip(contexts, continuations, strict=True)]
    body = {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    answer = client.post("/v1/completions", json=body)
    assert answer.status_code == 200, answer.text
    for choice, prompt, context in zip(sorted(answer.json()["choices"], key=lambda c: c["index"]), prompts,
                                       contexts, strict=True):
        ctxlen = len(context)
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert len(token_logprobs) == len(prompt) - ctxlen and all(isinstance(t, dict) for t in tops)
        expected = log_softmax(hf_model, prompt)
        want = sum(expected[i - 1, prompt[i]].item() for i in range(ctxlen, len(prompt)))
        assert sum(token_logprobs) == pytest.approx(want, abs=1e-4)
        is_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops, strict=True))
        argmaxes = [expected[i - 1].argmax().item() for i in range(ctxlen, len(prompt))]
        assert is_greedy == (argmaxes == prompt[ctxlen:])
    generate = {"prompt": ["Question: 2 + 2?\nAnswer:"], "model": MODEL, "max_tokens": 8, "temperature": 0,
                "stop": ["\n\n", "Question:"], "seed": 1234}
    answer = client.post("/v1/completions", json=generate)
    assert answer.status_code == 200 and isinstance(answer.json()["choices"][0]["text"], str), answer.text


def test_batches_of_prompts_answer_one_choice_each(client: httpx.Client) -> None:
    ids = random_prompts([5, 9], VOCAB, seed=23)
    for batch in (["Hello there", "Goodbye now"], ids):
        body = {"model": MODEL, "prompt": batch, "max_tokens": 4, "temperature": 0}
        answer = client.post("/v1/completions", json=body).json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        for prompt, choice in zip(batch, answer["choices"], strict=True):
            alone = client.post("/v1/completions", json={**body, "prompt": prompt}).json()["choices"][0]
            assert choice["text"] == alone["text"]
        assert answer["usage"]["completion_tokens"] == 8


def test_tokenize_detokenize_version_and_models(client: httpx.Client, tiny_chat_model_dir: Path) -> None:
    tokens = client.post("/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 1024
    assert client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == "Hello world"
    assert client.get("/version").json()["version"]
    [model] = client.get("/v1/models").json()["data"]
    assert (model["id"], model["root"], model["owned_by"], model["max_model_len"]) == (
        MODEL, str(tiny_chat_model_dir), "pdserve", 1024)
    assert client.post("/detokenize", json={"tokens": [VOCAB]}).status_code == 400


def test_bad_input_is_a_400_the_sdk_reports(sdk: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    logprobs=True, top_logprobs=21)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                    response_format={"type": "json_schema", "json_schema": {
                                        "name": "x", "schema": {"type": "frob"}}})
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        sdk.completions.create(model=MODEL, prompt="x", max_tokens=2, logit_bias={"-3": 1})


def test_penalties_hold_across_a_forced_migration(client: httpx.Client, engine_alone: Any) -> None:
    """The decode worker's step fails mid-stream: the stream moves to the other decode worker, which
    recomputes prompt + tokens so far and must go on with the same penalties (its counts rebuilt from them).
    Last in the module: the failed worker is replaced."""
    prompt = random_prompts([30], VOCAB, seed=24)[0]
    fields = {**PENALISED, **REPETITION}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0, **fields}
    tokens, moves = stream_across_a_failure(client, body)
    assert moves == [1]
    assert tokens[0] == reference(engine_alone, prompt, 30, **fields)
