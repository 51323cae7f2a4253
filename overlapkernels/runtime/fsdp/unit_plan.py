"""What ``fsdp.shard`` decides about a model before taking it over: which modules become units,
which parameters two units share (they go to the root unit), and the checks of its tags and group.
``sharded.py`` holds the hooks that run the units."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn

from ...parallel import shared_peers


def _callable(mod: nn.Module) -> bool:
    """Has a forward of its own: a module without one (ParameterList, ParameterDict, a plain holder)
    is never called, so a unit of it would never gather (stage 3: its parameters read while freed)."""
    return type(mod).forward is not nn.Module.forward


def unit_modules(model: nn.Module, units, *, frozen_too: bool = False) -> list[tuple[str, nn.Module]]:
    """``frozen_too``: a child whose parameters are all frozen is a unit too (stage 3 shards them)."""
    if units is None:  # every top-level child that holds parameters; containers are never called, so
        found = []     # their hooks would never fire: a ModuleList/ModuleDict contributes its children
        for name, mod in model.named_children():
            if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
                found += [(f"{name}.{n}", m) for n, m in mod.named_children()]
            else:
                found.append((name, mod))
        # (children without a forward: their parameters go to the root unit, which stays gathered)
        return [(n, m) for n, m in found if _callable(m) and any(frozen_too or p.requires_grad for p in m.parameters())]
    classes = tuple(units) if isinstance(units, (list, tuple, set)) else (units,)
    if bad := [c for c in classes if not isinstance(c, (str, type))]:
        raise TypeError(f"units={units!r}: {bad[0]!r} is neither a module class nor a class name")
    names = {c for c in classes if isinstance(c, str)}
    types = tuple(c for c in classes if isinstance(c, type))
    found, claimed = [], set()
    for name, mod in model.named_modules():
        if mod is model or any(name.startswith(c + ".") for c in claimed):
            continue
        if isinstance(mod, types) or type(mod).__name__ in names:
            found.append((name, mod))
            claimed.add(name)
    if not found:
        raise ValueError(f"units={units!r}: no submodule of {type(model).__name__} matches")
    # (an entry that matches nothing here is not refused: one units= serves every pipeline stage, and a
    # stage without an embedding has none to match)
    return found


def shared_parameters(model: nn.Module, modules) -> set:
    """ids of the parameters used by more than one unit, counting the modules outside every unit
    (the root unit's) as one more."""
    holders: dict = {}
    for i, (_, mod) in enumerate(modules):
        for p in mod.parameters():
            holders.setdefault(id(p), set()).add(i)
    names = [name for name, _ in modules]
    for name, mod in model.named_modules(remove_duplicate=False):  # every path to a shared module
        if not any(name == unit or name.startswith(unit + ".") for unit in names):
            for p in mod.parameters(recurse=False):
                holders.setdefault(id(p), set()).add("root")
    return {pid for pid, owners in holders.items() if len(owners) > 1}


def check_sequence_parallel_tags(model: nn.Module, stage: int) -> None:
    """Stages 2/3 reduce-scatter (and drop) gradients during backward, so a client never gets to
    sum sequence-parallel partial gradients over TP itself: fsdp must know their group."""
    for name, p in model.named_parameters():
        if p.requires_grad and getattr(p, "sequence_parallel", False) \
                and getattr(p, "sequence_parallel_group", None) is None:
            raise ValueError(
                f"parameter {name!r} has sequence_parallel=True but no sequence_parallel_group: with stage={stage} "
                "its gradient (partial per tensor-parallel rank) is reduced during backward and must first be "
                "summed over its TP group, which fsdp cannot guess. Build the layer with its group (e.g. "
                "RMSNorm(hidden, sequence_parallel=True, group=tp_group)) or set p.sequence_parallel_group")


def _parallel_groups(model: nn.Module, *, tags: bool = True):
    """(where, group, what) for every group of 2+ ranks the model computes over: this library's
    layers' tensor-parallel ``group`` and ``cp_group`` (another module's ``group`` may well be its
    data-parallel one: a contrastive loss gathering over DP), and with ``tags`` its parameters'
    SP/CP tags."""
    for name, mod in model.named_modules():
        if not type(mod).__module__.startswith("overlapkernels."):
            continue
        for attr, what in (("group", "tensor-parallel group"), ("cp_group", "context-parallel group")):
            group = mod.__dict__.get(attr)
            if isinstance(group, dist.ProcessGroup) and dist.get_world_size(group) > 1:
                yield f"{type(mod).__name__} {name or '<model>'!r}", group, what
    for name, p in model.named_parameters() if tags else ():
        for attr, what in (("sequence_parallel_group", "sequence-parallel group"),
                           ("context_parallel_group", "context-parallel group")):
            group = getattr(p, attr, None)
            if isinstance(group, dist.ProcessGroup) and dist.get_world_size(group) > 1:
                yield f"parameter {name!r}", group, what


def check_group_holds_replicas(model: nn.Module, group) -> None:
    """fsdp averages gradients over its group and splits each unit's parameters across it, so the
    group's ranks must hold the same part of the model and see other samples: data-parallel peers.
    One that also holds a layer's tensor- or context-parallel peers (the world, the default, under
    ``init_parallel(tp=2)``) would average different weight slices, or count other tokens of the same
    samples as other samples - wrong weights, silently. Refused here, alike on every rank."""
    if dist.get_world_size(group) == 1:
        return
    seen = set()
    for where, other, what in _parallel_groups(model):
        if id(other) in seen:
            continue
        seen.add(id(other))
        if peers := shared_peers(group, other):
            raise ValueError(
                f"fsdp.shard: its group (global ranks {dist.get_process_group_ranks(group)}) also holds ranks {peers} "
                f"of the {what} of {where}, which hold other parts of the model or see other tokens of the same "
                "samples; fsdp averages gradients over its group and shards the units across it, so pass the "
                "data-parallel group (dims.dp_group of ok.init_parallel); group=None means the world")


def check_context_parallel_tags(model: nn.Module) -> None:
    """Under context parallelism each rank sees part of every sequence, so every gradient of the
    model is partial over the CP group, and fsdp sums a unit over the ``context_parallel_group`` its
    parameters carry. A model with attention over a CP group but untagged parameters (one built from
    the layers, not the GPT, which tags itself) would leave the CP ranks drifting apart silently."""
    attending = [(where, group) for where, group, what in _parallel_groups(model, tags=False)
                 if what == "context-parallel group"]
    if not attending:
        return
    where, group = attending[0]
    untagged = [n for n, p in model.named_parameters()
                if p.requires_grad and getattr(p, "context_parallel_group", None) is None]
    if untagged:
        shown = ", ".join(untagged[:4]) + (f" and {len(untagged) - 4} more" if len(untagged) > 4 else "")
        raise ValueError(
            f"{where} attends over a context-parallel group of {dist.get_world_size(group)} ranks, so every gradient "
            f"of the model is partial over it, but parameters {shown} carry no context_parallel_group: fsdp would "
            "not sum them there and the CP ranks would drift apart. Call "
            "overlapkernels.layers.mark_context_parallel(model, cp_group) before fsdp.shard (the GPT does it itself)")
