"""Norms for sequence-parallel regions, and the gradient all-reduce they need.

Under sequence parallelism each rank normalises only its S/P rows, so the gradient of a norm's
weight (and of a row-parallel bias) is a partial sum per rank that must be summed over the TP
group after backward, as Megatron does. Such parameters carry ``sequence_parallel = True`` and,
when the layer knows its TP group, ``sequence_parallel_group``: ``fsdp.shard`` (whose stages 2/3
drop full gradients during backward, before a client could sum them) and
``allreduce_sequence_parallel_grads`` read the group from that tag.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ..comm.collectives import all_reduce_coalesced


def mark_sequence_parallel(param: nn.Parameter, sequence_parallel: bool, group=None) -> None:
    """Tag a parameter whose gradient is partial per TP rank under SP (and the group to sum it over)."""
    param.sequence_parallel = bool(sequence_parallel)
    if sequence_parallel and group is not None:
        param.sequence_parallel_group = group


class RMSNorm(nn.Module):
    def __init__(self, hidden, eps=1e-5, *, sequence_parallel=False, group=None, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype, device=device))
        mark_sequence_parallel(self.weight, sequence_parallel, group)

    def forward(self, x):
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class LayerNorm(nn.LayerNorm):
    def __init__(self, hidden, eps=1e-5, *, sequence_parallel=False, group=None, dtype=None, device=None):
        super().__init__(hidden, eps=eps, dtype=dtype, device=device)
        for p in self.parameters():
            mark_sequence_parallel(p, sequence_parallel, group)


def allreduce_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """Sum the gradients of every parameter marked ``sequence_parallel`` over ``group``, else over
    the parameter's own ``sequence_parallel_group`` tag, else over the world (one coalesced
    all-reduce per group). Returns how many parameters it touched.

    Parameters sharded by ``fsdp.shard`` with a group tag are skipped: fsdp sums them itself
    before reducing over DP, and a second sum here would multiply them by the TP size."""
    by_group = defaultdict(list)  # insertion order = parameter order: the same on every rank
    for p in module.parameters():
        if not getattr(p, "sequence_parallel", False) or p.grad is None:
            continue
        if getattr(p, "_fsdp_sums_sequence_parallel", False):
            continue
        by_group[group if group is not None else getattr(p, "sequence_parallel_group", None)].append(p.grad)
    for g, grads in by_group.items():
        all_reduce_coalesced(grads, g)
    return sum(len(grads) for grads in by_group.values())
