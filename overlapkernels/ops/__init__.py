"""Autograd ops composing communication and kernels."""
from .all_gather_matmul import all_gather_matmul
from .dispatch import StrictOverlapError, overlap_stats, reset_overlap_stats, strict_overlap
from .matmul_reduce_scatter import matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "overlap_stats", "reset_overlap_stats", "strict_overlap",
           "StrictOverlapError"]
