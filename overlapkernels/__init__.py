"""overlapkernels: communication hidden behind computation, inside the kernels."""
from .ops import (StrictOverlapError, all_gather_matmul, local_attention, matmul_reduce_scatter, overlap_stats,
                  reset_overlap_stats, ring_attention, shard_sequence, strict_overlap, ulysses_attention,
                  unshard_sequence)
from .comm.process_world import check_pending_errors
from .kernels.errors import PeerFailedError, SignalTimeoutError
from .ops.cross_entropy import vocab_parallel_cross_entropy
from .parallel import ParallelDims, init_parallel
from .runtime.grad_norm import clip_grad_norm_
from . import layers, models  # noqa: E402  (after the ops they build on)

__version__ = "0.1.0"
__all__ = ["ParallelDims", "init_parallel", "clip_grad_norm_", "all_gather_matmul", "matmul_reduce_scatter", "ring_attention",
           "ulysses_attention", "local_attention", "shard_sequence", "unshard_sequence", "vocab_parallel_cross_entropy", "layers", "models", "overlap_stats",
           "reset_overlap_stats", "strict_overlap", "StrictOverlapError", "SignalTimeoutError", "PeerFailedError",
           "check_pending_errors", "__version__"]
