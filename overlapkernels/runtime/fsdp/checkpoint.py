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

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

META = "overlapkernels_fsdp.json"
FORMAT = 2  # 1 (per-rank keys, same world size only) was never released: not readable


def _meta(sharded) -> dict:
    optim = sharded.optimizer.state_dict()
    return {"format": FORMAT, "world_size": dist.get_world_size(sharded.group), "stage": sharded.stage,
            "units": [[u.name, u.numel] for u in sharded.all_units],
            "param_groups": optim["param_groups"],
            # optimizer tensors: "flat" (shaped like their unit's master shard) or a full shape, and a
            # dtype - to rebuild the state in a fresh optimizer at any world size
            "optim": {str(idx): {k: ["flat" if _is_flat(v, sharded, idx) else list(v.shape),
                                     str(v.dtype).replace("torch.", "")]
                                 for k, v in entries.items() if torch.is_tensor(v)}
                      for idx, entries in optim["state"].items()}}


def _unit_at(sharded, idx):
    """The unit whose master is the optimizer's parameter ``idx`` (its state-dict numbering runs
    through the param groups in order, which a custom optimizer factory may have rearranged)."""
    order = [p for group in sharded.optimizer.param_groups for p in group["params"]]
    master = order[int(idx)]
    return next(u for u in sharded.all_units if u.master is master)


def _is_flat(value, sharded, idx) -> bool:
    """Shaped like its unit's master shard (Adam's moments, momentum): sharded like the master.
    Anything else (Adam's 0-d step) is the same on every rank and saved once."""
    return value.shape == _unit_at(sharded, idx).master.shape


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


def _state(sharded, optim_state) -> dict:
    mesh = _mesh(sharded)
    state = {f"unit{i}/master": _logical(u.master.data, u, mesh) for i, u in enumerate(sharded.all_units)}
    for idx, entries in optim_state.items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                state[f"optim/{idx}/{key}"] = (_logical(value, _unit_at(sharded, idx), mesh)
                                               if _is_flat(value, sharded, idx) else value)
    return state


def save(sharded, path) -> None:
    """Write a checkpoint of ``sharded`` (a collective: every rank of its group calls it)."""
    path = os.fspath(path)
    tmp, old = path + ".tmp", path + ".old"
    rank = dist.get_rank(sharded.group)
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # leftovers of an interrupted save
    dist.barrier(group=sharded.group)
    dcp.save(_state(sharded, sharded.optimizer.state_dict()["state"]), checkpoint_id=tmp, process_group=sharded.group)
    if rank == 0:
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(_meta(sharded), f)
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
    mine = _meta(sharded)
    if meta["units"] != mine["units"]:
        raise ValueError(f"checkpoint {path!r} holds units {meta['units']} ([name, numel]); this model has "
                         f"{mine['units']}")
    device = sharded.all_units[0].device
    template = {}
    for idx, entries in meta["optim"].items():
        template[int(idx)] = {}
        for key, (shape, dtype) in entries.items():
            if shape == "flat":
                shape = [_unit_at(sharded, idx).shard_numel]
            # torch keeps Adam's step (a scalar) on the CPU
            template[int(idx)][key] = torch.zeros(shape, dtype=getattr(torch, dtype), device=device if shape else "cpu")
    dcp.load(_state(sharded, template), checkpoint_id=path, process_group=sharded.group)
    for unit in sharded.all_units:  # the padding past numel is not in the checkpoint: zeros
        unit.master.data[_valid(unit):].zero_()
    sharded.optimizer.load_state_dict({"state": template, "param_groups": meta["param_groups"]})
    for unit in sharded.all_units:
        if unit.gathered:
            unit.publish()
