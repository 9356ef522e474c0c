"""vLLM's request extensions through the real two-stage path (a prefill worker draws the first token, a
decode worker the rest; Ray actors, the tiny random Llama with SmolLM2's tokenizer and a Qwen3-style
`enable_thinking` in its chat template), sent as a vLLM user sends them: the openai SDK's `extra_body`. Each
at its default changes nothing; at another value it does what vLLM documents, and the tokens equal the engine
alone with the same parameters; sampling state (bad words, allowed ids, min_p/top_k with a seed) survives a
decode worker failing mid-stream. A request without `model` gets the served model. On the shared two-stage
server (its last test leaves a decode worker replaced)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from gateway.api.extensions import bad_word_token_ids
from llm_engine import SamplingParams
from tests.helpers import two_stage_server
from tests.helpers.engines import make_engine
from tests.helpers.forced_migration import stream_across_a_failure
from tests.helpers.reference import random_prompts
from tests.helpers.servers import MODEL
from tests.helpers.vllm_defaults import CHAT_DEFAULTS, DEFAULTS

pytestmark = pytest.mark.slow  # a Ray fleet (1 prefill + 2 decode workers) and a server

VOCAB = 49152


# The shared two-stage server's fixtures (tests/helpers/two_stage_server.py), by the names the tests ask for:
# the tiny chat model's template has Qwen3's enable_thinking switch (tests/conftest.py).
server, sdk, client = two_stage_server.shared_two_stage_server, two_stage_server.sdk, two_stage_server.client


@pytest.fixture(scope="module")
def engine_alone(tiny_chat_model_dir: Path) -> Any:
    return make_engine(tiny_chat_model_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model_dir)


def reference(engine: Any, prompt: list[int], max_tokens: int, **fields: Any) -> list[int]:
    params = SamplingParams(**{"max_tokens": max_tokens, "temperature": 0.0, **fields})
    [completion] = engine.generate([prompt], params)
    return list(completion.output_token_ids)


def complete(sdk: openai.OpenAI, prompt: list[int] | str, max_tokens: int = 12, temperature: float = 0.0,
             **extra: Any) -> Any:
    return sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                  extra_body={"return_token_ids": True, **extra})


def ids(completion: Any) -> list[int]:
    return list(completion.choices[0].token_ids)


def template_ids(tokenizer: Any, messages: list[dict[str, str]], **kwargs: Any) -> list[int]:
    encoded = tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def test_every_extension_at_its_default_changes_nothing(sdk: openai.OpenAI, client: httpx.Client) -> None:
    prompt = random_prompts([30], VOCAB, seed=31)[0]
    plain = complete(sdk, prompt)
    defaults = complete(sdk, prompt, **DEFAULTS)
    assert ids(defaults) == ids(plain) and defaults.choices[0].text == plain.choices[0].text
    assert defaults.timings["prefill_on"] == "prefill"  # both stages ran
    messages = [{"role": "user", "content": "Tell me a story"}]
    chat_plain = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                             temperature=0)
    chat_defaults = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=12,
                                                temperature=0, extra_body={**DEFAULTS, **CHAT_DEFAULTS})
    assert chat_defaults.choices[0].message.content == chat_plain.choices[0].message.content
    assert chat_defaults.usage is not None and chat_plain.usage is not None
    assert chat_defaults.usage.prompt_tokens == chat_plain.usage.prompt_tokens
    assert chat_defaults.usage.completion_tokens == chat_plain.usage.completion_tokens


def test_a_request_without_model_gets_the_served_model(sdk: openai.OpenAI, client: httpx.Client) -> None:
    chat = sdk.chat.completions.create(model=openai.omit, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3)
    assert chat.model == MODEL and chat.choices[0].finish_reason == "length"
    response = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["model"] == MODEL
    wrong = client.post("/v1/completions", json={"model": "other", "prompt": "Hello", "max_tokens": 3})
    assert wrong.status_code == 404


def test_top_k_and_min_p(sdk: openai.OpenAI, engine_alone: Any, client: httpx.Client) -> None:
    prompt = random_prompts([30], VOCAB, seed=32)[0]
    greedy = ids(complete(sdk, prompt))
    assert ids(complete(sdk, prompt, temperature=1.0, seed=3, top_k=1)) == greedy
    assert ids(complete(sdk, prompt, temperature=1.0, seed=3, min_p=1.0)) == greedy
    # Seeded sampling: token 0 drawn on the prefill worker, the rest on the decode worker, as one engine.
    unfiltered = ids(complete(sdk, prompt, 16, temperature=1.5, seed=11))
    filtered = []
    for extra in ({"min_p": 0.05}, {"top_k": 5}, {"min_p": 0.02, "top_k": 20}):
        served = ids(complete(sdk, prompt, 16, temperature=1.5, seed=11, **extra))
        assert served == reference(engine_alone, prompt, 16, temperature=1.5, seed=11, **extra)
        filtered.append(served)
    assert any(tokens != unfiltered for tokens in filtered), "min_p and top_k changed nothing"


def _round_trip_word(tokenizer: Any, tokens: list[int], start: int, size: int) -> str | None:
    """A text of `size` consecutive output tokens (from `start` on) that tokenizes back to those tokens."""
    for i in range(start, len(tokens) - size + 1):
        word = tokenizer.decode(tokens[i : i + size])
        if tuple(tokens[i : i + size]) in bad_word_token_ids(tokenizer, [word]):
            return str(word)
    return None


def _contains(tokens: list[int], word: tuple[int, ...]) -> bool:
    return any(tuple(tokens[i : i + len(word)]) == word for i in range(len(tokens) - len(word) + 1))


def test_bad_words_and_allowed_token_ids(sdk: openai.OpenAI, engine_alone: Any, tokenizer: Any,
                                         client: httpx.Client) -> None:
    prompt = random_prompts([30], VOCAB, seed=33)[0]
    plain = ids(complete(sdk, prompt, 16))
    word = _round_trip_word(tokenizer, plain, 2, 1)
    assert word is not None
    sequences = bad_word_token_ids(tokenizer, [word])
    banned = ids(complete(sdk, prompt, 16, bad_words=[word]))
    assert banned == reference(engine_alone, prompt, 16, bad_words=sequences)
    assert banned != plain and not any(_contains(banned, s) for s in sequences)
    allowed = sorted({*plain[5:8], 5, 17, 300})
    restricted = ids(complete(sdk, prompt, 10, allowed_token_ids=allowed))
    assert restricted == reference(engine_alone, prompt, 10, allowed_token_ids=tuple(allowed))
    assert set(restricted) <= set(allowed)
    outside = client.post("/v1/completions", json={"prompt": prompt, "allowed_token_ids": [VOCAB]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "allowed_token_ids"


def test_prompt_logprobs(sdk: openai.OpenAI, tiny_chat_model_dir: Path, client: httpx.Client) -> None:
    from transformers import AutoModelForCausalLM

    prompt = random_prompts([20], VOCAB, seed=34)[0]
    scored = complete(sdk, prompt, 2, prompt_logprobs=2).choices[0].prompt_logprobs
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), dim=-1)  # [P, V]
    assert len(scored) == len(prompt) and scored[0] is None
    for position in range(1, len(prompt)):
        entry, row = scored[position], expected[position - 1]
        token = prompt[position]
        assert entry[str(token)]["logprob"] == pytest.approx(row[token].item(), abs=1e-4)
        # The engine's batched forward and this one differ by ~1e-5, so a rank among near-tied logprobs (a
        # random model's tail) may move by the tokens inside that noise: it must lie in the band they allow.
        fewest, most = int((row > row[token] + 1e-4).sum()) + 1, int((row > row[token] - 1e-4).sum()) + 1
        assert fewest <= entry[str(token)]["rank"] <= most
        top2 = torch.topk(row, 2).indices.tolist()
        assert {str(t) for t in top2} <= set(entry) <= {str(t) for t in [*top2, token]}
        assert entry[str(top2[0])]["rank"] == 1
    assert complete(sdk, prompt, 2).choices[0].model_extra.get("prompt_logprobs") is None
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=2, extra_body={"prompt_logprobs": 0})
    chat_scored = chat.prompt_logprobs
    assert chat.usage is not None and len(chat_scored) == chat.usage.prompt_tokens
    assert all(len(entry) == 1 for entry in chat_scored[1:])  # k = 0: the prompt's own token only
    with pytest.raises(openai.BadRequestError) as refused:
        sdk.completions.create(model=MODEL, prompt=prompt, stream=True, extra_body={"prompt_logprobs": 1})
    assert refused.value.body["param"] == "prompt_logprobs"


def test_truncate_prompt_tokens(sdk: openai.OpenAI, engine_alone: Any, tokenizer: Any,
                                client: httpx.Client) -> None:
    prompt = random_prompts([40], VOCAB, seed=35)[0]
    cut = complete(sdk, prompt, 8, truncate_prompt_tokens=10, echo=True)
    assert cut.usage.prompt_tokens == 10
    assert ids(cut) == reference(engine_alone, prompt[-10:], 8)
    assert cut.choices[0].text.startswith(tokenizer.decode(prompt[-10:]))
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a b c d e f g"}],
                                       max_tokens=2, extra_body={"truncate_prompt_tokens": 5})
    assert chat.usage is not None and chat.usage.prompt_tokens == 5
    too_long = client.post("/v1/completions", json={"prompt": prompt, "truncate_prompt_tokens": 10**6})
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "truncate_prompt_tokens"


def test_skip_special_tokens(sdk: openai.OpenAI, client: httpx.Client) -> None:
    forced = {"logit_bias": {"1": 100}}  # <|im_start|>, a special token, every time
    skipped = sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0, **forced)
    assert skipped.choices[0].text == ""
    kept = sdk.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0,
                                  extra_body={"skip_special_tokens": False}, **forced)
    assert kept.choices[0].text == "<|im_start|>" * 3


def test_include_stop_str_in_output(sdk: openai.OpenAI, tokenizer: Any, client: httpx.Client) -> None:
    prompt = random_prompts([30], VOCAB, seed=36)[0]
    plain = complete(sdk, prompt, 16)
    text, tokens = plain.choices[0].text, ids(plain)
    at = next(i for i in range(len(text) // 3, len(text) - 3) if text.find(text[i : i + 3]) == i)
    stop = text[at : at + 3]
    cut = complete(sdk, prompt, 16, stop=[stop])
    kept = complete(sdk, prompt, 16, stop=[stop], include_stop_str_in_output=True)
    assert cut.choices[0].text == text[:at] and kept.choices[0].text == text[: at + 3]
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    # A stop token's text, as vLLM: left out unless asked for.
    k = next(i for i in range(3, len(tokens)) if tokens[i] not in tokens[:i])
    by_token = complete(sdk, prompt, 16, stop_token_ids=[tokens[k]])
    with_token = complete(sdk, prompt, 16, stop_token_ids=[tokens[k]], include_stop_str_in_output=True)
    assert ids(by_token) == ids(with_token) == tokens[: k + 1]
    assert by_token.choices[0].text == tokenizer.decode(tokens[:k])
    assert with_token.choices[0].text == tokenizer.decode(tokens[: k + 1])


def test_return_tokens_as_token_ids(sdk: openai.OpenAI, client: httpx.Client) -> None:
    prompt = random_prompts([20], VOCAB, seed=37)[0]
    completion = complete(sdk, prompt, 5, logprobs=2, return_tokens_as_token_ids=True)
    logprobs = completion.choices[0].logprobs
    assert logprobs.tokens == [f"token_id:{t}" for t in ids(completion)]
    assert all(re.fullmatch(r"token_id:\d+", key) for top in logprobs.top_logprobs for key in top)
    chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, logprobs=True, top_logprobs=2,
                                       extra_body={"return_tokens_as_token_ids": True,
                                                   "return_token_ids": True})
    content = chat.choices[0].logprobs.content
    assert [entry.token for entry in content] == [f"token_id:{t}" for t in chat.choices[0].token_ids]
    assert all(alt.token.startswith("token_id:") for entry in content for alt in entry.top_logprobs)


def test_chat_template_kwargs(sdk: openai.OpenAI, tokenizer: Any, client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "What is 2 + 2?"}]

    def prompt_tokens(**extra: Any) -> int:
        chat = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                           extra_body=extra)
        assert chat.usage is not None
        return chat.usage.prompt_tokens

    base = prompt_tokens()
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == base
    no_thinking = prompt_tokens(chat_template_kwargs={"enable_thinking": False})
    assert no_thinking == len(template_ids(tokenizer, messages, add_generation_prompt=True,
                                           enable_thinking=False))
    assert no_thinking > base
    reserved = client.post("/v1/chat/completions", json={"messages": messages,
                                                         "chat_template_kwargs": {"tokenize": False}})
    assert reserved.status_code == 400
    assert reserved.json()["error"]["param"] == "chat_template_kwargs.tokenize"


def test_add_generation_prompt_continue_final_message_and_echo(sdk: openai.OpenAI, tokenizer: Any,
                                                               client: httpx.Client) -> None:
    saying = "An apple a day, keeps"
    messages = [{"role": "user", "content": "Tell me a saying"}, {"role": "assistant", "content": saying}]
    continued = {"continue_final_message": True, "add_generation_prompt": False}
    for echo in (False, True):
        chat = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                           extra_body={**continued, "echo": echo})
        assert chat.usage is not None
        assert chat.usage.prompt_tokens == len(template_ids(tokenizer, messages, continue_final_message=True))
        assert (chat.choices[0].message.content or "").startswith(saying) is echo
    stream = sdk.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True,
                                         extra_body={**continued, "echo": True})
    first = next(iter(stream))
    assert first.choices[0].delta.content == saying
    stream.close()
    user_last = messages[:1]
    bare = sdk.chat.completions.create(model=MODEL, messages=user_last, max_tokens=2,
                                       extra_body={"add_generation_prompt": False})
    assert bare.usage is not None
    assert bare.usage.prompt_tokens == len(template_ids(tokenizer, user_last, add_generation_prompt=False))
    both = client.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_structured_outputs(sdk: openai.OpenAI, client: httpx.Client) -> None:
    def content(outputs: dict[str, Any], max_tokens: int = 40) -> str:
        chat = sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Answer"}],
                                           max_tokens=max_tokens, temperature=1.0, seed=4,
                                           extra_body={"structured_outputs": outputs})
        assert chat.choices[0].finish_reason == "stop", chat
        return chat.choices[0].message.content or ""

    assert content({"choice": ["yes", "no", "maybe"]}) in {"yes", "no", "maybe"}
    assert re.fullmatch(r"[a-c]{3}-\d", content({"regex": r"[a-c]{3}-\d"}))
    assert content({"grammar": 'start: "ab" | "cd" "e"'}) in {"ab", "cde"}
    assert content({"grammar": 'root ::= "x" ("y" | "z")'}) in {"xy", "xz"}
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    assert json.loads(content({"json": schema}))["answer"] in {"yes", "no"}
    assert json.loads(content({"json": json.dumps(schema)}))["answer"] in {"yes", "no"}
    for outputs, param in (({"json_object": True, "whitespace_pattern": " "},
                            "structured_outputs.whitespace_pattern"),
                           ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
                           ({"regex": "[a-"}, "structured_outputs.regex"),
                           ({"regex": "a", "backend": "xgrammar"}, "structured_outputs.backend")):
        refused = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                            "structured_outputs": outputs})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.json()
    guided = client.post("/v1/completions", json={"prompt": "x", "guided_regex": "a"})
    assert guided.status_code == 400 and "structured_outputs" in guided.json()["error"]["message"]


def test_priority_and_continuous_usage_stats(sdk: openai.OpenAI, client: httpx.Client) -> None:
    prompt = random_prompts([20], VOCAB, seed=38)[0]
    # A server admitting in arrival order (--scheduling-policy fcfs, the default) refuses a priority, as vLLM
    # does: any client could otherwise jump the line (review, LOW list).
    refused = client.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "priority": -5})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
    assert ids(complete(sdk, prompt, 6, priority=0)) == ids(complete(sdk, prompt, 6))
    stream = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True,
                                    extra_body={"stream_options": {"include_usage": True,
                                                                   "continuous_usage_stats": True}})
    chunks = list(stream)
    counts = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert counts == sorted(set(counts)) and counts[-1] == 6  # every chunk: the tokens so far
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_responses_show_no_prompt_cache_unless_the_server_says_so(client: httpx.Client) -> None:
    """Review P3: without --enable-prompt-tokens-details no response says whether the prompt was cached (a
    client could probe another's prompts with it), nor why a decode worker prefilled it."""
    body = {"model": MODEL, "prompt": list(range(3200, 3250)), "max_tokens": 2, "temperature": 0}
    for _ in range(2):  # the second one's prompt is cached: still not said
        answer = client.post("/v1/completions", json=body).json()
        assert "prompt_tokens_details" not in answer["usage"]
        timings = answer["timings"]
        assert "cached_tokens" not in timings and "local_prefill_reason" not in timings
    streamed = client.post("/v1/completions", json={**body, "stream": True,
                                                     "stream_options": {"include_usage": True}})
    chunks = [line for line in streamed.text.splitlines() if "usage" in line]
    assert chunks and all("cached_tokens" not in line for line in chunks)


def test_fields_once_dropped_in_silence_are_refused(client: httpx.Client) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for body, param in (
            ({"response_format": {"type": "text", "strict": True}}, "response_format.strict"),
            ({"stream": True, "stream_options": {"include_usage": True, "per_token": 1}},
             "stream_options.per_token"),
            ({"stream": True, "stream_options": {"continuous_usage_stats": True}},
             "stream_options.continuous_usage_stats"),
            ({"tools": [{"type": "function", "function": {"name": "f", "returns": {}}}]},
             "tools[0].function.returns")):
        refused = client.post("/v1/chat/completions", json={"messages": messages, **body})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == param, refused.json()
    bare = client.post("/tokenize", json={"prompt": "hi there", "add_special_tokens": False}).json()["tokens"]
    assert bare == client.post("/tokenize", json={"prompt": "hi there"}).json()["tokens"]  # no BOS here


def test_sampling_state_survives_a_decode_worker_failing(engine_alone: Any, tokenizer: Any,
                                                         client: httpx.Client) -> None:
    """Last in the module: it breaks a decode worker (the fleet replaces it)."""
    prompt = random_prompts([24], VOCAB, seed=39)[0]
    fields: dict[str, Any] = {"temperature": 1.0, "seed": 5, "min_p": 0.01, "top_k": 200,
                              "allowed_token_ids": list(range(200, 400))}
    engine_fields = {**fields, "allowed_token_ids": tuple(fields["allowed_token_ids"])}
    unbanned = reference(engine_alone, prompt, 24, **engine_fields)
    word = _round_trip_word(tokenizer, unbanned, 8, 2)  # bites after the failure, needs the tokens before
    assert word is not None
    sequences = bad_word_token_ids(tokenizer, [word])
    expected = reference(engine_alone, prompt, 24, bad_words=sequences, **engine_fields)
    assert expected != unbanned
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "bad_words": [word], **fields}
    tokens, moves = stream_across_a_failure(client, body)
    assert tokens[0] == expected
    assert moves and moves[0] >= 1
