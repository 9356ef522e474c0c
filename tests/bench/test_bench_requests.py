"""What `pdserve bench` puts on the wire and reads back, against a real HTTP server of the test's own
(tests/helpers/recording_server.py: it records every request body and answers with the stream it is given):
vLLM's sampling flags and `--extra-body` in every body, nothing sent that was not asked for, the stream read
as Server-Sent Events (no space after `data:`, a payload over several `data:` lines, comments, CRLF), and
vLLM's result keys in the --save-result file."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from loadgen.client import RequestOptions, RequestRecord, send_now
from loadgen.workload import RequestSpec
from pdserve.main import main
from tests.helpers.recording_server import MODEL, Recorder, recording_server

# One answer of three tokens, framed every way the SSE specification allows and the old reader
# (`line.startswith("data: ")`) got wrong: a comment (keep-alive ping), `data:` without its space, one JSON
# payload over two `data:` lines (joined by a newline: JSON whitespace), `event:`/`id:` fields and CRLF.
TRICKY_STREAM = [
    ": keep-alive\n\n",
    'data:{"choices": [{"index": 0, "text": "a", "token_ids": [11]}]}\n\n',
    'data: {"choices": [{"index": 0, "text": "bc",\ndata: "token_ids": [12, 13]}]}\n\n',
    "event: message\r\nid: 3\r\n"
    'data: {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 3}}\r\n\r\n',
    ": done soon\n\n",
    "data: [DONE]\n\n",
]


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, Recorder]]:
    recorder = Recorder()
    with recording_server(recorder) as url:
        yield url, recorder


@pytest.fixture
def recorded(server: tuple[str, Recorder]) -> Iterator[tuple[str, Recorder]]:
    url, recorder = server
    recorder.bodies.clear()
    recorder.frames = list(TRICKY_STREAM)
    recorder.media_type = "text/event-stream"
    yield url, recorder


def bench(url: str, out: Path, *flags: str) -> int:
    return main(["bench", "--base-url", url, "--num-prompts", "3", "--random-input-len", "4",
                 "--random-output-len", "3", "--disable-tqdm", "--out", str(out / "run"), *flags])


def send(url: str, options: RequestOptions) -> RequestRecord:
    spec = RequestSpec(index=0, arrival_s=0.0, prompt_token_ids=(1, 2, 3, 4), output_len=3)

    async def one() -> RequestRecord:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            return await send_now(client, spec, MODEL, time.perf_counter(), options)

    return asyncio.run(one())


def test_the_defaults_send_no_sampling_field_and_random_prompts_ignore_eos(
        recorded: tuple[str, Recorder], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url, recorder = recorded
    assert bench(url, tmp_path) == 0
    assert len(recorder.bodies) == 3
    for body in recorder.bodies:
        # As vLLM 0.32's `vllm bench serve`: the server's sampling defaults hold unless a flag says so;
        # the random dataset runs every request to its max_tokens.
        assert body["ignore_eos"] is True and body["max_tokens"] == 3 and body["model"] == MODEL
        assert not {"temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                    "repetition_penalty"} & set(body)
    assert "no --temperature: the server's default sampling applies" in capsys.readouterr().err


def test_sampling_flags_and_the_extra_body_reach_every_request(recorded: tuple[str, Recorder],
                                                                tmp_path: Path) -> None:
    url, recorder = recorded
    extra = {"chat_template_kwargs": {"enable_thinking": False}, "top_k": 5, "seed": 7}
    assert bench(url, tmp_path, "--temperature", "0", "--top-p", "0.9", "--top-k", "50", "--min-p", "0.05",
                 "--repetition-penalty", "1.1", "--no-ignore-eos", "--extra-body", json.dumps(extra)) == 0
    assert len(recorder.bodies) == 3
    for body in recorder.bodies:
        assert body["temperature"] == 0 and body["top_p"] == 0.9 and body["min_p"] == 0.05
        assert body["repetition_penalty"] == 1.1 and "ignore_eos" not in body
        # The extra body goes in last, as vLLM's: its top_k wins over --top-k.
        assert body["top_k"] == 5 and body["seed"] == 7
        assert body["chat_template_kwargs"] == {"enable_thinking": False}


def test_the_extra_body_comes_from_the_environment_too(recorded: tuple[str, Recorder], tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    url, recorder = recorded
    monkeypatch.setenv("PDSERVE_BENCH_EXTRA_BODY", '{"temperature": 0.5}')
    assert bench(url, tmp_path, "--endpoint", "/v1/chat/completions") == 0
    assert [body["temperature"] for body in recorder.bodies] == [0.5] * 3
    assert all(body["messages"][0]["role"] == "user" for body in recorder.bodies)


def test_an_extra_body_that_is_not_a_json_object_is_refused(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        bench("http://127.0.0.1:9", tmp_path, "--extra-body", "[1, 2]")
    assert "--extra-body" in capsys.readouterr().err


def test_the_event_stream_is_read_as_the_sse_specification_says(recorded: tuple[str, Recorder]) -> None:
    url, _ = recorded
    record = send(url, RequestOptions())
    assert (record.status, record.error) == (200, "")
    # Three tokens: one in the `data:`-without-space event, two in the event split over two lines.
    assert len(record.token_times_s) == 3 and record.ttft_s is not None
    assert (record.num_output_tokens, record.input_len) == (3, 4)  # from the CRLF event's usage
    assert record.e2e_s is not None and record.e2e_s >= record.ttft_s


def test_a_reply_that_is_not_an_event_stream_is_a_failed_request(recorded: tuple[str, Recorder]) -> None:
    url, recorder = recorded
    recorder.media_type = "application/json"
    record = send(url, RequestOptions())
    assert record.status == 200 and "SSEError" in record.error and "text/event-stream" in record.error


def test_a_payload_that_is_not_json_is_a_failed_request_not_a_crash(recorded: tuple[str, Recorder]) -> None:
    url, recorder = recorded
    recorder.frames = ['data: {"choices": [{"text": "a"}]}\n\n', "data: {not json\n\n"]
    record = send(url, RequestOptions())
    assert "JSONDecodeError" in record.error and len(record.token_times_s) == 1


def test_the_saved_result_has_vllms_keys(recorded: tuple[str, Recorder], tmp_path: Path) -> None:
    url, _ = recorded
    assert bench(url, tmp_path, "--temperature", "0", "--save-result", "--save-detailed", "--label", "pd",
                 "--result-dir", str(tmp_path / "results")) == 0
    (saved,) = (tmp_path / "results").iterdir()
    assert saved.name.startswith("pd-infqps-recorded-model-")
    result = json.loads(saved.read_text())
    # Every key `vllm bench serve --save-result --save-detailed` writes for a text run (0.32), less
    # `generated_texts` (pdserve keeps no text) and `rtfx` (audio input only).
    vllm_keys = {
        "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
        "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
        "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
        "output_throughput", "total_token_throughput", "input_lens", "output_lens", "ttfts", "itls",
        "latencies", "start_times", "queue_times", "errors", "max_output_tokens_per_s",
        "max_concurrent_requests", "mean_ttft_ms", "median_ttft_ms", "std_ttft_ms", "p99_ttft_ms",
        "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
    }
    assert vllm_keys <= set(result), vllm_keys - set(result)
    assert (result["endpoint_type"], result["label"], result["tokenizer_id"]) == ("openai", "pd", MODEL)
    assert result["output_lens"] == [3, 3, 3] and result["input_lens"] == [4, 4, 4]
    assert result["errors"] == ["", "", ""] and [len(gaps) for gaps in result["itls"]] == [2, 2, 2]
    assert 1 <= result["max_concurrent_requests"] <= 3
    assert result["max_output_tokens_per_s"] == 9  # all three answers arrive within the first second


def test_without_save_detailed_the_per_request_lists_stay_in_requests_jsonl(
        recorded: tuple[str, Recorder], tmp_path: Path) -> None:
    url, _ = recorded
    assert bench(url, tmp_path, "--temperature", "0") == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    # As vLLM's: latencies and queue times always, the rest only with --save-detailed.
    assert len(summary["latencies"]) == 3 and len(summary["queue_times"]) == 3
    assert not {"ttfts", "itls", "input_lens", "output_lens", "start_times", "errors"} & set(summary)
    assert len((tmp_path / "run" / "requests.jsonl").read_text().splitlines()) == 3
