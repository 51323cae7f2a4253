"""Megatron-style parallel layers built on the overlapped ops (no communication code of their own)."""
from .attention import ParallelSelfAttention, rope
from .block import TransformerBlock
from .embedding import VocabParallelEmbedding
from .linear import ColumnParallelLinear, RowParallelLinear
from .mlp import ParallelMLP
from .norm import LayerNorm, RMSNorm, allreduce_sequence_parallel_grads
from .tags import mark_context_parallel

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "RMSNorm", "LayerNorm",
           "allreduce_sequence_parallel_grads", "ParallelMLP", "ParallelSelfAttention", "TransformerBlock", "rope",
           "mark_context_parallel"]
