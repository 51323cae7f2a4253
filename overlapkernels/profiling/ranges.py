"""Named ranges with stable names (``ok/ag_matmul/chunk3/compute``) for Nsight and torch.profiler.

On CUDA a range is an NVTX range (an Nsight Systems timeline shows the overlap at a glance); under
an active torch.profiler it is also a ``record_function`` event, so ``overlapkernels profile
report`` can read the overlap off CPU and GPU traces alike. With neither, it costs one check.
"""
from __future__ import annotations

import contextlib

import torch
from torch.autograd import profiler as _autograd_profiler


def _profiler_active() -> bool:
    return _autograd_profiler._is_profiler_enabled


@contextlib.contextmanager
def span(name: str):
    nvtx = torch.cuda.is_available() and torch.cuda.is_initialized()
    if nvtx:
        torch.cuda.nvtx.range_push(name)
    try:
        if _profiler_active():
            with torch.profiler.record_function(name):
                yield
        else:
            yield
    finally:
        if nvtx:
            torch.cuda.nvtx.range_pop()
