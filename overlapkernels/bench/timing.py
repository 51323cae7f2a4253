"""Timing of one collective-bearing call across ranks: CUDA events on GPU, perf_counter on CPU."""
from __future__ import annotations

import time

import torch
import torch.distributed as dist


# dtypes a benchmark accepts by name (--dtype)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def check_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: expected one of {list(DTYPES)}")
    return DTYPES[name]


def check_counts(iters: int, warmup: int) -> None:
    if not isinstance(iters, int) or iters < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"iters={iters!r}, warmup={warmup!r}: expected iters >= 1 and warmup >= 0")


def time_calls(fn, iters: int, warmup: int, device: torch.device, group=None) -> list[float]:
    """Seconds per call of ``fn`` on this rank, each call started together (barrier first)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()  # gloo calls return when this rank's part is done
            times.append(time.perf_counter() - t0)
    return times


def slowest_rank(stats: dict, device: torch.device, group=None) -> dict:
    """Per-rank {median_s, min_s, max_s} -> the maximum over ranks of each (a collective is done
    when its last rank is)."""
    keys = sorted(stats)
    worst = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, worst.tolist()))


def telemetry(device: torch.device):
    """NVML sampling of this rank's GPU while a measurement runs (empty columns on CPU)."""
    from ..profiling.telemetry import Telemetry

    if device.type != "cuda":
        return Telemetry(nvml=_NoNVML())
    return Telemetry(device.index if device.index is not None else torch.cuda.current_device())


class _NoNVML:
    """A CPU run samples nothing: NVML would describe a GPU the run did not use."""

    def nvmlInit(self):
        raise RuntimeError("CPU run")
