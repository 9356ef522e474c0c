"""The compiled model body (llm_engine/compilation.py): float32 greedy tokens equal transformers' through
chunked prefills, prefix hits and decodes; bfloat16 held to vLLM's standard; a compile failure is an error
naming --compile ("on") or an eager worker with the reason ("auto"); a serving worker under "auto" serves
eager at once and swaps in the body compiled beside it; --device auto chooses by what is visible.

The suite runs eager elsewhere (PDSERVE_COMPILE=off, tests/conftest.py); these tests compile on purpose, with
one inductor cache for the module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from llm_engine import EngineConfig, LLMEngine, SamplingParams, compilation
from llm_engine.compilation import BackgroundCompile, CompileError, CompileMode, auto_declines, compile_body
from llm_engine.hardware import check_device_present, resolve_device
from llm_engine.lean_model import LeanBody
from llm_engine.tiny_model import build_tiny_model
from tests.helpers.reference import assert_engine_close_to_transformers, hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module", autouse=True)
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("inductor"))
    yield
    if previous is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous


def engine_for(model_dir: Path, **overrides: object) -> LLMEngine:
    settings: dict[str, object] = {"dtype": "float32", "kv_cache_bytes": 8 << 20, "compile": "on",
                                   "max_num_batched_tokens": 24, **overrides}
    return LLMEngine(EngineConfig(str(model_dir), **settings))  # type: ignore[arg-type]


@pytest.mark.compile
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compiled_float32_greedy_equals_transformers(family: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model(family, tmp_path / family)
    engine = engine_for(model_dir)
    assert engine.compilation.compiled and engine.compilation.body == "lean"
    prompts = random_prompts([5, 40, 19, 1], 1000)
    # The 24-token budget prefills the 40-token prompt in two chunks while the others decode.
    completions = engine.generate(prompts, GREEDY)
    assert [list(c.output_token_ids) for c in completions] == hf_greedy(model_dir, prompts, 8)
    # A second round shares the first prompts' full blocks: prefix hits, the rest prefilled over them.
    shared = [[*prompts[1], 7, 8, 9], [*prompts[1][:32], 3]]
    outputs = [list(c.output_token_ids) for c in engine.generate(shared, GREEDY)]
    assert outputs == hf_greedy(model_dir, shared, 8)
    assert engine.block_pool.is_whole()


@pytest.mark.compile
@pytest.mark.parametrize("compile_mode", ["on", "off"])
def test_bfloat16_is_close_to_transformers_by_vllms_standard(compile_mode: str, tmp_path: Path) -> None:
    model_dir = build_tiny_model("llama", tmp_path / "llama")
    engine = engine_for(model_dir, dtype="bfloat16", compile=compile_mode)
    assert_engine_close_to_transformers(engine, model_dir, random_prompts([7, 30, 12], 1000, seed=3), 16,
                                        torch.bfloat16)
    assert engine.block_pool.is_whole()


def _failing_compiler(body: torch.nn.Module) -> object:
    raise RuntimeError("inductor: C++ compile failed (no compiler)")


def test_a_compile_failure_stops_on_and_falls_back_under_auto(tiny_llama_dir: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval()
    body = LeanBody.from_hf(model, 64)
    cpu = torch.device("cpu")
    with pytest.raises(CompileError, match=r"--compile on: the model body did not compile .*no compiler"):
        compile_body(body, CompileMode.ON, cpu, compiler=_failing_compiler)  # type: ignore[arg-type]
    # auto on a CPU in float32 stays eager without trying; where it would compile, a failure is eager + why
    _, declined = compile_body(body, CompileMode.AUTO, cpu)
    assert not declined.compiled and declined.reason.startswith("auto: eager on a CPU in float32")
    fell_back, report = compile_body(body, CompileMode.AUTO, cpu, torch.bfloat16,
                                     compiler=_failing_compiler)  # type: ignore[arg-type]
    if auto_declines(cpu, torch.bfloat16) is None:  # a CPU with native bf16: auto tried, and fell back
        assert fell_back is body and not report.compiled and "no compiler" in report.reason
        assert "running it eager" in caplog.text
    else:
        assert not report.compiled and report.reason.startswith("auto: eager")


@pytest.mark.compile
def test_auto_serves_eager_at_once_and_swaps_in_the_body_compiled_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving worker's engine (compile_in_background) answers from its load, eager, while its body compiles
    on a thread of its own; every round, before and after the swap, is transformers' greedy answer (float32:
    the step context is per thread, so the warm-up's empty one never meets a real forward)."""
    monkeypatch.setattr(compilation, "auto_declines", lambda *args, **kwargs: None)  # auto compiles here too
    model_dir = build_tiny_model("llama", tmp_path / "llama")
    prompts = random_prompts([5, 40, 19, 1], 1000)
    expected = hf_greedy(model_dir, prompts, 8)
    engine = engine_for(model_dir, compile="auto", compile_in_background=True)
    background = engine.runner.background_compile
    assert background is not None and engine.compilation.mode == "compiling"
    modes = []
    while True:
        modes.append(engine.compilation.mode)
        assert [list(c.output_token_ids) for c in engine.generate(prompts, GREEDY)] == expected
        if background.join(0):
            break
    assert modes[0] == "compiling"  # it served before its compile was done
    assert engine.compilation.compiled and engine.compilation.seconds > 0
    assert [list(c.output_token_ids) for c in engine.generate(prompts, GREEDY)] == expected
    assert engine.block_pool.is_whole()


def test_a_compile_beside_serving_that_fails_leaves_the_eager_body_and_says_why(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    body = LeanBody.from_hf(AutoModelForCausalLM.from_pretrained(tiny_llama_dir).eval(), 64)
    swaps: list[tuple[object, compilation.CompileReport]] = []
    background = BackgroundCompile(body, torch.device("cpu"), lambda b, r: swaps.append((b, r)),
                                   compiler=_failing_compiler)  # type: ignore[arg-type]
    background.start()
    assert background.join(60)
    [(swapped, report)] = swaps
    assert swapped is body and report.mode == "eager" and "no compiler" in report.reason
    # Where auto compiles, a serving worker's compile_body compiles nothing itself: eager now, compiling.
    eager, pending = compile_body(body, CompileMode.AUTO, torch.device("cpu"), torch.bfloat16,
                                  in_background=True)
    if auto_declines(torch.device("cpu"), torch.bfloat16) is None:
        assert eager is body and pending.compiling and pending.mode == "compiling"
    else:
        assert eager is body and not pending.compiling and pending.mode == "eager"


def test_compile_on_without_a_lean_body_is_refused_at_start(tmp_path: Path) -> None:
    model_dir = build_tiny_model("gemma", tmp_path / "gemma")
    with pytest.raises(CompileError, match="--compile on: no lean body for GemmaForCausalLM"):
        engine_for(model_dir)
    engine = engine_for(model_dir, compile="auto")  # transformers' modules, eager, and says so
    assert engine.compilation.body == "transformers" and not engine.compilation.compiled


def test_compile_auto_chooses_by_device_and_dtype() -> None:
    assert auto_declines(torch.device("cuda"), torch.bfloat16) is None
    assert auto_declines(torch.device("cpu"), torch.bfloat16, native_bf16=True) is None
    assert "float32" in str(auto_declines(torch.device("cpu"), torch.float32, native_bf16=True))
    assert "without native bfloat16" in str(auto_declines(torch.device("cpu"), torch.bfloat16,
                                                          native_bf16=False))
    with pytest.raises(ValueError, match="compile must be one of auto, on, off"):
        EngineConfig("x", compile="always")


def test_device_auto_follows_what_is_visible(tiny_llama_dir: Path) -> None:
    assert resolve_device("auto", cuda_visible=True) == "cuda"
    assert resolve_device("auto", cuda_visible=False) == "cpu"
    assert resolve_device("cuda:1") == "cuda:1"
    with pytest.raises(ValueError, match="device must be auto, cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match="--device cuda: no CUDA GPU is visible"):
        check_device_present("cuda", cuda_visible=False)
    assert EngineConfig(str(tiny_llama_dir)).device == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda: no CUDA GPU is visible"):
            LLMEngine(EngineConfig(str(tiny_llama_dir), device="cuda", dtype="float32"))


def test_one_process_compiles_more_bodies_than_dynamos_default_limit() -> None:
    """Dynamo keeps a process's graphs of one forward per value of the body's integer attributes, 8 by
    default: the ninth model (or rank share) a process compiled failed under fullgraph (seen in the suite:
    two TP ranks compiled in a pytest process after eight other models). Dynamo's eager backend here: the
    limit is Dynamo's, whatever compiles the graph."""
    class Toy(torch.nn.Module):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.width, self.embed = width, torch.nn.Embedding(8, 16)

        def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            return self.embed(ids)[:, : self.width] + positions[:, None]

    def dynamo_eager(body: torch.nn.Module) -> Any:
        return torch.compile(body, backend="eager", fullgraph=True, dynamic=True)

    for width in range(1, 13):
        compiled, report = compile_body(Toy(width), CompileMode.ON, torch.device("cpu"),
                                        compiler=dynamo_eager)
        assert report.compiled and compiled is not None
        assert compiled(torch.zeros(3, dtype=torch.long), torch.arange(3)).shape == (3, width)
