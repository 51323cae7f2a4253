"""The user's optimizer, built over the model's own parameters, then moved onto the flat shards.

``fsdp.shard``'s factory is called with the parameters fsdp will shard - the model's own, with
their names, shapes and identities - so the usual recipes keep working: no weight decay for
biases and norms (``p.dim() < 2``), a learning rate per layer, only some parameters optimized.
A unit's parameters are then split by the param group they are in, each part a flat unit of
its own (DeepSpeed's flattening per param group), and each group's ``params`` become those
units' masters: 1-D shards, so an optimizer that reads a parameter's shape at ``step`` (Adafactor,
Muon) sees shards, as under ZeRO: Adafactor then keeps unfactored moments, Muon cannot step them
and is refused. Parameters in no group are sharded and reduced like the rest
but never stepped, as torch leaves a parameter its optimizer was not given.
Why not FSDP2's way (per-parameter DTensors): the flat units are what keeps each unit one
all-gather and one reduce-scatter.
"""
from __future__ import annotations

import copy

import torch

from .flat_unit import FlatUnit

OPTIMIZER_METHODS = ("step", "zero_grad", "state_dict", "load_state_dict", "param_groups", "state")


def check_optimizer(optimizer) -> None:
    missing = [a for a in OPTIMIZER_METHODS if not hasattr(optimizer, a)]
    if missing:
        raise TypeError(f"optimizer returned a {type(optimizer).__name__}, which lacks {', '.join(missing)}; "
                        "expected a torch.optim.Optimizer over the parameters it was given")


def group_of_params(optimizer, trainable: list, model) -> dict:
    """``{id(param): index of its param group}`` for the parameters fsdp shards (those in no group
    are absent). The model's frozen parameters may be in a group (``model.parameters()`` passed
    whole): torch skips them, so fsdp drops them. Any other tensor is refused."""
    ours = {id(p) for p in trainable}
    frozen = {id(p) for p in model.parameters() if not p.requires_grad}
    found = {}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) in ours:
                found[id(p)] = index
            elif id(p) not in frozen:
                raise ValueError(f"fsdp.shard: the optimizer's param group {index} holds a tensor of shape "
                                 f"{tuple(p.shape)} that is not a parameter of the model: fsdp would neither shard "
                                 "nor checkpoint it; build the optimizer over the parameters the factory is given")
    return found


def optimizer_and_units(factory, model, plan: list, rest: list, group, **options) -> tuple:
    """``(optimizer, per unit module its flat units, the root's flat units)``: the factory called with
    the model's trainable parameters (``plan``'s and ``rest``, in ``model.parameters()`` order), each
    unit module split by param group, the groups moved onto the units' masters. Before any unit takes
    its parameters over (``attach``): a refusal, or a factory that raises, leaves the model as it was.
    ``options``: FlatUnit's."""
    ours = {id(p) for _, _, params in plan for p in params} | {id(p) for p in rest}
    trainable = [p for p in model.parameters() if id(p) in ours]
    if not trainable:  # a frozen model sharded for inference (shard_frozen): nothing to optimize
        return None, [], []
    optimizer = factory(list(trainable))
    check_optimizer(optimizer)
    check_steps_shards(optimizer)
    found = group_of_params(optimizer, trainable, model)
    module_units = [units_per_group(i, name, mod, params, found, group, **options)
                    for i, (name, mod, params) in enumerate(plan)]
    roots = units_per_group(len(plan), "<root>", model, rest, found, group, **options) if rest else []
    move_onto_masters(optimizer, [u for made in module_units for u in made] + roots)
    return optimizer, module_units, roots


def units_per_group(module_index: int, name: str, module, params: list, found: dict, group, **options) -> list:
    """A unit module's flat units, one per param group its ``params`` are in (in the order the groups
    first occur), named after the module alone when there is one, else ``name#group<i>`` and
    ``name#unoptimized`` (in no group). ``options``: FlatUnit's."""
    parts: dict = {}
    for p in params:
        parts.setdefault(found.get(id(p)), []).append(p)
    made = []
    for param_group, part in parts.items():
        label = name if len(parts) == 1 else f"{name}#group{param_group}" if param_group is not None else \
            f"{name}#unoptimized"
        unit = FlatUnit(label, module, part, group, **options)
        unit.param_group, unit.module_index = param_group, module_index
        made.append(unit)
    return made


def move_onto_masters(optimizer, units: list) -> None:
    """Each param group's ``params`` become its units' masters (``param_names``, where the factory
    named them, the units' names); state the optimizer made in its constructor for the parameters
    (Adagrad's sums) is sharded as they were, state for frozen ones dropped, other state (not keyed
    by a tensor) kept. All computed before anything is assigned: a refusal leaves the optimizer as
    the factory returned it."""
    groups = [[u for u in units if u.param_group == index] for index in range(len(optimizer.param_groups))]
    ours = {id(p) for u in units for p in u.params}
    # state keyed otherwise is kept, but not a frozen parameter's (Adagrad makes it for every tensor it
    # is given): such a tensor is in no group any more, and torch's state_dict() fails on it
    state = {key: value for key, value in optimizer.state.items() if id(key) not in ours and not torch.is_tensor(key)}
    made = {id(key): value for key, value in optimizer.state.items() if id(key) in ours}
    for unit in units:
        states = [made.get(id(p)) for p in unit.params]
        if unit.param_group is None or not any(states):
            continue
        if not all(states) or len({tuple(s) for s in states}) > 1:
            raise ValueError(f"fsdp.shard: the optimizer made state for only some parameters of unit {unit.name!r} "
                             "(or different keys): it cannot be sharded as one flat shard")
        state[unit.master] = {key: _sharded_state(unit, [s[key] for s in states], key) for key in states[0]}
    for group, members in zip(optimizer.param_groups, groups):
        group["params"] = [u.master for u in members]
        if "param_names" in group:  # (torch >= 2.6: an optimizer built from named_parameters)
            group["param_names"] = [u.name for u in members]
    optimizer.state.clear()
    optimizer.state.update(state)


def check_steps_shards(optimizer) -> None:
    """Refuses an optimizer that cannot step 1-D shards at all, before training: Muon orthogonalises
    each 2-D gradient (torch's raises at the first step, after a whole forward and backward)."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is not None and isinstance(optimizer, muon):
        raise ValueError("fsdp.shard: torch.optim.Muon steps 2-D matrices, and fsdp steps flat 1-D shards of the "
                         "parameters (as ZeRO does); use another optimizer, or Muon without fsdp")


def _same(a, b) -> bool:
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


def _sharded_state(unit, values: list, key):
    """A state value per parameter -> the unit's: elementwise tensors (shaped like their parameter)
    flattened and sliced like the master; a value every parameter holds alike kept once. "step" is
    torch's name for the step counter, kept once even for a 0-d parameter, which it is shaped like."""
    if key != "step" and all(torch.is_tensor(v) and v.shape == p.shape for v, p in zip(values, unit.params)):
        dtype = unit.master_dtype if values[0].is_floating_point() else values[0].dtype
        return unit.local_shard(unit.flatten(values, dtype)).clone()
    first = values[0]
    if not all(_same(v, first) for v in values[1:]):
        raise ValueError(f"fsdp.shard: the optimizer's state {key!r} differs between parameters of unit {unit.name!r} "
                         "and is not elementwise: it cannot be sharded as one flat shard")
    return first.clone() if torch.is_tensor(first) else copy.deepcopy(first)
