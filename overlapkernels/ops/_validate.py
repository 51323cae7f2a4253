"""Argument checks shared by the fused ops; all run before any rank communicates."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel import resolve_group


def group_size(group) -> int:
    """World size of a ProcessGroup, or of a peer-memory world handle (thread world rank)."""
    if hasattr(group, "alloc_symmetric"):
        return group.world_size
    return dist.get_world_size(resolve_group(group))


def is_peer_world(group) -> bool:
    return hasattr(group, "alloc_symmetric")


def check_tensor(name: str, value, min_dim: int = 1) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(value.shape)}")
    return value


def check_weights(b, a: torch.Tensor, a_name: str) -> tuple[list, bool]:
    """``b`` as a list of [K, N] tensors matching ``a``; the bool says whether it was a single one."""
    single = isinstance(b, torch.Tensor)
    if not single and not (isinstance(b, (list, tuple)) and b):
        raise TypeError(f"b must be a [K, N] tensor or a non-empty list/tuple of them, got {type(b).__name__}"
                        + (" (empty)" if isinstance(b, (list, tuple)) else ""))
    bs = [b] if single else list(b)
    k = a.shape[-1]
    for i, w in enumerate(bs):
        name = "b" if single else f"b[{i}]"
        check_tensor(name, w)
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D [K, N], got shape {tuple(w.shape)}")
        if w.shape[0] != k:
            raise ValueError(f"{name}.shape[0]={w.shape[0]} does not match {a_name}.shape[-1]={k} (the contracted "
                             "dim K)")
        if w.dtype != a.dtype:
            raise ValueError(f"{name}.dtype={w.dtype} does not match {a_name}.dtype={a.dtype}")
        if w.device != a.device:
            raise ValueError(f"{name} is on {w.device} but {a_name} is on {a.device}; expected one device")
    return bs, single


def check_dim(name: str, dim, tensor: torch.Tensor, tensor_name: str) -> int:
    """Normalise a non-negative/negative dim that must not be the contracted (last) one."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    nd = tensor.dim()
    if not -nd <= dim < nd:
        raise ValueError(f"{name}={dim} is out of range for {tensor_name} with {nd} dims")
    if dim % nd == nd - 1:  # messages keep the caller's value: -1 stays -1
        raise ValueError(f"{name}={dim} is the last dim of {tensor_name}, which the matmul contracts; expected one "
                         f"of 0..{nd - 2} (or {-nd}..-2)")
    return dim % nd


def check_ids(ids: torch.Tensor, bad: torch.Tensor, error, device_message: str) -> None:
    """Raise ``error(first bad id)`` where ``bad`` (a mask over ``ids``) has any; on CUDA a
    device-side assert instead (as torch's own embedding and cross-entropy do): reading the mask
    would sync the host on every call."""
    if not ids.is_cuda:
        if bool(bad.any()):
            raise error(int(ids[bad][0]))
    else:
        torch._assert_async(~bad.any(), device_message)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


def check_same_on_every_rank(group, op: str, **args) -> None:
    """Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch's own switch), every rank of ``group`` must
    call ``op`` with the same shapes, dtypes and options, else ValueError on every rank naming the
    ranks and what differs. Why our own: torch checks its collectives that way, but not the P2P
    rings and peer-memory methods, where a mismatch aborts gloo or hangs. Off by default: it costs
    a collective per call."""
    if is_peer_world(group) or dist.get_debug_level() != dist.DebugLevel.DETAIL:
        return
    mine = {name: _describe(value) for name, value in args.items()}
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    differ = [name for name in mine if len({str(theirs.get(name)) for theirs in everyone}) > 1]
    if differ:
        ranks = "; ".join(f"rank {r}: " + ", ".join(f"{n}={theirs.get(n)}" for n in differ)
                          for r, theirs in enumerate(everyone))
        raise ValueError(f"{op}: the ranks of the group disagree on {', '.join(differ)} ({ranks}); "
                         "every rank must make the same call (TORCH_DISTRIBUTED_DEBUG=DETAIL check)")
