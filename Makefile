# `make demo` and `make test` work on a fresh clone of a CPU machine: they create .venv when no
# virtualenv is active, install torch only when it is missing (pinned to the CPU build on this
# machine's disk; a user's CUDA torch is never replaced), install the package with its extras
# and build csrc/ when nvcc is on PATH.
SHELL := /bin/bash
PYTHON ?= python3
TORCH_PIN := torch==2.13.0
PY := $(if $(VIRTUAL_ENV),python,$(CURDIR)/.venv/bin/python)
STAMP := .setup-stamp
PYTEST_ARGS ?=

.PHONY: setup demo test cuda gpu-check clean

setup:
	@if [ -z "$$VIRTUAL_ENV" ] && [ ! -x .venv/bin/python ]; then $(PYTHON) -m venv .venv; fi
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install $(TORCH_PIN)
	@if [ ! -f $(STAMP) ] || [ setup.py -nt $(STAMP) ] || \
	    ! $(PY) -c "import overlapkernels, pytest, pytest_timeout, triton, pynvml" 2>/dev/null; then \
	  OVERLAPKERNELS_SKIP_CUDA=1 $(PY) -m pip install -q -e ".[test,bench]" && touch $(STAMP); fi
	@if command -v nvcc >/dev/null 2>&1; then $(PY) csrc/build.py >/dev/null; \
	  else echo "nvcc not on PATH: skipping the CUDA library (make cuda builds it)"; fi

# Until the pipeline runtime lands, the main job is the collectives benchmark on 4 CPU ranks.
demo: setup
	$(PY) -m overlapkernels bench collectives --nproc 4 --sizes 1K:4M --iters 10 --warmup 2

# pytest exits non-zero (5) when no test ran, so an empty suite fails here too.
test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

cuda:
	$(PY) csrc/build.py

# On a CUDA machine: build csrc, then the GPU tests (later issues add the one-GPU benchmarks).
gpu-check: setup cuda
	$(PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA GPU visible')"
	$(PY) -m pytest -m gpu -v $(PYTEST_ARGS)

clean:
	rm -rf build dist *.egg-info overlapkernels/_lib $(STAMP)
