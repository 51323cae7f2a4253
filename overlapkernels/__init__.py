"""overlapkernels: communication hidden behind computation, inside the kernels."""
from .ops import (StrictOverlapError, all_gather_matmul, matmul_reduce_scatter, overlap_stats, reset_overlap_stats,
                  ring_attention, shard_sequence, strict_overlap, unshard_sequence)
from .parallel import ParallelDims, init_parallel

__version__ = "0.1.0"
__all__ = ["ParallelDims", "init_parallel", "all_gather_matmul", "matmul_reduce_scatter", "ring_attention",
           "shard_sequence", "unshard_sequence", "overlap_stats",
           "reset_overlap_stats", "strict_overlap", "StrictOverlapError", "__version__"]
