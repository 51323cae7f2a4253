"""Timing across ranks: a barrier, then CUDA events (GPU) or perf_counter (CPU) per call. Work that
involves no other rank (a GEMM alone, attention without traffic) is timed the same way where a row
compares it with collective calls (overlap efficiency subtracts one from the other: do_bench's
cache flush between calls and back-to-back launches would bias the difference);
``gpu_median_s`` (``triton.testing.do_bench``) times the one-GPU benchmarks' kernels alone."""
from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from ..parallel import comm_device


# dtypes a benchmark accepts by name (--dtype)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def check_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"dtype={name!r}: expected one of {list(DTYPES)}")
    return DTYPES[name]


def check_counts(iters: int, warmup: int) -> None:
    if not isinstance(iters, int) or iters < 1 or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"iters={iters!r}, warmup={warmup!r}: expected iters >= 1 and warmup >= 0")


def check_sizes(**sizes) -> None:
    """Each named size an integer >= 1: a 0 would only fail later, inside the ranks, as an empty tensor."""
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")


def time_calls(fn, iters: int, warmup: int, device: torch.device, group=None,
               what: str = "the timed calls") -> list[float]:
    """Seconds per call of ``fn`` on this rank, each call started together (barrier first).

    Then every rank checks the device error records of the symm/fused calls made (collective): a
    call whose wait timed out returns at once with garbage and raises only at a later call, so its
    times would have passed for a record speed-up; now the run stops on every rank, naming ``what``.

    Not ``triton.testing.do_bench``, even on GPU: it picks its number of calls from this rank's own
    estimate of the call time, so ranks could call a collective a different number of times and
    hang. Here every rank makes exactly ``warmup + iters`` calls, each after a barrier, timed by
    CUDA events on its stream (GPU) or perf_counter (CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier(group=group)
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(device)  # device's, even when another device is current
            start.record(stream)
            fn()
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()  # gloo calls return when this rank's part is done
            times.append(time.perf_counter() - t0)
    from ..comm.process_world import check_pending_errors_together  # (lazily: it imports the kernels)

    group = group or dist.group.WORLD
    check_pending_errors_together(group, what, comm_device(group))
    return times


def gpu_median_s(fn, **do_bench_kwargs) -> float:
    """Median seconds per call of ``fn`` by ``triton.testing.do_bench`` (whose default is the
    mean: one slow outlier, a clock ramp or a context switch, would move it; rows report medians)."""
    from triton.testing import do_bench

    return do_bench(fn, return_mode="median", **do_bench_kwargs) / 1e3



def row_times(stats: dict) -> dict:
    """``{median_s, min_s, max_s}``, each the largest over ranks (``slowest_rank``) -> a row's time_us
    (median), min_us, max_us."""
    return {"time_us": stats["median_s"] * 1e6, "min_us": stats["min_s"] * 1e6, "max_us": stats["max_s"] * 1e6}


def available_methods(methods, group, device, what: str, dtype=None) -> list[str]:
    """``methods`` minus those this group cannot run here (symm/fused without peer memory, fused
    with operands of ``dtype`` its Triton GEMM does not take), each
    skipped one printed with its reason on rank 0. Every rank skips the same ones (a flag all-reduce),
    else the others would wait in a collective that one rank never joins."""
    from ..ops._methods import unavailable_reason
    from ..ops._validate import is_peer_world
    from ..ops.dispatch import PEER_MEMORY_METHODS

    reasons = {}
    for method in methods:
        try:
            reasons[method] = unavailable_reason(method, group, device, dtype) if method != "auto" else None
        except ValueError as exc:  # e.g. a bad peer-memory setting
            reasons[method] = str(exc)
    # this rank's own checks cannot see the others: ranks on two hosts, or GPUs without peer access
    # between them, would fail inside the kind (ending `bench all`); the ranks' agreement (collective,
    # the same answer everywhere) runs once, where a CUDA process group is asked for symm/fused
    # (whether to ask depends only on what every rank was given alike, never on a rank's own answers)
    asked = [m for m in methods if m in PEER_MEMORY_METHODS]
    if asked and device.type == "cuda" and not is_peer_world(group):
        from ..comm.process_world import group_has_peer_memory

        try:
            together = group_has_peer_memory(group, device)
            why = ("the group has no peer memory (a rank has neither torch symmetric memory nor the CUDA library's "
                   "IPC, its ranks span hosts, or a pair of its GPUs lacks peer access)")
        except ValueError as exc:  # a bad setting, raised on every rank alike: a skip, as before
            together, why = False, str(exc)
        if not together:
            for method in asked:
                reasons[method] = reasons[method] or why
    flags = torch.tensor([reason is not None for reason in reasons.values()], dtype=torch.int32,
                         device=comm_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    kept = []
    for (method, reason), skip in zip(reasons.items(), flags.tolist()):
        if not skip:
            kept.append(method)
        elif dist.get_rank(group) == 0:
            print(f"# {what}: skipped method={method!r}: {reason or 'unavailable on another rank'}", file=sys.stdout,
                  flush=True)
    return kept


def slowest_rank(stats: dict, device: torch.device, group=None) -> dict:
    """Per-rank {median_s, min_s, max_s} -> the maximum over ranks of each, separately (a collective
    is done when its last rank is), so min_s and max_s may come from other ranks than median_s."""
    keys = sorted(stats)
    worst = torch.tensor([stats[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, worst.tolist()))


def telemetry(device: torch.device):
    """NVML sampling of this rank's GPU while a measurement runs (empty columns on CPU)."""
    from ..profiling.telemetry import Telemetry

    if device.type != "cuda":
        return Telemetry(nvml=_NoNVML())
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)  # NVML's numbering is not CUDA's
    return Telemetry(index, uuid=str(uuid) if uuid is not None else None)


class _NoNVML:
    """A CPU run samples nothing: NVML would describe a GPU the run did not use."""

    def nvmlInit(self):
        raise RuntimeError("CPU run")
