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
from torch import nn

from ..parallel import comm_device, uses_nccl


def replicas(param, dims, *, sharded_over_dp: bool = False, partitioned: bool | None = None) -> int:
    """Ranks holding the same values of ``param``'s gradient (``dims``: a ParallelDims, or None
    for pure data parallelism over the world). ``partitioned``: whether it is
    split over TP, when known otherwise than by its ``tensor_model_parallel`` tag."""
    if dims is None:  # every rank of the world holds a copy, unless sharded over it (fsdp)
        return 1 if sharded_over_dp else dist.get_world_size()
    if partitioned is None:
        partitioned = getattr(param, "tensor_model_parallel", False)
    tp = 1 if partitioned else dims.tp_size
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


def global_norm(pieces, norm_type: float, group, device: torch.device, *, refused: bool = False) -> torch.Tensor:
    """The norm over all ranks of ``group`` of ``pieces``: (gradient tensor, its replica count).
    ``refused``: this rank refused its gradients; it still takes part in the all-reduce (the others
    wait in it) and the norm comes out NaN on every rank, with no extra collective or host read."""
    p = float(norm_type)
    total = torch.zeros(2, dtype=torch.float64, device=device)  # [this rank's share, refused]
    total[1] = float(refused)
    if p == math.inf:
        for t, _ in pieces:
            if t.numel():
                total[0] = torch.maximum(total[0], t.detach().abs().max().double().to(device))
        # NCCL's MAX is fmax, which drops a NaN (gloo keeps one only from rank 0): a NaN gradient on
        # one rank must make the norm NaN everywhere, as torch's clip_grad_norm_ does on one rank
        # (the flag carries it; the value is zeroed so both backends reduce alike)
        total[1] = torch.maximum(total[1], total[0].isnan().double())
        total[0] = torch.nan_to_num(total[0], nan=0.0, posinf=math.inf)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        norm = total[0]
    else:
        for t, count in pieces:  # fp64 sums: many ranks' shares of a large model
            total[0] += torch.linalg.vector_norm(t.detach(), p, dtype=torch.float64).to(device) ** p / count
        dist.all_reduce(total, group=group)
        norm = total[0] ** (1.0 / p)
    norm = torch.where(total[1] > 0, torch.full_like(norm, math.nan), norm)
    widest = max((t.dtype for t, _ in pieces), key=lambda d: torch.finfo(d).bits, default=torch.float32)
    return norm.to(widest if torch.finfo(widest).bits >= 32 else torch.float32)


def scale_(tensors, max_norm: float, total: torch.Tensor, *, error_if_nonfinite: bool = False,
           foreach: bool | None = None) -> None:
    """Clip ``tensors`` by ``total`` as torch's ``clip_grad_norm_`` does, with its two options:
    ``error_if_nonfinite`` (a host read of the norm, the same on every rank, so every rank raises
    alike, before any gradient is scaled) and ``foreach`` (one multi-tensor kernel per device and
    dtype; None: where the tensors are on CUDA)."""
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(f"the total norm of the gradients is {float(total)}, so they cannot be clipped; set "
                           "error_if_nonfinite=False to scale them by it anyway")
    coef = torch.clamp(max_norm / (total.double() + 1e-6), max=1.0)  # no host read, as torch does
    groups: dict = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    for (device, dtype), ts in groups.items():
        if foreach or (foreach is None and device.type == "cuda"):
            torch._foreach_mul_(ts, coef.to(device, dtype))
        else:
            for t in ts:
                t.mul_(coef.to(device, dtype))


def dtensor_replicas(grad, partitioned_over_tp: bool, dims) -> int:
    """Ranks holding the same values as this rank's local shard of a DTensor gradient (torch's FSDP2):
    its mesh shards it over the ranks of its ``Shard`` dimensions, which must lie among the
    parameter's copies (DP, CP, and TP unless partitioned over TP); the other copies replicate it."""
    placements = grad.placements
    if any(pl.is_partial() for pl in placements):
        raise ValueError(f"clip_grad_norm_: a DTensor gradient with placements {placements} is still a partial "
                         "sum (Partial); clip after the gradients are reduced")
    sharded = math.prod(grad.device_mesh.size(i) for i, pl in enumerate(placements) if pl.is_shard())
    if getattr(dims, "mesh", None) is not None:
        strangers = set(grad.device_mesh.mesh.flatten().tolist()) - _copy_ranks(dims, partitioned_over_tp)
        if strangers:
            other = "another pipeline stage or TP shard" if partitioned_over_tp else "another pipeline stage"
            raise ValueError(f"clip_grad_norm_: a DTensor gradient's mesh spans ranks {sorted(strangers)}, which hold "
                             f"other parts of the model ({other}); shard it over DP (and CP) ranks only")
    copies = replicas(grad, dims, partitioned=partitioned_over_tp)  # were it not sharded
    if copies % sharded:
        raise ValueError(f"clip_grad_norm_: a DTensor gradient is sharded over {sharded} ranks, which does not "
                         f"divide its {copies} copies (DP x CP{'' if partitioned_over_tp else ' x TP'} of dims): "
                         "shard it over DP (and CP) ranks only")
    return copies // sharded


def _copy_ranks(dims, partitioned_over_tp: bool) -> set:
    """The ranks holding a copy of this rank's part of a parameter: its pipeline stage, and its TP
    shard when the parameter is split over TP."""
    from ..parallel import AXES

    index = [slice(None)] * len(AXES)
    for axis in ("pp", "tp") if partitioned_over_tp else ("pp",):
        index[AXES.index(axis)] = dims.mesh.get_local_rank(axis)
    return set(dims.mesh.mesh[tuple(index)].flatten().tolist())


def split_beyond_data_parallel(modules) -> str | None:
    """What says that ``modules`` hold one part of a model split over TP or PP (our parallel
    layers' groups, a GPT built as one pipeline stage), or None. Megatron's own layers carry no
    group: nothing is said there. CP says nothing either: its ranks end up with the same (summed)
    gradients."""
    from ..layers.tags import PIPELINE_STAGE, TENSOR_PARALLEL

    for module in modules:
        for name, sub in module.named_modules():
            where = f"{type(sub).__name__} {name!r}" if name else type(sub).__name__
            stage = sub.__dict__.get(PIPELINE_STAGE)
            if stage is not None and stage[1] > 1:
                return f"{where} is stage {stage[0]} of a pipeline of {stage[1]}"
            group = sub.__dict__.get("group")
            if sub.__dict__.get(TENSOR_PARALLEL) and isinstance(group, dist.ProcessGroup) \
                    and dist.get_world_size(group) > 1:
                return f"{where} is split over a TP group of {dist.get_world_size(group)} ranks"
    return None


def _tagged_parameters(parameters, dims) -> list:
    """``(parameter, partitioned over TP)``: from a module, through its memory of the tags (which
    finds FSDP2's sharded parameters), else from the parameters' own tags."""
    if isinstance(parameters, nn.Module):
        from ..layers.tags import tensor_parallel_parameters

        split = split_beyond_data_parallel([parameters]) if dims is None else None
        if split is not None:
            raise ValueError(f"clip_grad_norm_ with dims=None: {split}, but dims=None takes every rank's gradients "
                             "for data-parallel replicas, so the norm would be wrong; pass dims= (the ParallelDims)")

        return [(q, dim is not None) for _, q, dim in tensor_parallel_parameters(parameters)]
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    if dims is not None and dims.tp_size > 1:
        for q in params:
            if q.grad is not None and hasattr(q.grad, "to_local") and not hasattr(q, "tensor_model_parallel"):
                # torch's FSDP2 (fully_shard) swaps in DTensor parameters without the tensor_model_parallel
                # tags: a TP-split weight would count as a replica. The module remembers them by name.
                raise TypeError("clip_grad_norm_: a gradient is a DTensor without its TP tags (parameters wrapped "
                                "by torch's FSDP2 fully_shard?); pass the model itself, "
                                "ok.clip_grad_norm_(model, max_norm, dims=dims), whose layers remember their tags")
    return [(q, getattr(q, "tensor_model_parallel", False)) for q in params]


def _sharded_modules(parameters):
    """``parameters`` when it is a ShardedModule or a non-empty list of them (else None)."""
    from .fsdp.sharded import ShardedModule  # (fsdp imports this module)

    if isinstance(parameters, ShardedModule):
        return parameters
    if isinstance(parameters, (list, tuple, nn.ModuleList)) and len(parameters) \
            and all(isinstance(m, ShardedModule) for m in parameters):
        return list(parameters)
    return None


def clip_grad_norm_(parameters, max_norm, norm_type=2.0, *, dims, error_if_nonfinite=False,
                    foreach=None) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for parameters of a model split as ``dims`` describes
    (a ``ParallelDims`` from ``ok.init_parallel``): the norm of the whole model's gradient, the
    same on every rank, and every rank clips by the same factor. Call it on every rank, once the
    gradients are complete (after ``model.sync_grads()`` and any DP averaging). Under
    ``fsdp.shard`` pass the ShardedModule: the gradients live in its shards.

    ``parameters``: a tensor, an iterable of them, or the model (``nn.Module``); a ShardedModule
    (``fsdp.shard``), or a list of them, is clipped by ``fsdp.clip_grad_norm_`` (its shards hold the
    gradients; passing its parameters is refused). Pass the model
    under torch's FSDP2 (``fully_shard``): its DTensor parameters lost the TP tags, which our
    layers remember by name, and after backward with reshard-after-backward off the module holds
    unsharded parameters without gradients, which only the model form looks past; each rank's
    local shard is counted once per copy. ``dims=None``: pure data parallelism over the world
    (plain gradients are replicas on every rank, DTensor ones sharded over their mesh); a model
    that our layers split over TP, or a GPT pipeline stage, is refused with it.

    A rank that refuses its gradients (a TypeError or ValueError naming why) still joins the
    all-reduce before raising, and the other ranks' norm is NaN: their gradients become NaN, never
    silently mis-clipped, while the refusing rank's error stops the job. ``error_if_nonfinite`` and
    ``foreach`` as in torch (see ``scale_``)."""
    sharded = _sharded_modules(parameters)
    if sharded is not None:  # the gradients live in the shards: the fsdp clip counts them
        from .fsdp.clip import clip_grad_norm_ as clip_sharded

        return clip_sharded(sharded, max_norm, norm_type, dims=dims, error_if_nonfinite=error_if_nonfinite,
                            foreach=foreach)
    p = check_clip_args(max_norm, norm_type)
    params, grads, refusal = [], [], None
    shard_copies = {}  # FSDP2's parameters share a few meshes and layouts: check and count each once
    try:
        params = _tagged_parameters(parameters, dims)
        for q, partitioned in params:
            if getattr(q, "_fsdp_sharded", False):  # .grad unreduced (stage 1) or None (2/3): not the gradient
                raise TypeError("clip_grad_norm_: a parameter of a ShardedModule (fsdp.shard) was passed; its "
                                "gradients live in the module's shards: pass the ShardedModule itself, "
                                "ok.clip_grad_norm_(sharded, max_norm, dims=dims), or sharded.clip_grad_norm_")
            if q.grad is None:
                continue
            if hasattr(q.grad, "to_local"):  # a view of the local shard: clipping scales the DTensor in place
                layout = (id(q.grad.device_mesh), tuple(q.grad.placements), partitioned)
                if layout not in shard_copies:
                    shard_copies[layout] = dtensor_replicas(q.grad, partitioned, dims)
                grads.append((q.grad.to_local(), shard_copies[layout]))
            else:
                grads.append((q.grad, replicas(q, dims, partitioned=partitioned)))
    except (TypeError, ValueError) as exc:  # only some ranks may refuse (one pipeline stage's mesh)
        grads, refusal = [], exc
    device = grads[0][0].device if grads else (params[0][0].device if params else torch.device("cpu"))
    if uses_nccl() and device.type != "cuda":
        device = comm_device()
    total = global_norm(grads, p, dist.group.WORLD, device, refused=refusal is not None)
    if refusal is not None:  # after the all-reduce, so no rank is left waiting in it
        raise refusal
    scale_([g for g, _ in grads], float(max_norm), total, error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    return total
