# Two commands on a fresh machine: `make demo` (set up + profile a shipped sample)
# and `make test` (set up + run the suite). The venv is created once and reused.
# Inner loop: `make test-fast` (the suite without tests marked `slow`); both spread the
# tests over every core (pytest-xdist `-n auto`); `make lint` runs
# ruff, ruff format --check and mypy; `make typecheck` runs mypy alone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# This machine keeps a CPU build of torch 2.13.0 on local disk: pinning it here avoids a
# multi-GB CUDA download. Elsewhere: make TORCH_SPEC='torch>=2.4' (pyproject keeps a range).
TORCH_SPEC ?= torch==2.13.0
DEMO ?= sample_models/gpt-48-naive.safetensors

.PHONY: demo test test-fast lint typecheck bench clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e '.[dev,plot]'
	$(BIN)/python -m pip install -q --no-deps 'mup>=1.0'  # its torchvision would replace torch
	touch $@

demo: $(BIN)/.installed
	$(BIN)/actscan profile $(DEMO) --fail-on never

test: $(BIN)/.installed
	$(BIN)/ruff check actscan tests benchmarks
	$(BIN)/python -m pytest -n auto

test-fast: $(BIN)/.installed
	$(BIN)/ruff check actscan tests benchmarks
	$(BIN)/python -m pytest -n auto -m "not slow"

lint: $(BIN)/.installed
	$(BIN)/ruff check actscan tests benchmarks
	$(BIN)/ruff format --check actscan tests benchmarks
	$(BIN)/python -m mypy

typecheck: $(BIN)/.installed
	$(BIN)/python -m mypy

bench: $(BIN)/.installed
	$(BIN)/python benchmarks/overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache .hypothesis
