# `make demo` and `make test` work on a fresh clone of a CPU machine: they create .venv when no
# virtualenv is active, install torch only when it is missing (pinned to the CPU build on this
# machine's disk; a user's CUDA torch is never replaced), install the package with its extras
# and build csrc/ when nvcc is on PATH. A python3 that is itself a virtualenv's (VIRTUAL_ENV set,
# or sys.prefix != sys.base_prefix, as on images that put a venv first on PATH) is used as is,
# and pip runs only when something is missing (DEPS_IMPORT: all that the tests and `make gpu-check`
# import; matplotlib, for plots only, is not needed), so an offline GPU box with torch needs no
# network. pip never runs longer than PIP_TIMEOUT seconds (gpu-check: the time left to its deadline).
SHELL := /bin/bash
PYTHON ?= python3
TORCH_PIN := torch==2.13.0
IN_VENV := $(shell [ -n "$$VIRTUAL_ENV" ] || $(PYTHON) -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)' \
             2>/dev/null && echo yes)
PY := $(if $(IN_VENV),$(PYTHON),$(CURDIR)/.venv/bin/python)
STAMP := .setup-stamp
DEPS_IMPORT := import torch, overlapkernels, pytest, pytest_timeout, triton, pynvml
PYTEST_ARGS ?=
PIP_TIMEOUT ?= 1800

.PHONY: deps setup test-deps demo test cuda gpu-check clean bench-collectives bench-node

# The Python side only: a virtualenv, torch, the package and its test dependencies.
deps:
	@if [ -z "$(IN_VENV)" ] && [ ! -x .venv/bin/python ]; then $(PYTHON) -m venv .venv; fi
	@$(PY) -c "import torch" 2>/dev/null || timeout $(PIP_TIMEOUT) $(PY) -m pip install $(TORCH_PIN)
	@if ! $(PY) -c "$(DEPS_IMPORT)" 2>/dev/null || { [ -z "$(IN_VENV)" ] && [ setup.py -nt $(STAMP) ]; }; then \
	  OVERLAPKERNELS_SKIP_CUDA=1 timeout $(PIP_TIMEOUT) $(PY) -m pip install -q -e ".[test,bench]" && touch $(STAMP); fi

setup: deps
	@if command -v nvcc >/dev/null 2>&1; then timeout 150 $(PY) csrc/build.py >/dev/null || echo "csrc build failed (see above); CUDA-library features will say how to build it"; \
	  else echo "nvcc not on PATH: skipping the CUDA library (make cuda builds it)"; fi

# The main job: train the small GPT on 4 CPU ranks (tp=2 x pp=2), loss beside a 1-process reference.
demo: setup
	$(PY) -m overlapkernels demo

bench-collectives: setup
	$(PY) -m overlapkernels bench collectives --nproc 4 --sizes 1K:4M --iters 10 --warmup 2

# megatron-core, for the state-dict interchange tests, needs torch>=2.6: installed only over such a
# torch, pinned to the torch pip sees installed (its metadata's version: a torch pip cannot see, as
# a source build without metadata, is left alone, since pip would add one from the index), with few
# retries (offline it gives up in seconds). Without it those tests are skipped and say why.
MEGATRON_PIN := megatron-core==0.16.1
TORCH_DIST_VERSION = $$($(PY) -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null)
test-deps: setup
	@if ! $(PY) -c "import megatron.core" 2>/dev/null && version=$(TORCH_DIST_VERSION) && [ -n "$$version" ] && \
	  $(PY) -c "import sys; sys.exit(tuple(int(p) for p in '$$version'.split('+')[0].split('.')[:2]) < (2, 6))"; then \
	  timeout $(PIP_TIMEOUT) $(PY) -m pip install -q --retries 1 --timeout 30 "$(MEGATRON_PIN)" "torch==$$version" \
	  || echo "$(MEGATRON_PIN) not installed: the Megatron interchange tests will be skipped"; fi

# pytest exits non-zero (5) when no test ran, so an empty suite fails here too.
test: test-deps
	$(PY) -m pytest $(PYTEST_ARGS)

cuda:
	$(PY) csrc/build.py

# On a CUDA machine: scripts/gpu_check.sh builds csrc (once: deps, not setup, so no second build),
# then runs the GPU tests and one-GPU benchmarks, each step time-limited, rows to
# benchmarks/results/gpu-check.csv ($OUT/gpu-check.csv if OUT is set). All of it ends within
# 8 minutes: the deadline is fixed when make reads this file (before deps), pip (when it must run
# at all) gets only the time left to it, and the script cuts its probe and steps to the time left.
gpu-check: GPU_CHECK_DEADLINE := $(shell echo $$(( $$(date +%s) + 465 )))
# deps inherits this; evaluated by the shell when pip would start, never below 1 (timeout 0 = no limit)
gpu-check: PIP_TIMEOUT = $$(( $(GPU_CHECK_DEADLINE) - $$(date +%s) > 1 ? $(GPU_CHECK_DEADLINE) - $$(date +%s) : 1 ))
gpu-check: deps
	PY=$(PY) GPU_CHECK_DEADLINE=$(GPU_CHECK_DEADLINE) bash scripts/gpu_check.sh

# On a multi-GPU NVLink node: every bench kind under torchrun, rows to benchmarks/results/node.csv.
# Defaults fit NPROC 1, 2, 4 or 8 (the TP sizes of the Llama-3 shapes) and cover every method; without the
# csrc library ('-': its build, done here only, may fail) the CUDA-IPC paths are skipped with the
# reason. A kind that fails on every rank before it communicates does not stop the others (`bench
# all` names it and exits non-zero at the end); one that fails mid-run stops the job (ranks would
# otherwise wait in its collectives). Plots only where matplotlib is installed (--plot refuses to run without it).
NPROC ?= 8
bench-node: deps
	-$(PY) csrc/build.py
	$(PY) -m torch.distributed.run --nproc-per-node $(NPROC) -m overlapkernels bench all \
	  --csv benchmarks/results/node.csv $$($(PY) -c 'import matplotlib' 2>/dev/null && echo --plot benchmarks/results/node-plots)

clean:
	rm -rf build dist *.egg-info overlapkernels/_lib $(STAMP)
