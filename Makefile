# Two entry points for a fresh machine: `make run` (the main job) and `make test` (the suite).
# Both create .venv and install what they need. torch is pinned here, and installed before
# the distributions, because torch==2.13.0's CPU build is what this project's machines have
# on disk; the pyprojects only state a compatible range.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
DISTS := zllm-core zllm-backend-cpu zllm-models/llama
CONFIG ?= configs/stories260k-hf.yaml
PYTEST_ARGS ?=

.PHONY: run test bench bench-serve compat clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python $(foreach d,$(DISTS),$(d)/pyproject.toml)
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet $(foreach d,$(DISTS),-e $(d))
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt
	$(BIN)/python -m pip install --quiet -r requirements-test.txt
	touch $@

run: $(VENV)/.installed
	$(BIN)/zllm run --config $(CONFIG)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest --junitxml=$(VENV)/junit.xml $(PYTEST_ARGS)
	$(BIN)/python tools/check_verified.py $(VENV)/junit.xml compat/verified.toml

bench: $(VENV)/.installed-test
	$(BIN)/python bench/run.py

BENCH_SERVE_ARGS ?=
bench-serve: $(VENV)/.installed-test
	$(BIN)/python bench/serve.py $(BENCH_SERVE_ARGS)

compat: $(VENV)/.installed
	$(BIN)/zllm compat --format md > COMPATIBILITY.md

clean:
	rm -rf $(VENV)
