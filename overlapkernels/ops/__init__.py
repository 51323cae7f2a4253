"""Autograd ops composing communication and kernels."""
from .all_gather_matmul import all_gather_matmul
from .dispatch import StrictOverlapError, overlap_stats, reset_overlap_stats, strict_overlap
from .local_attention import local_attention
from .matmul_reduce_scatter import matmul_reduce_scatter
from .ring_attention import ring_attention
from .sequence_shard import shard_sequence, unshard_sequence
from .ulysses_attention import ulysses_attention

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "ring_attention", "ulysses_attention", "local_attention", "shard_sequence", "unshard_sequence", "overlap_stats", "reset_overlap_stats", "strict_overlap",
           "StrictOverlapError"]
