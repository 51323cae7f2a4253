"""Norms for sequence-parallel regions, and the gradient all-reduce they need.

Under sequence parallelism each rank normalises only its S/P rows, so the gradient of a norm's
weight (and of a row-parallel bias) is a partial sum per rank that must be summed over the TP
group after backward, as Megatron does. Such parameters carry ``sequence_parallel = True`` and,
when the layer knows its TP group, ``sequence_parallel_group``: ``fsdp.shard`` (whose stages 2/3
drop full gradients during backward, before a client could sum them) and
``allreduce_sequence_parallel_grads`` read the group from that tag. The owning module also keeps
the names (``tags.py``): wrappers that replace parameters, as torch's FSDP2 ``fully_shard`` does
with DTensors, drop attributes set on the old ones, and a norm whose partial gradients nobody sums
lets the TP ranks' copies drift apart silently.
"""
from __future__ import annotations

from collections import defaultdict

import torch
from torch import nn

from ..comm.collectives import all_reduce_coalesced
from ..ops._validate import check_flag, check_size
from .tags import SEQUENCE_PARALLEL, KeepsTags, remembered


def mark_sequence_parallel(param: nn.Parameter, sequence_parallel: bool, group=None, *,
                           owner: nn.Module | None = None) -> None:
    """Tag a parameter whose gradient is partial per TP rank under SP (and the group to sum it over).
    ``owner``: the module the parameter is registered on, which remembers it by name too."""
    name = None
    if owner is not None:  # refused before the parameter is tagged
        name = next((n for n, p in owner.named_parameters(recurse=False) if p is param), None)
        if name is None:
            raise ValueError(f"mark_sequence_parallel: owner {type(owner).__name__} does not hold this parameter "
                             "directly (register it on the module first)")
    param.sequence_parallel = bool(sequence_parallel)
    if sequence_parallel and group is not None:
        param.sequence_parallel_group = group
    if name is not None:
        remembered_here = owner.__dict__.setdefault(SEQUENCE_PARALLEL, {})
        if sequence_parallel:
            remembered_here[name] = group
        else:
            remembered_here.pop(name, None)


class RMSNorm(KeepsTags, nn.Module):
    def __init__(self, hidden, eps=1e-5, *, sequence_parallel=False, group=None, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(check_size(hidden, "hidden"), dtype=dtype, device=device))
        mark_sequence_parallel(self.weight, check_flag(sequence_parallel, "sequence_parallel"), group, owner=self)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x):
        x32 = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.to(x.dtype) * self.weight


class LayerNorm(KeepsTags, nn.LayerNorm):
    def __init__(self, hidden, eps=1e-5, *, sequence_parallel=False, group=None, dtype=None, device=None):
        super().__init__(check_size(hidden, "hidden"), eps=eps, dtype=dtype, device=device)
        sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
        for p in self.parameters():
            mark_sequence_parallel(p, sequence_parallel, group, owner=self)


def _sequence_parallel_params(module: nn.Module):
    """(param, group) for every SP parameter of ``module``, in parameter order (the same on every
    rank): those its modules remember by name (whatever object now holds the name: FSDP2 swaps in
    DTensors), then those only tagged (Megatron's, or a client's)."""
    found = {}
    for param, group in remembered(module, SEQUENCE_PARALLEL):
        found.setdefault(id(param), (param, group))
    for param in module.parameters():
        if getattr(param, "sequence_parallel", False):
            found.setdefault(id(param), (param, getattr(param, "sequence_parallel_group", None)))
    order = {id(p): i for i, p in enumerate(module.parameters())}
    return sorted(found.values(), key=lambda pg: order.get(id(pg[0]), len(order)))


def allreduce_sequence_parallel_grads(module: nn.Module, group=None) -> int:
    """Sum the gradients of every parameter marked ``sequence_parallel`` over ``group``, else over
    the parameter's own ``sequence_parallel_group`` tag, else over the world (one coalesced
    all-reduce per group). Returns how many parameters it touched.

    Call it once per optimizer step, after the last backward (gradients accumulate across
    microbatches; summing after each would sum the running total again). Works under torch's
    FSDP2 too: each rank then sums its local shard of the DTensor gradient (the same shard index
    on every TP rank of a DP coordinate).
    Parameters sharded by ``fsdp.shard`` with a group tag are skipped: fsdp sums them itself
    before reducing over DP, and a second sum here would multiply them by the TP size."""
    by_group = defaultdict(list)  # insertion order = parameter order: the same on every rank
    for p, tagged_group in _sequence_parallel_params(module):
        if p.grad is None or getattr(p, "_fsdp_sums_sequence_parallel", False):
            continue
        grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad  # a view: sums land in the DTensor
        by_group[group if group is not None else tagged_group].append(grad)
    for g, grads in by_group.items():
        all_reduce_coalesced(grads, g)
    return sum(len(grads) for grads in by_group.values())
