"""Sharded, atomic checkpoints of a ShardedModule through torch.distributed.checkpoint.

Each rank writes its master shards and optimizer state under its own keys (``rank{r}/...``), so no
rank gathers anything. A save goes to ``<path>.tmp`` and is renamed into place by rank 0 only after
every rank has finished; the previous checkpoint is moved aside first and deleted last, so a crash
at any moment leaves a loadable checkpoint (``load`` falls back to ``<path>.old``).
"""
from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

META = "overlapkernels_fsdp.json"


def _meta(sharded) -> dict:
    optim = sharded.optimizer.state_dict()
    return {"world_size": dist.get_world_size(sharded.group), "stage": sharded.stage,
            "units": [[u.name, u.numel, u.shard_numel] for u in sharded.all_units],
            "param_groups": optim["param_groups"],
            # shapes and dtypes of the optimizer state, to rebuild it in a fresh optimizer
            "optim": {str(idx): {k: [list(v.shape), str(v.dtype).replace("torch.", "")]
                                 for k, v in entries.items() if torch.is_tensor(v)}
                      for idx, entries in optim["state"].items()}}


def _state(sharded, optim_template=None) -> dict:
    rank = dist.get_rank(sharded.group)
    state = {f"rank{rank}/unit{i}/master": u.master.data for i, u in enumerate(sharded.all_units)}
    optim = optim_template if optim_template is not None else sharded.optimizer.state_dict()["state"]
    for idx, entries in optim.items():
        for key, value in entries.items():
            if torch.is_tensor(value):
                state[f"rank{rank}/optim/{idx}/{key}"] = value
    return state


def save(sharded, path) -> None:
    """Write a checkpoint of ``sharded`` (a collective: every rank of its group calls it)."""
    path = os.fspath(path)
    tmp, old = path + ".tmp", path + ".old"
    rank = dist.get_rank(sharded.group)
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # leftovers of an interrupted save
    dist.barrier(group=sharded.group)
    dcp.save(_state(sharded), checkpoint_id=tmp, process_group=sharded.group)
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
    """Restore parameters and optimizer state saved by ``save`` (same world size, same model)."""
    path = os.fspath(path)
    if not os.path.exists(os.path.join(path, META)) and os.path.exists(os.path.join(path + ".old", META)):
        path += ".old"  # a save was interrupted between its two renames
    meta_file = os.path.join(path, META)
    if not os.path.exists(meta_file):
        raise FileNotFoundError(f"no overlapkernels FSDP checkpoint at {path!r}")
    with open(meta_file) as f:
        meta = json.load(f)
    mine = _meta(sharded)
    if meta["world_size"] != mine["world_size"]:
        raise ValueError(f"checkpoint {path!r} was saved by {meta['world_size']} ranks, this group has "
                         f"{mine['world_size']}")
    if meta["units"] != mine["units"]:
        raise ValueError(f"checkpoint {path!r} holds units {meta['units']} ([name, numel, shard numel]); this model "
                         f"has {mine['units']}")
    device = sharded.all_units[0].device
    template = {int(idx): {k: torch.zeros(shape, dtype=getattr(torch, dtype),
                                          device=device if shape else "cpu")  # torch keeps Adam's step on CPU
                           for k, (shape, dtype) in entries.items()}
                for idx, entries in meta["optim"].items()}
    state = _state(sharded, template)
    dcp.load(state, checkpoint_id=path, process_group=sharded.group)
    sharded.optimizer.load_state_dict({"state": template, "param_groups": meta["param_groups"]})
    for unit in sharded.all_units:
        if unit.gathered:
            unit.publish()
