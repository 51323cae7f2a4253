"""A pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""
from __future__ import annotations

from torch import nn

from ..parallel import resolve_group
from .attention import ParallelSelfAttention
from .mlp import ParallelMLP
from .norm import RMSNorm


class TransformerBlock(nn.Module):
    def __init__(self, hidden, num_heads, num_kv_heads, ffn_hidden, group=None, *, cp_group=None,
                 cp_layout="zigzag", sequence_parallel=False, method="auto", dtype=None, device=None,
                 init_method=None, cp_attention="ring"):
        super().__init__()
        group = resolve_group(group)
        self.attn_norm = RMSNorm(hidden, sequence_parallel=sequence_parallel, group=group, dtype=dtype, device=device)
        self.attn = ParallelSelfAttention(hidden, num_heads, num_kv_heads, group, cp_group=cp_group,
                                          cp_layout=cp_layout, sequence_parallel=sequence_parallel, method=method,
                                          dtype=dtype, device=device, init_method=init_method,
                                          cp_attention=cp_attention)
        self.mlp_norm = RMSNorm(hidden, sequence_parallel=sequence_parallel, group=group, dtype=dtype, device=device)
        self.mlp = ParallelMLP(hidden, ffn_hidden, group, sequence_parallel=sequence_parallel, method=method,
                               dtype=dtype, device=device, init_method=init_method)

    def reset_parameters(self) -> None:
        """Every layer redrawn in construction order (after ``to_empty`` of a meta build): the same
        values for the same seed. Call it on the block, not through ``model.apply`` (which visits
        children first and would redraw in another order)."""
        for layer in (self.attn_norm, self.attn, self.mlp_norm, self.mlp):
            layer.reset_parameters()

    def forward(self, x, segment_ids=None):
        """``segment_ids``: packed documents (ParallelSelfAttention)."""
        x = x + self.attn(self.attn_norm(x), segment_ids)
        return x + self.mlp(self.mlp_norm(x))
