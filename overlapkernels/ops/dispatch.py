"""Which method runs a fused op, and the record of what ran and why.

Every rule of ``method="auto"`` lives in ``choose``; each decision carries a reason that
``overlap_stats().reasons`` and the ``overlapkernels.ops`` debug log show, so a fusion that was
not applied is never silent. ``strict_overlap()`` turns a fallback to ``baseline`` on an eligible
call (more than one rank) into an error.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections import Counter
from dataclasses import dataclass

import torch

from ..kernels.interpreter import bf16_miscomputed
from ..kernels.offsets import FUSED_DTYPES

log = logging.getLogger("overlapkernels.ops")

METHODS = ("auto", "baseline", "decomposed", "symm", "fused")
PEER_MEMORY_METHODS = ("symm", "fused")

# --- auto thresholds, from our own measurements (benchmarks/results/cpu_tp_ops.md) ------------
# gloo (2 CPU cores, 2-4 ranks): the smallest ring message we measured decomposed at; below it
# per-step latency (ms with several ranks per core) outweighs what overlapping saves.
GLOO_MIN_STEP_BYTES = 512 << 10
# gloo: decomposed wins while each ring step carries at most this many GEMM flops per byte sent;
# above it the matmul dominates and chunking it costs more than the hidden transfer saves
# (all-gather: 1.5x faster at 64 flop/B, 0.92x at 192 flop/B; matmul + reduce-scatter: faster at
# every intensity measured, up to 448 flop/B, since gloo's reduce-scatter is slow).
GLOO_MAX_FLOPS_PER_BYTE = {"all_gather_matmul": 128, "matmul_reduce_scatter": 512}
# CUDA: a per-rank M below this leaves each chunk's GEMM too small to hide a transfer behind
# (wave quantisation); peers report the same regime (flux, torch async-TP need M >= 1-2K). On an
# H200 (benchmarks/results/h200_2026-11-30.md) P chunk GEMMs of Llama-3 TP-8 shapes cost 1.0-1.7x
# the one GEMM from 1024 rows per rank on, up to 3.3x (5.5x on two streams) below; the transfer
# side needs an NVLink node, so the threshold itself is not yet measured.
CUDA_MIN_ROWS_PER_RANK = 1024


class StrictOverlapError(RuntimeError):
    """``strict_overlap()`` is active and an eligible call would have run unoverlapped."""


@dataclass(frozen=True)
class Choice:
    method: str
    reason: str


class OverlapStats(dict):
    """``{(op, method): count}``; ``.reasons`` maps the same keys to ``{reason: count}``."""

    def __init__(self, counts, reasons):
        super().__init__(counts)
        self.reasons = reasons


_lock = threading.Lock()
_counts: Counter = Counter()
_reasons: dict = {}
# Reasons name sizes, so a run of many shapes (variable sequence lengths) would grow them without
# bound: past this many distinct reasons per (op, method) the rest are counted under one entry.
MAX_REASONS_PER_KEY = 100
OTHER_REASONS = f"other reasons (past {MAX_REASONS_PER_KEY} distinct ones; the overlapkernels.ops debug log has each)"
_strict = contextvars.ContextVar("overlapkernels_strict_overlap", default=False)


def overlap_stats(reset: bool = False) -> OverlapStats:
    """Calls per (op, method) since start or the last reset, with the reasons for each choice."""
    with _lock:
        stats = OverlapStats(dict(_counts), {k: dict(v) for k, v in _reasons.items()})
        if reset:
            _counts.clear()
            _reasons.clear()
    return stats


def reset_overlap_stats() -> None:
    overlap_stats(reset=True)


@contextlib.contextmanager
def strict_overlap():
    """Inside, an eligible call for which ``auto`` picks ``baseline`` raises instead."""
    token = _strict.set(True)
    try:
        yield
    finally:
        _strict.reset(token)


def strict_active() -> bool:
    return _strict.get()


@contextlib.contextmanager
def strict_in_backward(active_at_forward: bool):
    """Backward's dual ops see forward's ``strict_overlap()`` too: on CUDA the autograd engine runs
    backward on its own thread per device, which Python context variables do not follow, so the ops
    carry the flag from forward (ctx) into backward with this."""
    token = _strict.set(active_at_forward or _strict.get())
    try:
        yield
    finally:
        _strict.reset(token)


def record(op: str, choice: Choice) -> None:
    with _lock:
        _counts[(op, choice.method)] += 1
        by_reason = _reasons.setdefault((op, choice.method), Counter())
        known = choice.reason in by_reason or len(by_reason) < MAX_REASONS_PER_KEY
        by_reason[choice.reason if known else OTHER_REASONS] += 1
    log.debug("%s: method=%s (%s)", op, choice.method, choice.reason)


def capturing(device: torch.device) -> bool:
    """Is this CUDA stream being captured into a graph? Then nothing may sync the host, and the
    peer-memory methods may not run (their call counters would be frozen into the graph)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def check_method(method) -> str:
    if method not in METHODS:
        raise ValueError(f"method={method!r}: expected one of {list(METHODS)}")
    return method


def choose(op: str, method: str, *, world_size: int, rows_per_rank: int, step_bytes: int, step_flops: int,
           device: torch.device, peer_memory: bool, measure=None, dtype=None, fused_fits: bool = True,
           gemm: bool = True) -> Choice:
    """Resolve ``method`` for one call. ``rows_per_rank``: M of one chunk; ``step_bytes`` /
    ``step_flops``: one ring message and the GEMM work that can hide it; ``peer_memory``: whether
    the group offers symmetric buffers (thread world); ``dtype``: the operands'. ``measure``: a callable returning a measured
    Choice (``OVERLAPKERNELS_AUTO=measure``, forward calls on process groups; ops/measure.py).
    ``fused_fits``: the call's chunks are within the fused GEMMs' 32-bit offsets. ``gemm=False``: a
    gather with no matmul (backward's, when ``a`` needs no gradient), which has nothing to overlap."""
    intensity = step_flops / max(step_bytes, 1)
    if method != "auto":
        choice = Choice(method, "requested")
    elif world_size == 1:  # (a thread world runs no collectives: its copy of the one shard and one GEMM)
        choice = Choice("symm", "world size 1 in a peer-memory world: nothing to overlap") if peer_memory else \
            Choice("baseline", "world size 1: nothing to overlap")
    elif not gemm:  # (not a fallback: strict_overlap has nothing to insist on)
        choice = Choice("symm", "no GEMM in this call: a copy-engine gather") if peer_memory else \
            Choice("baseline", "no GEMM in this call: one all-gather collective, nothing to overlap")
    elif measure is not None and not peer_memory and not capturing(device):  # (timing syncs the host)
        choice = measure()
    elif peer_memory and dtype is not None and bf16_miscomputed(dtype, device):
        choice = Choice("symm", "peer-memory world, bfloat16 in Triton's interpreter, which computes bf16 wrongly: "
                                "symm multiplies with torch")
    elif peer_memory and dtype is not None and dtype not in FUSED_DTYPES:
        choice = Choice("symm", f"peer-memory world, {dtype}: the fused GEMMs take float32/16-bit operands; symm "
                                "multiplies with torch")
    elif peer_memory and not fused_fits:
        choice = Choice("symm", "peer-memory world, chunks past the fused GEMMs' 32-bit offsets: symm multiplies "
                                "with torch")
    elif peer_memory:
        choice = Choice("fused", "peer-memory world: persistent Triton GEMM waiting on chunk signals")
    elif device.type == "cuda":
        if rows_per_rank < CUDA_MIN_ROWS_PER_RANK:
            choice = Choice("baseline", f"{rows_per_rank} rows per rank < {CUDA_MIN_ROWS_PER_RANK}: chunk GEMMs too "
                                        "small to hide a transfer")
        else:
            choice = Choice("decomposed", "CUDA, large M: ring P2P overlapped with chunk GEMMs (not yet measured on "
                                          "GPU by this project; rule from peers' reports)")
    elif step_bytes < GLOO_MIN_STEP_BYTES:
        choice = Choice("baseline", f"gloo ring message {step_bytes} B < {GLOO_MIN_STEP_BYTES} B: per-step "
                                    "latency exceeds the overlap gain (CPU benchmark)")
    elif intensity > GLOO_MAX_FLOPS_PER_BYTE[op]:
        choice = Choice("baseline", f"gloo, {intensity:.0f} GEMM flop per byte sent > {GLOO_MAX_FLOPS_PER_BYTE[op]}: "
                                    "compute-bound, chunking costs more than it hides (CPU benchmark)")
    else:
        choice = Choice("decomposed", f"gloo ring message {step_bytes} B, {intensity:.0f} flop/B: async P2P "
                                      "overlaps the CPU matmul (CPU benchmark)")
    # (an empty call - no rows, or nothing to multiply - has nothing to overlap: not policed, as a world of one)
    if _strict.get() and method == "auto" and world_size > 1 and gemm and step_flops > 0 and choice.method == "baseline":
        raise StrictOverlapError(f"{op}: strict_overlap() is active but the call would run unoverlapped "
                                 f"(method={method!r} -> baseline: {choice.reason})")
    record(op, choice)
    return choice
