#!/usr/bin/env bash
# The CPU test suite on the GPU machine's software stack: Python 3.12, torch 2.11 (its CUDA build,
# which runs on CPU too), triton 3.6, numpy 2.5. CI runs torch 2.13 + triton 3.9 only, so this is
# how version drift is caught before a scarce GPU lease finds it (it found triton 3.6's interpreter
# failing under numpy >= 2.4, and torch 2.11's pooled symmetric memory). Not part of `make test`:
# it downloads about 5 GB once into $VENV.
#
#   bash scripts/gpu_stack_on_cpu.sh [pytest args...]      (VENV=/tmp/ok-gpu-stack, PYTHON=python3.12)
#
# The same for the floor setup.py admits (torch 2.7 pins triton 3.3; checked 2026-11-30: suite and
# sm_90 compile check pass):
#   TORCH=2.7.1 TRITON=3.3.1 NUMPY="<2.3" PYTHON=python3.10 VENV=/tmp/ok-floor bash scripts/gpu_stack_on_cpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/ok-gpu-stack}
PYTHON=${PYTHON:-python3.12}
if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==${TORCH:-2.11.0}" "triton==${TRITON:-3.6.0}" "numpy${NUMPY:-==2.5.*}" pytest \
    pytest-timeout nvidia-ml-py matplotlib
fi
# subprocess-launched ranks (`python -m overlapkernels`) import this checkout
OVERLAPKERNELS_SKIP_CUDA=1 "$VENV/bin/pip" install -q --no-deps -e .
"$VENV/bin/python" -c "import sys, numpy, torch, triton; print('python', sys.version.split()[0], 'numpy',
numpy.__version__, 'torch', torch.__version__, 'triton', triton.__version__)"
exec "$VENV/bin/python" -m pytest "$@"
