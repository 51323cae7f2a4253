"""``OVERLAPKERNELS_AUTO=measure``: ``auto`` times its candidates on the first call of each shape
and keeps the fastest, so "never slower than baseline" holds on the hardware at hand, not only
where our benchmarks ran.

On the first call of an op with a given (shapes, dtype, device, group) every rank runs each
candidate a few times after a warm-up call (compiles, workspaces) and takes the median; the
per-method times are max-reduced over the group (the slowest rank sets a step's time, and every
rank must pick the same method), and the fastest is cached for the life of the process (baseline
unless another beats it by MARGIN). Candidates: ``baseline`` and ``decomposed``, plus
``symm``/``fused`` where the group offers peer memory (CUDA, one node). The
choice and its timings are the reason ``overlap_stats()`` shows. Backward's dual ops are measured
the same way, under their own shapes: every rank runs backward in the same order, so the timed
collectives pair up as the dual op's own would (not inside CUDA-graph capture: that mode is for
eager training). Groups of one rank and the thread world keep the rules. A candidate that fails
on any rank (its warm-up raised: peer memory that would not set up, an out-of-memory) is dropped
on every rank and named in the reason; if all fail, every rank raises.

Costs to know: each new shape is measured, up to MAX_SHAPES per op and group, then new shapes take
the rules (with variable sequence lengths, pad to a few). Measuring costs no memory for good: the
peer methods share one symmetric workspace per op and dtype (_peer_methods._workspace), so the
loser's buffers are the winner's.
"""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist

from ..comm.group_cache import group_key, per_group_cache
from ..parallel import uses_nccl
from .dispatch import Choice

AUTO_ENV = "OVERLAPKERNELS_AUTO"
AUTO_MODES = ("rules", "measure")
REPEATS = 5  # timed calls per candidate; their median is its time (one slow call must not decide)
# another method replaces baseline only when faster by this fraction: near a tie timing noise would
# otherwise pick at random from one process start to the next (and strict_overlap() with it)
MARGIN = 0.03
MAX_SHAPES = 64  # shapes measured per (op, group); later new ones take the rules (see wanted)

_cache: dict = per_group_cache()


def auto_mode() -> str:
    mode = os.environ.get(AUTO_ENV, "rules")
    if mode not in AUTO_MODES:
        raise ValueError(f"{AUTO_ENV}={mode!r}: expected one of {list(AUTO_MODES)}")
    return mode


def auto_setting(method: str) -> dict:
    """For the TORCH_DISTRIBUTED_DEBUG=DETAIL comparison of calls (``same_call_on_every_rank``):
    ranks whose ``OVERLAPKERNELS_AUTO`` differ would have one measuring (timed collectives of every
    candidate) while another runs its rules' method - a hang. Rules mode makes no collective of its
    own to find out otherwise."""
    return {AUTO_ENV: auto_mode()} if method == "auto" else {}


def candidates(group, device: torch.device, fused_fits: bool = True) -> list:
    """``fused_fits``: the call's chunks are within the fused GEMMs' 32-bit offsets (the same on
    every rank: the ranks make the same call)."""
    found = ["baseline", "decomposed"]
    if device.type == "cuda":
        from ..comm.process_world import group_has_peer_memory

        # every rank must time the same methods: measuring is collective already, so the ranks agree
        # on peer memory (all able, one node) rather than each deciding alone
        if group_has_peer_memory(group, device):
            found += ["symm", "fused"] if fused_fits else ["symm"]
    return found


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def wanted(op: str, key: tuple, group) -> bool:
    """Measure (or reuse the measurement of) this call? While the op has measured fewer than
    MAX_SHAPES shapes on this group, or this shape is one of them: past that (variable sequence
    lengths would measure call after call) new shapes take the rules. Alike on every rank, which
    make the same calls."""
    gk = group_key(group)
    return ((op, gk, *key) in _cache
            or sum(1 for cached in _cache if cached[0] == op and cached[1] == gk) < MAX_SHAPES)


def measured(op: str, key: tuple, group, device: torch.device, run, fused_fits: bool = True) -> Choice:
    """The cached or freshly measured choice for ``key``; ``run(method)`` performs one call."""
    key = (op, group_key(group), *key)
    if key in _cache:
        return _cache[key]
    methods, seconds, failed, first_error = [], [], [], None
    on = device if uses_nccl(group) else "cpu"
    with torch.no_grad():
        for method in candidates(group, device, fused_fits):
            # warm-up (compiles, workspaces, first-call barriers), then the ranks agree whether it ran
            # everywhere: a candidate that failed on any rank (peer memory that would not set up, an
            # out-of-memory) is dropped by all, where one rank raising would leave the others waiting
            # in the next collective. (A failure inside a collective cannot be recovered this way.)
            error = None
            try:
                run(method)
                _sync(device)
            except Exception as exc:  # noqa: BLE001 - reported below, on every rank alike
                error = exc
            flag = torch.tensor([error is not None], dtype=torch.int32, device=on)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)  # (also lines the ranks up, as a barrier)
            if flag.item():
                failed.append(f"{method} failed" + (f" here ({type(error).__name__}: {error})"[:200] if error else
                                                    " on another rank"))
                first_error = first_error or error
                continue
            calls = []
            for _ in range(REPEATS):
                start = time.perf_counter()
                run(method)
                _sync(device)
                calls.append(time.perf_counter() - start)
            methods.append(method)
            seconds.append(statistics.median(calls))
    if not methods:
        message = f"{op}: OVERLAPKERNELS_AUTO=measure: every candidate failed ({'; '.join(failed)})"
        if first_error is not None:
            raise RuntimeError(message) from first_error
        raise RuntimeError(message)
    times = torch.tensor(seconds, dtype=torch.float64, device=on)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    times = times.tolist()
    best = min(range(len(methods)), key=times.__getitem__)
    if "baseline" in methods and times[best] > (1 - MARGIN) * times[methods.index("baseline")]:
        best = methods.index("baseline")  # within the margin: a tie, and baseline is the safe side
    report = ", ".join([f"{m} {t * 1e3:.3g} ms" for m, t in zip(methods, times)] + failed)
    _cache[key] = Choice(methods[best], f"measured on the first call of this shape (slowest rank): {report}")
    return _cache[key]
