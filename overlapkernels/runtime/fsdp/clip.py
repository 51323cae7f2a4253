"""Gradient clipping of ShardedModules by the norm of the whole model: one module, or every one
this rank holds (an interleaved pipeline's chunks), each element of the reduced gradients counted
once over the world (TP/PP/CP/DP with ``dims``) or over the modules' group."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ...parallel import comm_device
from ..grad_norm import check_clip_args, global_norm, replicas, scale_, split_beyond_data_parallel
from .sharded import ShardedModule


def _norm_pieces(sharded, dims) -> list:
    """(this rank's slice of a parameter's reduced gradient, how many ranks hold that slice)."""
    pieces = []
    for unit in sharded.all_units:
        if unit.master.grad is None:
            continue
        start, offset = unit.rank * unit.shard_numel, 0  # this shard's slice of each parameter
        for param, n in zip(unit.params, unit.numels):
            lo, hi = max(offset, start), min(offset + n, start + unit.shard_numel)
            if lo < hi:
                pieces.append((unit.master.grad[lo - start:hi - start], replicas(param, dims, sharded_over_dp=True)))
            offset += n
    return pieces


def sharded_modules(modules) -> list:
    """``modules`` (one ShardedModule, or a non-empty list of them: an interleaved pipeline's chunks)
    as a list; anything else refused by name."""
    if isinstance(modules, ShardedModule):
        return [modules]
    if isinstance(modules, (list, tuple, nn.ModuleList)) and len(modules):
        for i, m in enumerate(modules):
            if not isinstance(m, ShardedModule):
                raise TypeError(f"modules[{i}]={type(m).__name__}: expected a ShardedModule (fsdp.shard)")
        return list(modules)
    shown = repr(modules) if isinstance(modules, (list, tuple)) else type(modules).__name__
    raise TypeError(f"modules={shown}: expected a ShardedModule (fsdp.shard) or a non-empty list of them")


def step_group(mods: list, dims, op: str, once: str, quantity: str):
    """The group whose every rank must agree on ``quantity``, a step-wide value of ``mods``' gradients
    (their norm, whether one overflowed): theirs (pure data parallelism, ``dims`` None), or the
    world. ``op`` and ``once`` name the caller in the errors. Raises before any collective, alike on
    the group's ranks where they hold replicas of one part (a DP group); a group that also spans
    other parts (one ShardedModule over the world in a pipeline of unlike stages) could refuse on
    some ranks only - the others then wait in the caller's all-reduce until its timeout."""
    if any(not m._sync for m in mods):  # what later micro-steps add would escape it
        raise RuntimeError(f"{op} inside no_sync(): {once}, after the last backward of the step")
    if dims is not None:
        return dist.group.WORLD
    groups = {tuple(dist.get_process_group_ranks(m.group)) for m in mods}
    if len(groups) > 1:
        raise ValueError(f"{op}: the modules are sharded over different groups {sorted(groups)}; pass "
                         f"dims= (a ParallelDims) so {quantity} spans the world")
    split = split_beyond_data_parallel([m.module for m in mods])
    if split is not None:  # each TP rank / stage would take its own value: TP-replicated weights drift apart
        raise ValueError(f"{op} with dims=None: {split}, so {quantity} over the data-parallel group alone would "
                         "differ between its parts; pass dims= (the ParallelDims) so it spans the world")
    return mods[0].group


def clip_grad_norm_(modules, max_norm, norm_type=2.0, *, dims=None, error_if_nonfinite=False,
                    foreach=None) -> torch.Tensor:
    """``ShardedModule.clip_grad_norm_`` over every ShardedModule this rank holds (``modules``: one,
    or a list: an interleaved pipeline's chunks), by the norm of all of them together; every rank
    calls it alike, with its own modules. ``dims=None`` (pure data parallelism) needs the modules
    to share one group."""
    mods = sharded_modules(modules)
    p = check_clip_args(max_norm, norm_type)
    group = step_group(mods, dims, "clip_grad_norm_", "clip once", "the norm")
    pieces = []
    for m in mods:
        m._finish_gradients()
        pieces += _norm_pieces(m, dims)
    device = next((u.device for m in mods for u in m.all_units), None) or comm_device(group)
    total = global_norm(pieces, p, group, device)
    scale_([u.master.grad for m in mods for u in m.all_units if u.master.grad is not None], float(max_norm), total,
           error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    return total
