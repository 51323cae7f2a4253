"""Gradient clipping by the global norm of a model split over DP, PP, CP and TP ranks.

``torch.nn.utils.clip_grad_norm_`` sees this rank's tensors only: under tensor parallelism every
rank gets a different partial norm and clips by a different factor (replicated weights drift
apart), and under FSDP stages 2/3 no parameter holds a gradient after backward at all. Here each
rank adds its share of the global norm and one all-reduce over the world sums the shares. Every
element counts once however many ranks hold a copy: a copy's share is divided by the number of
its replicas, DP and CP replicas always (they split the batch and the sequence, never the
weights), TP replicas unless the parameter is partitioned over TP (``tensor_model_parallel``, as
Megatron and our layers mark them). PP stages hold distinct parameters. As torch does, the
gradients are scaled by ``max_norm / (total + 1e-6)`` when that is below 1, and the total norm
is returned on the gradients' device, summed in fp64, in the gradients' dtype (at least fp32).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist


def replicas(param, dims, *, sharded_over_dp: bool = False) -> int:
    """Ranks holding the same values of ``param``'s gradient (``dims``: a ParallelDims, or None
    for a group of pure data parallelism, whose copies FSDP shards)."""
    if dims is None:
        return 1
    tp = 1 if getattr(param, "tensor_model_parallel", False) else dims.tp_size
    return tp * dims.cp_size * (1 if sharded_over_dp else dims.dp_size)


def check_clip_args(max_norm, norm_type) -> float:
    for name, value in (("max_norm", max_norm), ("norm_type", norm_type)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not max_norm > 0:
        raise ValueError(f"max_norm={max_norm!r}: expected a positive number")
    if not (norm_type > 0 or norm_type == math.inf):
        raise ValueError(f"norm_type={norm_type!r}: expected a positive number or math.inf")
    return float(norm_type)


def global_norm(pieces, norm_type: float, group, device: torch.device) -> torch.Tensor:
    """The norm over all ranks of ``group`` of ``pieces``: (gradient tensor, its replica count)."""
    p = float(norm_type)
    total = torch.zeros((), dtype=torch.float64, device=device)
    if p == math.inf:
        for t, _ in pieces:
            if t.numel():
                total = torch.maximum(total, t.detach().abs().max().double().to(device))
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        for t, count in pieces:  # fp64 sums: many ranks' shares of a large model
            total += torch.linalg.vector_norm(t.detach(), p, dtype=torch.float64).to(device) ** p / count
        dist.all_reduce(total, group=group)
        total = total ** (1.0 / p)
    widest = max((t.dtype for t, _ in pieces), key=lambda d: torch.finfo(d).bits, default=torch.float32)
    return total.to(widest if torch.finfo(widest).bits >= 32 else torch.float32)


def scale_(tensors, max_norm: float, total: torch.Tensor) -> None:
    coef = torch.clamp(max_norm / (total.double() + 1e-6), max=1.0)  # no host read, as torch does
    for t in tensors:
        t.mul_(coef.to(t.device, t.dtype))


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *, dims) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters of a model split as ``dims`` describes
    (a ``ParallelDims`` from ``ok.init_parallel``): the norm of the whole model's gradient, the
    same on every rank, and every rank clips by the same factor. Call it on every rank, once the
    gradients are complete (after ``model.sync_grads()`` and any DP averaging). Under
    ``fsdp.shard`` use ``ShardedModule.clip_grad_norm_`` instead: the gradients live in its shards."""
    p = check_clip_args(max_norm, norm_type)
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    for q in params:
        if q.grad is not None and hasattr(q.grad, "to_local"):
            # torch's FSDP2 (fully_shard) swaps in DTensor parameters without the tensor_model_parallel
            # tags this needs, so a TP-split weight would count as a replica: refuse, not mis-clip
            raise TypeError("clip_grad_norm_: a gradient is a DTensor (parameters wrapped by torch's FSDP2 "
                            "fully_shard?); this needs plain per-rank gradients with their TP tags: shard with "
                            "ok's fsdp.shard and use ShardedModule.clip_grad_norm_")
    grads = [(q.grad, replicas(q, dims)) for q in params if q.grad is not None]
    device = grads[0][0].device if grads else (params[0].device if params else torch.device("cpu"))
    if dist.get_backend() == "nccl" and device.type != "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    total = global_norm(grads, p, dist.group.WORLD, device)
    scale_([g for g, _ in grads], float(max_norm), total)
    return total
