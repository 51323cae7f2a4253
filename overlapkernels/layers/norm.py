"""Norms for sequence-parallel regions, and the gradient all-reduce they need.

Under sequence parallelism each rank normalises only its S/P rows, so the gradient of a norm's
weight (and of a row-parallel bias) is a partial sum per rank: ``allreduce_sequence_parallel_grads``
sums those over the TP group after backward, as Megatron does. Parameters that need it carry
``sequence_parallel = True``.
"""
from __future__ import annotations

import torch
from torch import nn

from ..comm.collectives import all_reduce_coalesced


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-5, *, sequence_parallel=False, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x):
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class LayerNorm(nn.LayerNorm):
    def __init__(self, hidden, eps=1e-5, *, sequence_parallel=False, dtype=None, device=None):
        super().__init__(hidden, eps=eps, dtype=dtype, device=device)
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel


def allreduce_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """Sum the gradients of every parameter marked ``sequence_parallel`` over ``group`` (one
    coalesced all-reduce). Returns how many parameters it touched."""
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    all_reduce_coalesced(grads, group)
    return len(grads)
