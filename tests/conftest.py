"""Shared fixtures: small real models built in the test session, and the default model when marked slow;
the order that lets the suites of one shared server shape run together (tests/helpers/servers.py), and the
cost markers (pyproject.toml)."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest
import torch

from llm_engine.tiny_model import build_tiny_llama, build_tiny_model

# One torch thread per process, as in the workers: 2 cores are shared by everything in a test run.
torch.set_num_threads(1)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Engines run their model body eager (a compile per fleet start would cost the suite minutes); the compiled
# path has its own tests (tests/engine/test_compiled_engine.py). Workers get it through the EngineConfig the
# driver builds, which reads this default.
os.environ.setdefault("PDSERVE_COMPILE", "off")
# Their linears on F.linear: --linear-kernel auto's probe imports zentorch on AMD CPUs (dynamo and inductor
# with it: 2.8 s of CPU in every worker start, a quarter of a small fleet's); tests/engine/
# test_kernels_and_dtypes.py covers the probe and each kernel.
os.environ.setdefault("PDSERVE_LINEAR_KERNEL", "torch")


# The fixtures that hand out a shared server (by their function's name), and the shape each one serves.
SHARED_SHAPES = {"shared_default_server": "default", "shared_two_stage_server": "two_stage"}
# The shared shape of a test's module (any of its tests asking for one), set at collection.
MODULE_SHAPE = pytest.StashKey[str | None]()
# Where the tiny chat model's template gets its enable_thinking switch (tiny_chat_model_dir).
THINKING_SWITCH_AT = "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"


def shared_shape(item: pytest.Item) -> str | None:
    """The shared server shape `item` asks for, or None."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return None
    for definitions in info.name2fixturedefs.values():
        if definitions and (shape := SHARED_SHAPES.get(definitions[-1].func.__name__)):
            return shape
    return None


def group_shared_shapes(items: list[pytest.Item]) -> list[pytest.Item]:
    """The modules of one shared shape one after another, where the first of them stood; a module's own
    order, and every other module's place, kept. Each test's stash gets its module's shape."""
    modules: dict[object, list[pytest.Item]] = {}
    for item in items:
        modules.setdefault(item.getparent(pytest.Module), []).append(item)
    shape_of = {module: next(filter(None, map(shared_shape, its)), None) for module, its in modules.items()}
    ordered: list[pytest.Item] = []
    placed: set[str] = set()
    for module, its in modules.items():
        for item in its:
            item.stash[MODULE_SHAPE] = shape_of[module]
        shape = shape_of[module]
        if shape is None:
            ordered += its
        elif shape not in placed:
            placed.add(shape)
            ordered += [i for m, mine in modules.items() if shape_of[m] == shape for i in mine]
    return ordered


def work_unit(item: pytest.Item) -> str:
    """What one pytest-xdist worker runs whole (`make test` runs two): a shared shape's modules, or a
    module (its module-scoped servers start once)."""
    shape = item.stash.get(MODULE_SHAPE, None)
    return f"shared-{shape}" if shape else item.nodeid.split("::")[0]


def cost_rank(items: list[pytest.Item]) -> int:
    """0 first: the units that hold a worker longest start first, so that the two workers end together
    (several raylets or a pdserve process of its own; a fleet on a local Ray; the real model or a compile;
    the rest)."""
    if any("cluster" in i.keywords for i in items):
        return 0
    if any("ray" in i.keywords for i in items):
        return 1
    return 2 if any("slow" in i.keywords or "compile" in i.keywords for i in items) else 3


def order_by_cost(items: list[pytest.Item]) -> list[pytest.Item]:
    """The work units, costliest rank first; within a rank, and within a unit, the order kept."""
    units: dict[str, list[pytest.Item]] = {}
    for item in items:
        units.setdefault(work_unit(item), []).append(item)
    ranked = sorted(units.values(), key=cost_rank)  # stable
    return [item for unit in ranked for item in unit]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook, which reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items[:] = group_shared_shapes(items)
    for item in items:
        # Cost markers: `ray` on every test that starts a local Ray (through the fixture; the modules that
        # start Ray another way mark themselves), `cluster` (several raylets) implies `ray`.
        if "ray_local" in getattr(item, "fixturenames", ()) or "cluster" in item.keywords:
            item.add_marker(pytest.mark.ray)
        item.add_marker(pytest.mark.xdist_group(work_unit(item)))
    items[:] = order_by_cost(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def close_shared_server() -> None:
    servers = sys.modules.get("tests.helpers.servers")  # not imported: no shared server was started
    if servers is not None:
        servers.SHARED.close()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    yield  # the test's own teardown first: its client checks the shared fleet is whole
    # The shared server closes once the next test's module is not one of its shape (so that the suites
    # counting the local Ray's free CPUs see only their own fleets). After the last test, ray_local closes it
    # before Ray goes.
    servers = sys.modules.get("tests.helpers.servers")
    shared = servers.SHARED if servers is not None else None
    next_shape = nextitem.stash.get(MODULE_SHAPE, None) if nextitem is not None else None
    if shared is not None and shared.shape is not None and next_shape != shared.shape:
        shared.close()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def ray_local() -> Iterator[None]:
    """A local Ray instance shared by the tests that need one (about 3 s to start)."""
    import ray

    from tests.helpers.local_ray import init_local_ray

    # Worker processes inherit this environment: UCX stays on loopback, tokenizers stay single-threaded.
    os.environ["UCX_NET_DEVICES"] = "lo"
    # pdserve's namespace, as `pdserve serve` joins it: the fleet actor's (detached) workers are found there.
    init_local_ray(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False,
                   namespace="pdserve")
    yield
    close_shared_server()  # its fleet's actors before the Ray they live in
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_chat_model_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_dir: Path) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (vocabulary 49152): the HTTP suites'
    model. Hidden size 64 (the tiny Llama's 256 would make its 49152-row lm_head 50 MB, read on every decode
    step: most of a step's time), with the tiny Llama's heads (8 of 32, 2 KV), so that its KV blocks, and
    the block counts the tests expect, are the same."""
    out = build_tiny_model("llama", tmp_path_factory.mktemp("tiny-chat"), vocab_size=49152, hidden_size=64,
                           intermediate_size=128, head_dim=32)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).is_file():
            shutil.copy2(smollm2_dir / name, out / name)
    # Qwen3's enable_thinking switch in the template (vLLM's chat_template_kwargs, test_vllm_extensions):
    # false writes an empty think block after the generation prompt; otherwise the template is SmolLM2's.
    template = (out / "chat_template.jinja").read_text()
    assert THINKING_SWITCH_AT in template
    (out / "chat_template.jinja").write_text(template.replace(THINKING_SWITCH_AT, (
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
        "{% if enable_thinking is defined and enable_thinking is false %}"
        "{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}")))
    return out


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from llm_engine.default_model import prepare_default_model

    return prepare_default_model()


@pytest.fixture(scope="session")
def qwen3_small_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small Qwen3 checkpoint that thinks on cue, with Qwen3's tokenizer and template
    (tests/helpers/qwen3_small.py)."""
    from tests.helpers.qwen3_small import build_qwen3_small

    return build_qwen3_small(tmp_path_factory.mktemp("qwen3-small"))
