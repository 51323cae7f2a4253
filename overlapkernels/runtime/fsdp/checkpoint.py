"""Sharded, atomic, reshardable checkpoints of a ShardedModule through torch.distributed.checkpoint.

Each unit's flat master (and every optimizer tensor shaped like it) is saved as a DTensor over the
group: the logical, unpadded vector of ``numel`` elements, sharded along dim 0 with torch.chunk
semantics - exactly the units' layout (shard ``ceil(numel / W)``, padding only at the end). So no
rank gathers anything, and DCP reads the overlapping pieces back into any other world size: a job
saved on 8 ranks resumes on 4 or 16 (the model and unit split must be the same). Scalars (Adam's
step) are saved once, replicated. A save goes to ``<path>.tmp`` and is renamed into place by rank 0
only after every rank has finished; the previous checkpoint is moved aside first and deleted last,
so a crash at any moment leaves a loadable checkpoint (``load`` falls back to ``<path>.old``).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

META = "overlapkernels_fsdp.json"
FORMAT = 2  # 1 (per-rank keys, same world size only) was never released: not readable


def _units(sharded) -> list:
    return [[u.name, u.numel] for u in sharded.all_units]


def _units_by_index(sharded) -> dict:
    """Optimizer parameter index -> the unit whose master it is (the state-dict numbering runs
    through the param groups in order, which a custom optimizer factory may have rearranged)."""
    unit_of = {id(u.master): u for u in sharded.all_units}
    order = [p for group in sharded.optimizer.param_groups for p in group["params"]]
    strays = [idx for idx, p in enumerate(order) if id(p) not in unit_of]
    if strays:
        raise ValueError(f"optimizer parameters {strays} are not units' masters: fsdp checkpoints hold only what "
                         "fsdp.shard gave the optimizer")
    return {idx: unit_of[id(p)] for idx, p in enumerate(order)}


def _plan_optim(sharded, optim_state) -> dict:
    """``{"idx/key": {"kind", "dtype", "shape" | "shapes"}}`` for every optimizer tensor, the same on
    every rank (collective):
      flat       floating, shaped like the unit's master shard (Adam's moments, momentum): sharded
                 like the master, so it reshards to any world size;
      replicated equal on every rank (Adam's 0-d step): saved once;
      per_rank   anything else (block-quantised statistics, per-shard preconditioners): kept per
                 rank, reloadable only on as many ranks."""
    plan, local, units = {}, {}, _units_by_index(sharded)
    for idx, entries in optim_state.items():
        unit = units[int(idx)]
        for key, value in entries.items():
            if not torch.is_tensor(value):
                continue
            name, dtype = f"{idx}/{key}", str(value.dtype).replace("torch.", "")
            if value.shape == unit.master.shape and value.is_floating_point():
                plan[name] = {"kind": "flat", "dtype": dtype}
            else:
                raw = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                local[name] = (hashlib.sha256(raw).hexdigest(), list(value.shape), dtype)
    everyone = [None] * dist.get_world_size(sharded.group)
    dist.all_gather_object(everyone, local, group=sharded.group)
    for name, (digest, shape, dtype) in local.items():
        if all(other.get(name, (None,))[0] == digest for other in everyone):
            plan[name] = {"kind": "replicated", "dtype": dtype, "shape": shape}
        else:
            plan[name] = {"kind": "per_rank", "dtype": dtype,
                          "shapes": [other.get(name, (None, [0]))[1] for other in everyone]}
    return plan


def _mesh(sharded):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(sharded.group, sharded.all_units[0].device.type)


def _valid(unit) -> int:
    """Elements of this rank's shard inside the unit (the rest is padding)."""
    return max(0, min(unit.shard_numel, unit.numel - unit.rank * unit.shard_numel))


def _logical(local_shard: torch.Tensor, unit, mesh):
    """The unit's unpadded flat vector as a DTensor whose local part is a view of ``local_shard``
    (DCP loads in place, through the view)."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local_shard[:_valid(unit)], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([unit.numel]), stride=(1,))


def _state(sharded, optim_state, plan) -> dict:
    mesh, rank, units = _mesh(sharded), dist.get_rank(sharded.group), _units_by_index(sharded)
    state = {f"unit{i}/master": _logical(u.master.data, u, mesh) for i, u in enumerate(sharded.all_units)}
    for idx, entries in optim_state.items():
        for key, value in entries.items():
            if not torch.is_tensor(value):
                continue
            kind = plan[f"{idx}/{key}"]["kind"]
            if kind == "flat":
                state[f"optim/{idx}/{key}"] = _logical(value, units[int(idx)], mesh)
            elif kind == "replicated":
                state[f"optim/{idx}/{key}"] = value
            else:
                state[f"rank{rank}/optim/{idx}/{key}"] = value
    return state


def save(sharded, path) -> None:
    """Write a checkpoint of ``sharded`` (a collective: every rank of its group calls it)."""
    path = os.fspath(path)
    tmp, old = path + ".tmp", path + ".old"
    rank = dist.get_rank(sharded.group)
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # leftovers of an interrupted save
    optim = sharded.optimizer.state_dict()
    plan = _plan_optim(sharded, optim["state"])
    meta = {"format": FORMAT, "world_size": dist.get_world_size(sharded.group), "stage": sharded.stage,
            "units": _units(sharded), "param_groups": optim["param_groups"], "optim": plan}
    dist.barrier(group=sharded.group)
    dcp.save(_state(sharded, optim["state"], plan), checkpoint_id=tmp, process_group=sharded.group)
    if rank == 0:
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)
    dist.barrier(group=sharded.group)  # every shard is on disk before the switch
    if rank == 0:
        if os.path.exists(path):
            if os.path.exists(old):  # a crash after the last switch left both: path is the newer
                shutil.rmtree(old)
            os.replace(path, old)
        # (path missing and old present: a crash between the two renames - old is the one to keep)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    dist.barrier(group=sharded.group)


def load(sharded, path) -> None:
    """Restore parameters and optimizer state saved by ``save`` (same model and unit split; any
    world size for checkpoints of this version)."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, META)) and os.path.exists(os.path.join(path + ".old", META)):
        path += ".old"  # a save was interrupted between its two renames
    meta_file = os.path.join(path, META)
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"no overlapkernels FSDP checkpoint at {path!r}")
    with open(meta_file) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {path!r} has format {meta.get('format', 1)}; this version reads format {FORMAT}")
    if meta["units"] != _units(sharded):
        raise ValueError(f"checkpoint {path!r} holds units {meta['units']} ([name, numel]); this model has "
                         f"{_units(sharded)}")
    world, rank = dist.get_world_size(sharded.group), dist.get_rank(sharded.group)
    per_rank = sorted(name for name, entry in meta["optim"].items() if entry["kind"] == "per_rank")
    if per_rank and meta["world_size"] != world:
        raise ValueError(f"checkpoint {path!r}: optimizer state {per_rank} differs between ranks and is not shaped "
                         f"like the parameter shards, so it reloads only on {meta['world_size']} ranks, not {world}")
    device = sharded.all_units[0].device
    template, units = {}, _units_by_index(sharded)
    for name, entry in meta["optim"].items():  # what was saved decides the layout, not the shapes now
        idx, key = name.split("/", 1)
        if entry["kind"] == "flat":
            shape = [units[int(idx)].shard_numel]
        else:
            shape = entry["shape"] if entry["kind"] == "replicated" else entry["shapes"][rank]
        # torch keeps Adam's step (a scalar) on the CPU
        template.setdefault(int(idx), {})[key] = torch.zeros(shape, dtype=getattr(torch, entry["dtype"]),
                                                             device=device if shape else "cpu")
    dcp.load(_state(sharded, template, meta["optim"]), checkpoint_id=path, process_group=sharded.group)
    for unit in sharded.all_units:  # the padding past numel is not in the checkpoint: zeros
        unit.master.data[_valid(unit):].zero_()
    sharded.optimizer.load_state_dict({"state": template, "param_groups": meta["param_groups"]})
    for unit in sharded.all_units:
        if unit.gathered:
            unit.publish()
