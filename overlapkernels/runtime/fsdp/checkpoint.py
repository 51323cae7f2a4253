"""Sharded, atomic, reshardable checkpoints of a ShardedModule through torch.distributed.checkpoint.

Each unit's flat master (and every optimizer tensor shaped like it) is saved as a DTensor over the
group: the logical, unpadded vector of ``numel`` elements, sharded along dim 0 with torch.chunk
semantics - exactly the units' layout (shard ``ceil(numel / W)``, padding only at the end). So no
rank gathers anything, and DCP reads the overlapping pieces back into any other world size: a job
saved on 8 ranks resumes on 4 or 16 (the model and unit split must be the same). Scalars (Adam's
step) are saved once, replicated.

One checkpoint per job: under TP/PP/CP x DP each dp group holds a different part of the model, so
``save`` and ``load`` are collectives over the whole world (every rank calls them with the same
path). The dp groups must partition the world; part k is the k-th group in order of its ranks -
the tp/pp/cp coordinate, unchanged when only the dp size changes - and its keys carry a
``part<k>/`` prefix (none when the group is the world, so such checkpoints read as before).

A save goes to ``<path>.tmp`` and is renamed into place by world rank 0 only after every rank has
finished; the previous checkpoint is moved aside first and deleted last, so a crash at any moment
leaves a loadable checkpoint (``load`` falls back to ``<path>.old``).
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


def _part(sharded) -> tuple[int, int]:
    """(index, count) of this rank's model part: its dp group among all of the world's (a world
    collective). Raises the same ValueError on every rank if the groups do not partition the world."""
    mine = tuple(sorted(dist.get_process_group_ranks(sharded.group)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = sorted(set(everyone))
    if sorted(r for g in groups for r in g) != list(range(dist.get_world_size())):
        raise ValueError(f"fsdp.save/load: the sharding groups of the ranks {groups} do not partition the world of "
                         f"{dist.get_world_size()} ranks; every rank must call with its own dp group")
    return groups.index(mine), len(groups)


def _state(sharded, optim_state, plan, prefix) -> dict:
    mesh, rank, units = _mesh(sharded), dist.get_rank(sharded.group), _units_by_index(sharded)
    state = {f"{prefix}unit{i}/master": _logical(u.master.data, u, mesh) for i, u in enumerate(sharded.all_units)}
    for idx, entries in optim_state.items():
        for key, value in entries.items():
            if not torch.is_tensor(value):
                continue
            kind = plan[f"{idx}/{key}"]["kind"]
            if kind == "flat":
                state[f"{prefix}optim/{idx}/{key}"] = _logical(value, units[int(idx)], mesh)
            elif kind == "replicated":
                state[f"{prefix}optim/{idx}/{key}"] = value
            else:
                state[f"{prefix}rank{rank}/optim/{idx}/{key}"] = value
    return state


def _prefix(part: int, parts: int) -> str:
    return "" if parts == 1 else f"part{part}/"


def save(sharded, path) -> None:
    """Write a checkpoint of ``sharded`` (a collective over the world: every rank calls it, with the
    same path)."""
    path = os.fspath(path)
    tmp, old = path + ".tmp", path + ".old"
    part, parts = _part(sharded)
    rank = dist.get_rank()
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # leftovers of an interrupted save
    optim = sharded.optimizer.state_dict()
    plan = _plan_optim(sharded, optim["state"])
    mine = {"world_size": dist.get_world_size(sharded.group), "stage": sharded.stage, "units": _units(sharded),
            "param_groups": optim["param_groups"], "optim": plan}
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (part, mine))
    by_part = dict(everyone)  # every rank of a part has the same entry
    meta = {"format": FORMAT, **mine} if parts == 1 else {"format": FORMAT, "parts": [by_part[k] for k in range(parts)]}
    dist.barrier()
    dcp.save(_state(sharded, optim["state"], plan, _prefix(part, parts)), checkpoint_id=tmp)
    if rank == 0:
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)
    dist.barrier()  # every shard is on disk before the switch
    if rank == 0:
        if os.path.exists(path):
            if os.path.exists(old):  # a crash after the last switch left both: path is the newer
                shutil.rmtree(old)
            os.replace(path, old)
        # (path missing and old present: a crash between the two renames - old is the one to keep)
        os.replace(tmp, path)
        if os.path.exists(old):
            shutil.rmtree(old)
    dist.barrier()


def _check(sharded, path, meta, part, parts) -> str | None:
    """Why this rank cannot load ``meta`` (None if it can)."""
    if meta.get("format") != FORMAT:
        return f"checkpoint {path!r} has format {meta.get('format', 1)}; this version reads format {FORMAT}"
    saved_parts = len(meta.get("parts", [meta]))
    if saved_parts != parts:
        return (f"checkpoint {path!r} holds {saved_parts} model parts (one per tp/pp/cp coordinate); this job has "
                f"{parts}: only the dp size may change")
    mine = meta["parts"][part] if "parts" in meta else meta
    if mine["units"] != _units(sharded):
        return f"checkpoint {path!r} holds units {mine['units']} ([name, numel]); this model has {_units(sharded)}"
    world = dist.get_world_size(sharded.group)
    per_rank = sorted(name for name, entry in mine["optim"].items() if entry["kind"] == "per_rank")
    if per_rank and mine["world_size"] != world:
        return (f"checkpoint {path!r}: optimizer state {per_rank} differs between ranks and is not shaped like the "
                f"parameter shards, so it reloads only on {mine['world_size']} ranks, not {world}")
    return None


def load(sharded, path) -> None:
    """Restore parameters and optimizer state saved by ``save`` (same model, unit split and
    tp/pp/cp layout; any dp size). A collective over the world, like ``save``."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, META)) and os.path.exists(os.path.join(path + ".old", META)):
        path += ".old"  # a save was interrupted between its two renames
    meta_file = os.path.join(path, META)
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"no overlapkernels FSDP checkpoint at {path!r}")
    with open(meta_file) as f:
        meta = json.load(f)
    part, parts = _part(sharded)
    # decided together: a part that cannot load must not leave the others waiting inside dcp.load
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, _check(sharded, path, meta, part, parts))
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ValueError(problem)
    meta = meta["parts"][part] if "parts" in meta else meta
    rank = dist.get_rank(sharded.group)
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
    dcp.load(_state(sharded, template, meta["optim"], _prefix(part, parts)), checkpoint_id=path)
    for unit in sharded.all_units:  # the padding past numel is not in the checkpoint: zeros
        unit.master.data[_valid(unit):].zero_()
    sharded.optimizer.load_state_dict({"state": template, "param_groups": meta["param_groups"]})
    for unit in sharded.all_units:
        if unit.gathered:
            unit.publish()
