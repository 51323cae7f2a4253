"""What ``fsdp.shard`` decides about a model before taking it over: which modules become units,
which parameters two units share (they go to the root unit), and the check of its tags.
``sharded.py`` holds the hooks that run the units."""
from __future__ import annotations

from torch import nn


def _callable(mod: nn.Module) -> bool:
    """Has a forward of its own: a module without one (ParameterList, ParameterDict, a plain holder)
    is never called, so a unit of it would never gather (stage 3: its parameters read while freed)."""
    return type(mod).forward is not nn.Module.forward


def unit_modules(model: nn.Module, units) -> list[tuple[str, nn.Module]]:
    if units is None:  # every top-level child that holds parameters; containers are never called, so
        found = []     # their hooks would never fire: a ModuleList/ModuleDict contributes its children
        for name, mod in model.named_children():
            if isinstance(mod, (nn.ModuleList, nn.ModuleDict)):
                found += [(f"{name}.{n}", m) for n, m in mod.named_children()]
            else:
                found.append((name, mod))
        # (children without a forward: their parameters go to the root unit, which stays gathered)
        return [(n, m) for n, m in found if _callable(m) and any(p.requires_grad for p in m.parameters())]
    classes = tuple(units) if isinstance(units, (list, tuple, set)) else (units,)
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
