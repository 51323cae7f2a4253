"""Figures of merit, defined as nccl-tests and Flux define them (docs in ../shared/DESIGN.md)."""
from __future__ import annotations

import re
import statistics

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

# busbw = algbw * factor(n): the bytes each rank's busiest link moves, comparable across n
BUS_FACTORS = {
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "all_reduce": lambda n: 2 * (n - 1) / n,
}


def parse_size(text: str) -> int:
    """``"64M"`` -> 67108864 (binary units, as nccl-tests' -b/-e)."""
    match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text).upper())
    if not match:
        raise ValueError(f"size {text!r}: expected a number with an optional K/M/G suffix, e.g. 64M")
    return int(match.group(1)) * _UNITS[match.group(2)]


def parse_size_range(text: str, factor: int = 2) -> list[int]:
    """``"1K:64M"`` -> [1K, 2K, ..., 64M] (each ``factor`` times the last); ``"4M"`` -> [4M]."""
    lo, _, hi = str(text).partition(":")
    lo, hi = parse_size(lo), parse_size(hi or lo)
    if lo < 1 or hi < lo:
        raise ValueError(f"sizes {text!r}: expected MIN:MAX with 1 <= MIN <= MAX")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    return sizes


def algbw_gbps(nbytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (10^9 bytes, as nccl-tests)."""
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def busbw_gbps(op: str, nbytes: int, seconds: float, world_size: int) -> float:
    if op not in BUS_FACTORS:
        raise ValueError(f"op={op!r}: expected one of {sorted(BUS_FACTORS)}")
    if world_size < 1:
        raise ValueError(f"world_size={world_size}: expected >= 1")
    return algbw_gbps(nbytes, seconds) * BUS_FACTORS[op](world_size)


# E is undefined (NaN) when the baseline exposes less communication than this fraction of the GEMM
# time: below it the denominator is timing noise (E(1.020, 1.001, 1.0) would read -19)
E_MIN_EXPOSED = 0.02


def overlap_efficiency(t_method: float, t_baseline: float, t_gemm: float, world_size: int | None = None) -> float:
    """Flux's E = 1 - (T_method - T_gemm) / (T_baseline - T_gemm): 1 = comm hidden, < 0 = slower.
    NaN where the baseline's exposed communication is within noise (E_MIN_EXPOSED of T_gemm), and
    at ``world_size`` 1, where there is no communication: any gap there is the methods' own cost."""
    exposed_baseline = t_baseline - t_gemm
    if world_size == 1 or not exposed_baseline > E_MIN_EXPOSED * max(t_gemm, 0.0):  # (also NaN, nothing exposed)
        return float("nan")
    return 1.0 - (t_method - t_gemm) / exposed_baseline


def summarize(times_s: list[float]) -> dict[str, float]:
    return {"median_s": statistics.median(times_s), "min_s": min(times_s), "max_s": max(times_s)}
