"""Megatron's parameter tags, and the owning modules' memory of them by name.

Megatron tags a weight split over the TP group ``tensor_model_parallel`` (with ``partition_dim``):
gradient clipping counts it once per TP rank, not once per replica, and the dense state-dict
helpers gather it. A parameter whose gradient is partial per TP rank under sequence parallelism
is tagged ``sequence_parallel`` (see ``norm.py``). Wrappers that replace parameters, as torch's
FSDP2 ``fully_shard`` does with DTensors, drop attributes set on the old objects; a clip that then
counts a TP-split weight as a replica clips each TP rank by a different factor, and their
replicated weights drift apart silently. So the owning module also remembers the names, and
``remembered`` finds whatever object holds each name now. torch itself replaces Parameter objects
too - ``to_empty()`` after building on the meta device, ``.to()`` across device types,
``load_state_dict(assign=True)`` - and ``KeepsTags`` puts the tags back on the new ones
(``retag``): fsdp.shard reads them, and so does Megatron-style client code.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn

from .. import _compat

TENSOR_PARALLEL = "_tensor_parallel_params"  # on the owner: {parameter name: partition_dim}
SEQUENCE_PARALLEL = "_sequence_parallel_params"  # on the owner: {parameter name: TP group or None}
CONTEXT_PARALLEL = "_context_parallel_group"  # on a model: the CP group all its gradients are partial over
PIPELINE_STAGE = "_pipeline_stage"  # on a model built as one pipeline stage: (stage, num_stages)


def mark_tensor_parallel(param: nn.Parameter, partition_dim: int) -> None:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = 1


def remember_tensor_parallel(owner: nn.Module) -> None:
    """Remember by name every parameter ``owner`` holds directly that is tagged ``tensor_model_parallel``
    (call it once the layer has registered its parameters)."""
    memory = owner.__dict__.setdefault(TENSOR_PARALLEL, {})
    for name, param in owner.named_parameters(recurse=False):
        if getattr(param, "tensor_model_parallel", False):
            memory[name] = param.partition_dim


def remembered(module: nn.Module, key: str, sharded: dict | None = None) -> list:
    """``(parameter, value)`` for every name that ``module``'s modules remember under ``key``, in
    module order (the same on every rank). The parameter is the object that holds the gradient:
    the current one, or under FSDP2 its sharded parameter, also when the module holds the
    unsharded one (``set_reshard_after_backward(False)``). ``sharded``: ``_compat.fsdp2_sharded_params``
    of ``module`` when the caller already has it."""
    sharded = _compat.fsdp2_sharded_params(module) if sharded is None else sharded
    found = []
    for sub in module.modules():
        for name, value in sub.__dict__.get(key, {}).items():
            param = sharded.get((id(sub), name), sub._parameters.get(name))
            if param is not None:
                found.append((param, value))
    return found


def tensor_parallel_parameters(module: nn.Module, sharded: dict | None = None) -> list:
    """``(names, parameter, partition_dim)`` for every parameter of ``module`` once, in
    ``named_parameters`` order; ``names``: every name it has (several when tied); ``partition_dim``
    is None unless it is split over TP (by its tag, or by the name a module remembers, also when
    only one holder of a tied parameter remembers it). The parameter is the object that holds the
    gradient (see ``remembered``)."""
    sharded = _compat.fsdp2_sharded_params(module) if sharded is None else sharded
    split = {id(param): dim for param, dim in remembered(module, TENSOR_PARALLEL, sharded)}
    found = {}  # id -> (names, parameter): insertion order is named_parameters order
    for prefix, sub in module.named_modules(remove_duplicate=False):
        for name, param in sub._parameters.items():
            param = sharded.get((id(sub), name), param)
            if param is not None:
                names, _ = found.setdefault(id(param), ([], param))
                full = f"{prefix}.{name}" if prefix else name
                if full not in names:
                    names.append(full)
    def partition_dim(param):
        tagged = param.partition_dim if getattr(param, "tensor_model_parallel", False) else None
        return split.get(id(param), tagged)

    return [(names, param, partition_dim(param)) for names, param in found.values()]


def mark_context_parallel(model: nn.Module, cp_group) -> None:
    """Tag every parameter of ``model`` ``context_parallel_group``: under context parallelism each
    rank sees part of every sequence, so every gradient is partial over ``cp_group`` (fsdp.shard sums
    them there). Remembered on ``model``, so the tags survive the operations that replace Parameter
    objects (see ``retag``). The GPT calls it itself; call it on a model built from the layers with
    ``cp_group=``, once its parameters are registered."""
    import torch.distributed as dist

    if not isinstance(cp_group, dist.ProcessGroup):
        raise TypeError(f"cp_group={cp_group!r}: expected the torch.distributed ProcessGroup the model's attention "
                        f"runs context parallelism over, got {type(cp_group).__name__}")
    model.__dict__[CONTEXT_PARALLEL] = cp_group
    retag(model, recurse=False)


def retag(module: nn.Module, *, recurse: bool = True) -> None:
    """Put the remembered tags back on whatever Parameter objects ``module`` (and with ``recurse``
    its submodules) holds now."""
    for sub in module.modules() if recurse else (module,):
        memory = sub.__dict__
        for name, dim in memory.get(TENSOR_PARALLEL, {}).items():
            param = sub._parameters.get(name)
            if param is not None and not getattr(param, "tensor_model_parallel", False):
                mark_tensor_parallel(param, dim)
        for name, group in memory.get(SEQUENCE_PARALLEL, {}).items():
            param = sub._parameters.get(name)
            if param is not None:
                param.sequence_parallel = True
                if group is not None:
                    param.sequence_parallel_group = group
        if memory.get(CONTEXT_PARALLEL) is not None:
            for param in sub.parameters():
                param.context_parallel_group = memory[CONTEXT_PARALLEL]


class KeepsTags:
    """Mixin (before ``nn.Module``) for a module that tags its own parameters: the tags come back
    after the operations that put new Parameter objects in its place (``_apply`` serves
    ``to_empty``, ``to``, ``cuda``, ``half``...; ``_load_from_state_dict`` serves ``assign=True``)."""

    def _apply(self, fn, *args, **kwargs):
        out = super()._apply(fn, *args, **kwargs)
        retag(self, recurse=False)  # (the children's own _apply retag theirs)
        return out

    def _load_from_state_dict(self, *args, **kwargs):
        super()._load_from_state_dict(*args, **kwargs)
        retag(self, recurse=False)

    def __deepcopy__(self, memo):
        """``copy.deepcopy`` (an EMA copy, a frozen reference or teacher model) copies everything but
        the process groups, which the copy shares: they are handles to the job's communicators, and
        torch refuses to copy one ("cannot pickle ProcessGroup"), so the copy of any model holding
        our layers failed (megatron-core's layers fail alike)."""
        for group in _groups_in(self.__dict__, 0):
            memo.setdefault(id(group), group)
        for p in self._parameters.values():  # their tags, should a torch's Parameter copy its attributes
            for group in _groups_in(vars(p) if p is not None else {}, 0):
                memo.setdefault(id(group), group)
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        retag(new, recurse=False)  # torch's Parameter.__deepcopy__ drops the tags (attributes) it holds
        return new


def _groups_in(value, depth: int) -> list:
    """The process groups held in ``value`` (dicts, lists, tuples, objects' attributes; not in child
    modules, whose own ``__deepcopy__`` finds theirs, nor in tensors' data)."""
    if isinstance(value, dist.ProcessGroup):
        return [value]
    if depth > 4 or isinstance(value, (nn.Module, torch.Tensor, str, bytes, int, float, type(None))):
        return []
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple, set)) else \
        vars(value).values() if hasattr(value, "__dict__") and not isinstance(value, type) else ()
    return [g for item in items for g in _groups_in(item, depth + 1)]
