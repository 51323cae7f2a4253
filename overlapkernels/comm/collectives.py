"""Raw collectives on flat tensors: ``(out, work)`` forms for async use, names stable across torch
versions (via ``_compat``). The autograd wrappers of later ops are built on these."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from .._compat import all_gather_single, reduce_scatter_single
from ..parallel import resolve_group


def _check_has_dim_0(op: str, x: torch.Tensor) -> None:
    if x.dim() == 0:
        raise ValueError(f"{op}: x is 0-d; expected a tensor with a dim 0 to gather or split along (x.reshape(1))")


def all_gather(x: torch.Tensor, group=None, *, async_op: bool = False):
    """Concatenation of every rank's ``x`` along dim 0 -> ``(out, work or None)``."""
    _check_has_dim_0("all_gather", x)
    group = resolve_group(group)
    out = x.new_empty((dist.get_world_size(group) * x.shape[0], *x.shape[1:]))
    return out, all_gather_single(out, x.contiguous(), group=group, async_op=async_op)


def reduce_scatter(x: torch.Tensor, group=None, *, async_op: bool = False):
    """Rank r gets the sum over ranks of chunk r of ``x`` (dim 0) -> ``(out, work or None)``."""
    _check_has_dim_0("reduce_scatter", x)
    group = resolve_group(group)
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"reduce_scatter: x.shape[0]={x.shape[0]} is not divisible by the group size {world}")
    out = x.new_empty((x.shape[0] // world, *x.shape[1:]))
    return out, reduce_scatter_single(out, x.contiguous(), op=dist.ReduceOp.SUM, group=group, async_op=async_op)


def all_reduce(x: torch.Tensor, group=None, *, async_op: bool = False):
    """In-place sum over ranks -> ``(x, work or None)``."""
    if not x.is_contiguous():  # in place: no contiguous copy to hand over instead
        raise ValueError(f"all_reduce: x of shape {tuple(x.shape)} with strides {x.stride()} is not contiguous; it "
                         "is reduced in place, and NCCL refuses strided tensors (gloo would copy silently)")
    return x, dist.all_reduce(x, op=dist.ReduceOp.SUM, group=resolve_group(group), async_op=async_op)


def all_to_all(x: torch.Tensor, group=None, *, async_op: bool = False):
    """Chunk j of rank i's ``x`` (dim 0) becomes chunk i of rank j's output -> ``(out, work or None)``."""
    _check_has_dim_0("all_to_all", x)
    group = resolve_group(group)
    world = dist.get_world_size(group)
    if x.shape[0] % world:
        raise ValueError(f"all_to_all: x.shape[0]={x.shape[0]} is not divisible by the group size {world}")
    # contiguous: empty_like(x) kept a strided x's layout, which the collective fills as if dense
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    return out, dist.all_to_all_single(out, x.contiguous(), group=group, async_op=async_op)


def all_gather_objects(obj, group=None, device=None) -> list:
    """Every rank's picklable ``obj``, in rank order. NCCL stages the objects on the current CUDA
    device, so ``device`` (where the caller's tensors live) is made current for the call."""
    group = resolve_group(group)
    everyone = [None] * dist.get_world_size(group)
    on_gpu = device is not None and torch.device(device).type == "cuda"
    with torch.cuda.device(device) if on_gpu else contextlib.nullcontext():
        dist.all_gather_object(everyone, obj, group=group)
    return everyone


class RefusedElsewhere(ValueError):
    """Another rank of the group refused its arguments; names that rank and its reason."""


def refuse_together(error: Exception | None, group: dist.ProcessGroup, what: str, device: torch.device, *,
                    elsewhere: type = RefusedElsewhere, verb: str = "refused") -> None:
    """Raises on every rank of ``group`` when any of them refused (``error`` not None there).

    For checks of a rank's own arguments or state (its stage modules, an error only it saw), which
    can hold on some ranks only: raised there alone, the others would go on and wait for that rank
    until a timeout. Every rank calls this once, refused or not: one all-reduce of a flag on
    ``device`` (what the group's collectives use), and only where some rank refused an exchange of
    the reasons. The refusing rank raises its own error; the others an ``elsewhere`` naming the
    lowest refusing rank and its reason."""
    refused = torch.tensor([error is not None], dtype=torch.int32, device=device)
    dist.all_reduce(refused, op=dist.ReduceOp.MAX, group=group)
    if not refused.item():
        return
    reasons = all_gather_objects(None if error is None else f"{type(error).__name__}: {error}", group, device)
    if error is not None:
        raise error
    said = [(r, why) for r, why in enumerate(reasons) if why is not None]
    others = f" (and ranks {[r for r, _ in said[1:]]})" if len(said) > 1 else ""
    raise elsewhere(f"{what}: rank {said[0][0]} of the group{others} {verb}, so this rank stops too: {said[0][1]}")


def all_reduce_coalesced(tensors: list, group=None) -> None:
    """Sum each tensor over ranks in place, as one all-reduce of a flat buffer per (dtype, device)
    (one launch and one latency instead of one per tensor, e.g. for many small gradients). Per
    dtype: one buffer for all would sum in the promoted dtype (int64 counters beside fp32 losses
    lost their low bits, complex ones their imaginary part). Buckets go in order of first
    appearance, the same on every rank that passes the same list."""
    if not tensors:
        return
    group = resolve_group(group)
    buckets: dict = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for members in buckets.values():
        flat = torch.cat([t.reshape(-1) for t in members])
        dist.all_reduce(flat, group=group)
        offset = 0
        for t in members:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()
