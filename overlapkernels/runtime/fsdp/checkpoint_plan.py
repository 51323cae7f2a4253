"""What an fsdp checkpoint holds of a ShardedModule, planned alike on every rank of its group: its
units (names, sizes, parameter shapes), the optimizer state's layout per entry (sharded like the
masters, replicated, per rank, or a JSON value) and the buffers and frozen parameters outside the
units (replicated or per rank)."""
from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist

from .metadata_json import value_as_json


def _units(sharded) -> list:
    return [[u.name, u.numel] for u in sharded.saved_units]


def _unit_params(sharded) -> list:
    """Per unit, ``[name, shape]`` of each parameter in its flat buffer: a model whose units hold as
    many elements in other shapes (Linear(2, 3) for Linear(3, 2)) would otherwise load reshaped."""
    names = {}
    for name, p in sharded.module.named_parameters():
        names.setdefault(id(p), name)
    return [[[names.get(id(p), "?"), list(shape)] for p, shape in zip(u.params, u.shapes)] for u in sharded.saved_units]


def _units_by_index(sharded) -> dict:
    """Optimizer parameter index -> the unit whose master it is (the state-dict numbering runs
    through the param groups in order, which a custom optimizer factory may have rearranged)."""
    unit_of = {id(u.master): u for u in sharded.all_units}
    groups = sharded.optimizer.param_groups if sharded.optimizer is not None else ()  # (None: a frozen model)
    order = [p for group in groups for p in group["params"]]
    strays = [idx for idx, p in enumerate(order) if id(p) not in unit_of]
    if strays:
        raise ValueError(f"optimizer parameters {strays} are not units' masters: fsdp checkpoints hold only what "
                         "fsdp.shard gave the optimizer")
    return {idx: unit_of[id(p)] for idx, p in enumerate(order)}


def _agree(local: dict, group) -> dict:
    """``local``: {name: (digest, shape, dtype)} of this rank's tensors -> the plan entry of each,
    the same on every rank (collective): ``replicated`` where every rank holds the same bytes (saved
    once), else ``per_rank`` (saved per rank, reloadable only on as many ranks)."""
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, local, group=group)
    plan = {}
    for name, (digest, shape, dtype) in local.items():
        if all(other.get(name, (None,))[0] == digest for other in everyone):
            plan[name] = {"kind": "replicated", "dtype": dtype, "shape": shape}
        else:
            plan[name] = {"kind": "per_rank", "dtype": dtype,
                          "shapes": [other.get(name, (None, [0]))[1] for other in everyone]}
    return plan


def _layout(value: torch.Tensor) -> tuple[list, str]:
    """(shape, dtype name) as the checkpoint's meta file records them."""
    return list(value.shape), str(value.dtype).replace("torch.", "")


def _digest(value: torch.Tensor) -> tuple:
    raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(raw).hexdigest(), *_layout(value)


def _buffers(sharded) -> dict:
    """What the wrapped model's state_dict holds outside the units, by state-dict name, to be saved
    and loaded in place: its persistent buffers (BatchNorm statistics, step counters) and its frozen
    parameters (a backbone or embedding trained before, which fsdp leaves unsharded; once per
    tensor, however many modules share it). The metadata calls them all "buffers"."""
    found = {}
    for prefix, mod in sharded.module.named_modules():
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in mod._non_persistent_buffers_set:
                found[f"{prefix}.{name}" if prefix else name] = buf
    in_units = {id(p) for u in sharded.frozen_units for p in u.params}  # saved as the units' shards
    for name, p in sharded.module.named_parameters():
        if not p.requires_grad and id(p) not in in_units:
            found[name] = p.detach()  # shares the storage: dcp.load fills the parameter
    return found


def _plan_buffers(sharded) -> dict:
    return _agree({name: _digest(buf) for name, buf in _buffers(sharded).items()}, sharded.group)


def _plan_optim(sharded, optim_state) -> tuple:
    """(``{"idx/key": {"kind", "dtype", "shape" | "shapes"}}`` for every optimizer tensor, the same on
    every rank of the group (collective), and why it cannot be saved, or None):
      flat       floating, shaped like the unit's master shard (Adam's moments, momentum): sharded
                 like the master, so it reshards to any world size;
      replicated equal on every rank (Adam's 0-d step): saved once;
      per_rank   anything else (block-quantised statistics, per-shard preconditioners): kept per
                 rank, reloadable only on as many ranks;
      value      not a tensor (an optimizer that counts its steps in a python int): kept in the
                 metadata as JSON, once if every rank holds the same, else per rank (``values``,
                 and ``absent_on``: the ranks that do not hold it get no such key back).
    A value JSON cannot keep, or one with tensors inside (a list of history tensors would bloat the
    metadata and come back on the CPU), cannot be saved: ``save`` refuses on every rank of the world
    (another dp group may have no such value) before anything is written."""
    plan, local, values, units = {}, {}, {}, _units_by_index(sharded)
    for idx, entries in optim_state.items():
        unit = units[int(idx)]
        for key, value in entries.items():
            name = f"{idx}/{key}"
            if not torch.is_tensor(value):
                values[name] = value_as_json(name, value)
            elif value.shape == unit.master.shape and value.is_floating_point():
                plan[name] = {"kind": "flat", "dtype": _layout(value)[1]}
            else:
                local[name] = _digest(value)
    everyone = [None] * dist.get_world_size(sharded.group)
    dist.all_gather_object(everyone, values, group=sharded.group)
    problems = sorted({problem for other in everyone for _, problem in other.values() if problem})
    if problems:
        return {}, problems[0]
    for name in dict.fromkeys(name for other in everyone for name in other):  # the same plan on every rank
        texts = [other[name][0] if name in other else None for other in everyone]
        if all(text == texts[0] for text in texts):  # compared as JSON text: NaN equals NaN there
            plan[name] = {"kind": "value", "value": json.loads(texts[0])}
        else:
            plan[name] = {"kind": "value", "values": [None if t is None else json.loads(t) for t in texts],
                          "absent_on": [r for r, t in enumerate(texts) if t is None]}
    return {**plan, **_agree(local, sharded.group)}, None


def _optimizer_state(sharded) -> dict:
    """The optimizer's state_dict, or an empty one for a frozen model (no optimizer: shard_frozen)."""
    return sharded.optimizer.state_dict() if sharded.optimizer is not None else {"state": {}, "param_groups": []}
