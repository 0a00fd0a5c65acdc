# Two entry points for a fresh machine: `make run` (the main job) and `make test` (the suite).
# Both create .venv and install what they need. torch is pinned here, and installed before
# the distributions, because torch==2.13.0's CPU build is what this project's machines have
# on disk; the pyprojects only state a compatible range.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
TRITON_PIN := triton==3.7.1
# What `make run` needs: the core, the CPU backend and the model families (no Triton).
DISTS := zllm-core zllm-backend-cpu zllm-models/llama zllm-models/deepseek zllm-models/gpt_oss
# The GPU backends and their kernel libraries: installed for the suite, which runs the Triton
# kernels in Triton's interpreter and checks every backend's plugin contract without a device.
GPU_DISTS := zllm-kernels-torch zllm-kernels-triton zllm-backend-cuda zllm-backend-rocm zllm-backend-metal
CONFIG ?= configs/stories260k-hf.yaml
PYTEST_ARGS ?=
# pytest-xdist workers for `make test`; each test file runs whole in one worker, so its
# module-scoped servers and process groups are started once.
PYTEST_WORKERS ?= 2

.PHONY: run test bench bench-serve bench-grammar bench-speculative bench-parallel bench-quant bench-gpt-oss compat clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The CPU backend compiles its native kernel library at install: a changed source reinstalls it.
$(VENV)/.installed: $(BIN)/python $(foreach d,$(DISTS),$(d)/pyproject.toml) zllm-backend-cpu/setup.py $(wildcard zllm-backend-cpu/csrc/*)
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet $(foreach d,$(DISTS),-e $(d))
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed requirements-test.txt $(foreach d,$(GPU_DISTS),$(d)/pyproject.toml)
	$(BIN)/python -m pip install --quiet $(TRITON_PIN) -r requirements-test.txt
	$(BIN)/python -m pip install --quiet $(foreach d,$(GPU_DISTS),-e $(d))
	touch $@

run: $(VENV)/.installed
	$(BIN)/zllm run --config $(CONFIG)

# Lint and type-check first (ruff and mypy, configured in the root pyproject.toml), as vLLM and
# pluggy do; then the suite, then the compatibility evidence it produced.
test: $(VENV)/.installed-test
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadfile --junitxml=$(VENV)/junit.xml $(PYTEST_ARGS)
	$(BIN)/python tools/check_verified.py $(VENV)/junit.xml compat/verified.toml

BENCH_ARGS ?=
bench: $(VENV)/.installed-test
	$(BIN)/python bench/run.py $(BENCH_ARGS)

BENCH_SPECULATIVE_ARGS ?=
bench-speculative: $(VENV)/.installed-test
	$(BIN)/python bench/speculative.py $(BENCH_SPECULATIVE_ARGS)

BENCH_PARALLEL_ARGS ?=
bench-parallel: $(VENV)/.installed-test
	$(BIN)/python bench/parallel.py $(BENCH_PARALLEL_ARGS)

BENCH_SERVE_ARGS ?=
bench-serve: $(VENV)/.installed-test
	$(BIN)/python bench/serve.py $(BENCH_SERVE_ARGS)

BENCH_QUANT_ARGS ?=
bench-quant: $(VENV)/.installed-test
	$(BIN)/python bench/quant_models.py $(BENCH_QUANT_ARGS)

BENCH_GPT_OSS_ARGS ?=
bench-gpt-oss: $(VENV)/.installed-test
	$(BIN)/python bench/gpt_oss_moe.py $(BENCH_GPT_OSS_ARGS)

BENCH_GRAMMAR_ARGS ?=
bench-grammar: $(VENV)/.installed-test
	$(BIN)/python bench/grammar.py $(BENCH_GRAMMAR_ARGS)

compat: $(VENV)/.installed
	$(BIN)/zllm compat --format md > COMPATIBILITY.md

clean:
	rm -rf $(VENV)
