"""Sharded, atomic, reshardable checkpoints of a ShardedModule through torch.distributed.checkpoint.

Each unit's flat master (and every optimizer tensor shaped like it) is saved as a DTensor over the
group: the logical, unpadded vector of ``numel`` elements, sharded along dim 0 with torch.chunk
semantics - exactly the units' layout (shard ``ceil(numel / W)``, padding only at the end). So no
rank gathers anything, and DCP reads the overlapping pieces back into any other world size: a job
saved on 8 ranks resumes on 4 or 16 (the model and unit split must be the same). Scalars (Adam's
step) are saved once, replicated; optimizer state that is not a tensor (a step count in a python
int) goes into the metadata.

One checkpoint per job: under TP/PP/CP x DP each dp group holds a different part of the model, so
``save`` and ``load`` are collectives over the whole world (every rank calls them with the same
path). The dp groups must partition the world; part k is the k-th group in order of its ranks -
the tp/pp/cp coordinate, unchanged when only the dp size changes - and its keys carry a
``part<k>/`` prefix (none when the group is the world, so such checkpoints read as before). A rank
holding several chunks (an interleaved pipeline's) saves them together: chunk c of dp group k is
part k x chunks + c (format 4). What is planned per module: checkpoint_plan.py.

A save goes to ``<path>.tmp`` and is renamed into place by world rank 0 only after every rank has
finished; the previous checkpoint is moved aside first and deleted last, so a crash at any moment
leaves a loadable checkpoint (``load`` falls back to ``<path>.old``). A failure in rank 0's part of
that (a full disk) raises on every rank. The model's persistent buffers (BatchNorm statistics,
counters) and frozen parameters (not in any unit) are saved too: once when the ranks agree, else
per rank (then same world size only).
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ...comm.process_world import check_pending_errors_together
from .checkpoint_files import META, _every_rank_sees, _find, _on_rank0_for_all, _sees, _switch
from .checkpoint_plan import (_buffers, _layout, _optimizer_state, _plan_buffers, _plan_optim, _unit_params, _units,
                              _units_by_index)
from .metadata_json import canonical_extra, extra_problem, json_groups, tensor_groups

FORMAT = 2  # 1 (per-rank keys, same world size only) was never released: not readable
FORMAT_WITH_VALUES = 3  # adds "value" entries: optimizer state that is not a tensor, kept in the metadata
# a rank's chunks as parts of their own (part dp_group x chunks + chunk): a reader that did not know
# chunks would take part k for the k-th dp group's, and could load another stage's weights
FORMAT_WITH_CHUNKS = 4
READABLE_FORMATS = (FORMAT, FORMAT_WITH_VALUES, FORMAT_WITH_CHUNKS)


def _device(sharded) -> torch.device:
    return sharded.saved_units[0].device  # (a frozen model has frozen units only)


def _mesh(sharded):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(sharded.group, _device(sharded).type)


def _valid(unit) -> int:
    """Elements of this rank's shard inside the unit (the rest is padding)."""
    return max(0, min(unit.shard_numel, unit.numel - unit.rank * unit.shard_numel))


def _logical(local_shard: torch.Tensor, unit, mesh):
    """The unit's unpadded flat vector as a DTensor whose local part is a view of ``local_shard``
    (DCP loads in place, through the view)."""
    from torch.distributed.tensor import DTensor, Shard

    return DTensor.from_local(local_shard[:_valid(unit)], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([unit.numel]), stride=(1,))


def _part(chunks: list, op: str) -> tuple[int, int]:
    """(index, count) of this rank's model part: its dp group among all of the world's (a world
    collective, before any of the chunks' groups' own). Raises the same ValueError on every rank if
    the groups do not partition the world, a rank's chunks span several groups, or the ranks pass
    different numbers of chunks."""
    groups = sorted({tuple(sorted(dist.get_process_group_ranks(chunk.group))) for chunk in chunks})
    problem = (f"the chunks are sharded over different groups {groups}; one checkpoint holds a rank's chunks of "
               "one dp group" if len(groups) > 1 else None)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (groups[0], len(chunks), problem))
    refused = next((f"rank {r}: {p}" for r, (_, _, p) in enumerate(everyone) if p is not None), None)
    if refused is not None:
        raise ValueError(f"fsdp.{op}: {refused}")
    if len(set(counts := [n for _, n, _ in everyone])) > 1:
        raise ValueError(f"fsdp.{op}: every rank must pass as many chunks; got {counts} (by rank)")
    groups = sorted({g for g, _, _ in everyone})
    if sorted(r for g in groups for r in g) != list(range(dist.get_world_size())):
        raise ValueError(f"fsdp.save/load: the sharding groups of the ranks {groups} do not partition the world of "
                         f"{dist.get_world_size()} ranks; every rank must call with its own dp group")
    return groups.index(everyone[dist.get_rank()][0]), len(groups)


def _state(sharded, optim_state, plan, prefix, buffer_plan) -> dict:
    mesh, rank, units = _mesh(sharded), dist.get_rank(sharded.group), _units_by_index(sharded)
    # trained units' masters, then (stage 3, shard_frozen) the frozen units' shards, alike
    state = {f"{prefix}unit{i}/master": _logical(u.master.data, u, mesh) for i, u in enumerate(sharded.saved_units)}
    buffers = _buffers(sharded)  # loaded in place, like the masters
    for name, entry in buffer_plan.items():
        key = f"buffers/{name}" if entry["kind"] == "replicated" else f"rank{rank}/buffers/{name}"
        state[prefix + key] = buffers[name]
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


@contextlib.contextmanager
def _dcp_errors_as_runtime_errors(op: str, what: str):
    """DCP reports a failure on any rank to every rank as a CheckpointException, which derives from
    BaseException: a caller's ``except Exception`` (a trainer's retry, a job's error handler) would
    not see it. Raised again as a RuntimeError naming the op, the DCP error chained."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(f"{op}: {what} failed: {exc}") from exc


def _prefix(part: int, parts: int) -> str:
    return "" if parts == 1 else f"part{part}/"


def _chunks(sharded, op: str) -> list:
    """``sharded`` (a ShardedModule, or a list of them over one group: an interleaved pipeline
    rank's chunks, saved in one checkpoint) as a list. Refused here: what is no ShardedModule (a
    caller's mistake on every rank: there may be no process group at all); ``_part`` checks the rest
    together."""
    from .sharded import ShardedModule  # (sharded.py imports this file's helpers indirectly)

    chunks = list(sharded) if isinstance(sharded, (list, tuple)) and len(sharded) else [sharded]
    for i, chunk in enumerate(chunks):
        if not isinstance(getattr(chunk, "_orig_mod", chunk), ShardedModule):  # (torch.compile's wrapper: fine)
            where = f" (chunks[{i}])" if chunk is not sharded else ""
            raise TypeError(f"fsdp.{op}: expected a ShardedModule (from fsdp.shard), got {type(chunk).__name__}{where}")
    return chunks


def save(sharded, path, *, extra: dict | None = None) -> None:
    """Write a checkpoint of ``sharded`` (a collective over the world: every rank calls it, with the
    same path). ``sharded``: a ShardedModule, or a list of them - an interleaved pipeline rank's
    chunks, kept in one checkpoint, replaced atomically together. ``extra``: a dict of JSON values
    (a trainer's step count, its loss scaler's state), the same on every rank, kept with the
    checkpoint and returned by ``load``."""
    chunks = _chunks(sharded, "save")
    path = os.path.normpath(os.fspath(path))  # "ckpt/" would put its own temp folder inside it
    tmp, old = path + ".tmp", path + ".old"
    part, parts = _part(chunks, "save")
    # a symm/fused call whose device wait timed out computed garbage (its error is raised a call
    # late): never into a checkpoint, on any rank
    check_pending_errors_together(dist.group.WORLD, "fsdp.save", _device(chunks[0]))
    # leftovers of an interrupted save
    _on_rank0_for_all(lambda: os.path.exists(tmp) and shutil.rmtree(tmp), f"clearing {tmp!r}")
    plans, problem = [], None  # per chunk: (optimizer state, its plan, the buffers' plan)
    for chunk in chunks:
        optim = _optimizer_state(chunk)
        (plan, chunk_problem), buffer_plan = _plan_optim(chunk, optim["state"]), _plan_buffers(chunk)
        plans.append((optim, plan, buffer_plan))
        problem = problem or chunk_problem
    mine = [{"world_size": dist.get_world_size(chunk.group), "stage": chunk.stage, "units": _units(chunk),
             "unit_params": _unit_params(chunk), "param_groups": json_groups(optim["param_groups"]), "optim": plan,
             "buffers": buffer_plan} for chunk, (optim, plan, buffer_plan) in zip(chunks, plans)]
    everyone = [None] * dist.get_world_size()
    extra_refused = extra_problem(extra)
    dist.all_gather_object(everyone, (part, mine, problem, path, extra_refused,
                                      None if extra_refused else canonical_extra(extra)))
    # (a per-rank timestamp in the name: rank 0 switched its own folder in, the others' shards went
    # elsewhere, and the previous checkpoint was deleted before anyone noticed)
    if len(set(paths := [e[3] for e in everyone])) > 1:
        raise ValueError(f"fsdp.save: every rank must pass the same path; got {paths} (by rank)")
    problem = next((e[2] for e in everyone if e[2] is not None), None)
    if problem is not None:  # every rank of the world refuses alike, before any shard is written
        raise TypeError(f"fsdp.save: {problem}")
    extra_refused = next((f"rank {r}'s {e[4]}" for r, e in enumerate(everyone) if e[4] is not None), None)
    if extra_refused is not None:
        raise TypeError(f"fsdp.save: {extra_refused}")
    if any(e[5] != everyone[0][5] for e in everyone):  # one copy is kept: it must be everyone's
        differ = [r for r, e in enumerate(everyone) if e[5] != everyone[0][5]]
        raise ValueError(f"fsdp.save: extra must be the same on every rank; ranks {differ} passed another than "
                         f"rank 0's {everyone[0][5]}")
    # a model part per dp group and chunk; every rank of a dp group has the same entries
    v = len(chunks)
    by_part = {}
    for r, (p, entries, *_) in enumerate(everyone):
        for c, entry in enumerate(entries):
            kept = by_part.setdefault(p * v + c, entry)
            if kept["units"] != entry["units"]:  # (every rank, alike: one gathered view)
                raise ValueError(f"fsdp.save: rank {r}'s chunk {c} holds other units than its dp group's others' "
                                 f"chunk {c}: every rank of a dp group must pass the same chunks in the same order")
    # format 3 only where it is needed: older versions still read the rest and refuse these by format
    holds_values = any(e["kind"] == "value" for entry in by_part.values() for e in entry["optim"].values())
    version = FORMAT_WITH_CHUNKS if len(chunks) > 1 else FORMAT_WITH_VALUES if holds_values else FORMAT
    total = parts * v
    meta = ({"format": version, **mine[0]} if total == 1 else
            {"format": version, "parts": [by_part[k] for k in range(total)]})
    if v > 1:
        meta["chunks"] = v
    if extra is not None:  # (a key older versions ignore)
        meta["extra"] = extra
    try:  # the same on every rank: refused by all before any shard is written, not after
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"fsdp.save: the optimizer's param_groups hold a value the checkpoint cannot keep ({exc}); "
                        "use numbers, strings, bools, None, tensors or lists of them") from None
    state = {}
    for c, (chunk, (optim, plan, buffer_plan)) in enumerate(zip(chunks, plans)):
        state.update(_state(chunk, optim["state"], plan, _prefix(part * v + c, total), buffer_plan))
    dist.barrier()
    with _dcp_errors_as_runtime_errors("fsdp.save", f"writing {tmp!r}"):
        dcp.save(state, checkpoint_id=tmp)

    def write_meta():
        with open(os.path.join(tmp, META), "w") as f:
            json.dump(meta, f)

    # every shard is on disk before the switch: dcp.save returns on every rank only then
    _on_rank0_for_all(write_meta, f"writing {os.path.join(tmp, META)!r}")
    try:  # before the switch deletes the previous checkpoint: storage not shared by every rank keeps
        _every_rank_sees(tmp, "fsdp.save")  # each one's shards in a folder of its own
    except RuntimeError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _on_rank0_for_all(lambda: _switch(tmp, path, old), f"moving {tmp!r} to {path!r}")
    _every_rank_sees(path, "fsdp.save")


def _check(sharded, path, meta, part, parts) -> str | None:
    """Why this rank cannot load ``meta`` (None if it can)."""
    if meta.get("format") not in READABLE_FORMATS:
        return (f"checkpoint {path!r} has format {meta.get('format', 1)}; this version reads formats "
                f"{list(READABLE_FORMATS)}")
    saved_parts = len(meta.get("parts", [meta]))
    if saved_parts != parts:
        return (f"checkpoint {path!r} holds {saved_parts} model parts (one per tp/pp/cp coordinate and chunk); this "
                f"job has {parts}: only the dp size may change")
    mine = meta["parts"][part] if "parts" in meta else meta
    if mine["units"] != _units(sharded):
        frozen = [any("#frozen" in name for name, _ in units) for units in (mine["units"], _units(sharded))]
        hint = ("; one was sharded with shard_frozen=True and the other without: shard the same way to load"
                if frozen[0] != frozen[1] else "")
        if frozen[1] and sharded.optimizer is None and not frozen[0]:  # a trained model's, into a frozen one
            hint = ("; a frozen model (a reference, a teacher) takes a trained model's weights before it is sharded: "
                    "fsdp.load the checkpoint into the trained model's ShardedModule, and load_state_dict its "
                    "full_state_dict() into the frozen model before fsdp.shard")
        return (f"checkpoint {path!r} holds units {mine['units']} ([name, numel]); this model has "
                f"{_units(sharded)}{hint}")
    if "unit_params" in mine:  # (checkpoints written before 2026-11-30 hold numels only)
        for unit, saved, have in zip(sharded.saved_units, mine["unit_params"], _unit_params(sharded)):
            # shapes decide; names only help the message (a wrapper - activation checkpointing,
            # torch.compile - renames parameters without changing the flat layout)
            if [shape for _, shape in saved] != [shape for _, shape in have]:
                return (f"checkpoint {path!r}: unit {unit.name!r} holds parameters {saved} ([name, shape]); this "
                        f"model has {have}")
    world = dist.get_world_size(sharded.group)
    per_rank = sorted(name for name, entry in mine["optim"].items()
                      if entry["kind"] == "per_rank" or (entry["kind"] == "value" and "values" in entry))
    if per_rank and mine["world_size"] != world:
        return (f"checkpoint {path!r}: optimizer state {per_rank} differs between ranks and is not shaped like the "
                f"parameter shards, so it reloads only on {mine['world_size']} ranks, not {world}")
    saved, have = mine.get("buffers", {}), {name: _layout(buf) for name, buf in _buffers(sharded).items()}
    if "buffers" in mine and sorted(saved) != sorted(have):
        return (f"checkpoint {path!r} holds buffers and frozen parameters {sorted(saved)}; this model has "
                f"{sorted(have)}")
    per_rank = sorted(name for name, entry in saved.items() if entry["kind"] == "per_rank")
    if per_rank and mine["world_size"] != world:
        return (f"checkpoint {path!r}: buffers {per_rank} differ between the ranks that saved it (e.g. BatchNorm "
                f"statistics without SyncBatchNorm), so they reload only on {mine['world_size']} ranks, not {world}")
    rank = dist.get_rank(sharded.group)
    for name, entry in saved.items():
        shape = entry["shape"] if entry["kind"] == "replicated" else entry["shapes"][rank]
        if [shape, entry["dtype"]] != list(have[name]):
            return (f"checkpoint {path!r}: buffer {name} was saved as {entry['dtype']} {shape}; this model's is "
                    f"{have[name][1]} {have[name][0]}")
    return None


def load(sharded, path) -> dict:
    """Restore parameters and optimizer state saved by ``save`` (same model, unit split, tp/pp/cp
    layout and chunks; any dp size). A collective over the world, like ``save``. Returns the
    ``extra`` dict saved with it ({} if none)."""
    chunks = _chunks(sharded, "load")
    path = os.path.normpath(os.fspath(path))
    part, parts = _part(chunks, "load")
    v = len(chunks)
    total = parts * v
    # rank 0 picks the checkpoint and reads its metadata for everyone: ranks deciding alone could
    # pick different ones (path or path.old) or raise while the others wait in a collective
    found = [_find(path) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    path, meta, error = found[0]
    if error is not None:
        raise error
    # decided together: a part that cannot load must not leave the others waiting inside dcp.load
    problem = (None if _sees(path) else
               f"rank {dist.get_rank()} cannot see the checkpoint {path!r} that rank 0 sees; every rank must "
               "reach it through one filesystem shared by all nodes")
    try:
        if problem is None and meta.get("chunks", 1) != v:
            problem = f"checkpoint {path!r} holds {meta.get('chunks', 1)} chunks per rank; this rank passed {v}"
        for c, chunk in enumerate(chunks):
            problem = problem or _check(chunk, path, meta, part * v + c, total)
    except Exception as exc:  # noqa: BLE001 - metadata that is JSON but not ours: told to every rank
        problem = f"checkpoint {path!r} has metadata this version cannot read ({type(exc).__name__}: {exc})"
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    problem = next((p for p in problems if p is not None), None)
    if problem is not None:
        raise ValueError(problem)
    state, loaded = {}, []
    for c, chunk in enumerate(chunks):
        entry = meta["parts"][part * v + c] if "parts" in meta else meta
        template = _optimizer_template(chunk, entry)
        state.update(_state(chunk, template, entry["optim"], _prefix(part * v + c, total), entry.get("buffers", {})))
        loaded.append((chunk, template, entry))
        for unit in chunk.saved_units:  # a prefetch in flight (an eval forward left early) lands first: it
            unit.wait_gather()          # carries the old masters, and is republished below like any gathered unit
    try:
        with _dcp_errors_as_runtime_errors("fsdp.load", f"reading {path!r}"):
            dcp.load(state, checkpoint_id=path)
    except RuntimeError:  # (dcp.load fails on every rank alike)
        for chunk in chunks:  # some masters may hold the checkpoint's values already: keep the ranks alike
            chunk.publish_masters()
        raise
    for chunk, template, entry in loaded:
        for unit in chunk.saved_units:  # the padding past numel is not in the checkpoint: zeros
            unit.master.data[_valid(unit):].zero_()
        if chunk.optimizer is not None:
            groups = tensor_groups(entry["param_groups"], chunk.optimizer.param_groups)
            chunk.optimizer.load_state_dict({"state": template, "param_groups": groups})
        chunk.publish_masters()
        chunk._masters_published = True
    return meta.get("extra", {})


def _optimizer_template(sharded, entry) -> dict:
    """The optimizer state ``entry`` (a part's metadata) says was saved, as tensors for DCP to load
    into (what was saved decides the layout, not the shapes now) and values from the metadata."""
    rank, device = dist.get_rank(sharded.group), _device(sharded)
    template, units = {}, _units_by_index(sharded)
    for name, item in entry["optim"].items():
        idx, key = name.split("/", 1)
        if item["kind"] == "value":  # not a tensor: in the metadata, not in DCP's files
            if rank not in item.get("absent_on", ()):
                template.setdefault(int(idx), {})[key] = item["values"][rank] if "values" in item else item["value"]
            continue
        if item["kind"] == "flat":
            shape = [units[int(idx)].shard_numel]
        else:
            shape = item["shape"] if item["kind"] == "replicated" else item["shapes"][rank]
        # torch keeps Adam's step (a scalar) on the CPU
        template.setdefault(int(idx), {})[key] = torch.zeros(shape, dtype=getattr(torch, item["dtype"]),
                                                             device=device if shape else "cpu")
    return template
