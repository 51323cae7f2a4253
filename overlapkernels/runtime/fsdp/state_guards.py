"""What ``state_dict`` / ``load_state_dict`` of an fsdp-wrapped model refuse, and why; and the
unsharded state dict fsdp offers instead (``full_state_dict``).

Stage 3 frees a unit's parameters between forwards, so a state dict of them would be empty. And at
every stage a load of a unit's parameters would reach only the gathered copy, which the next step
overwrites from the masters (the optimizer's): refused, not silently undone - at the model, before
anything loads, and at each unit's module (a load that starts there); so are frozen parameters that
stage 3's ``shard_frozen`` shards. Other frozen parameters and buffers are in no unit and still load. ``sharded.full_state_dict()`` and ``fsdp.save`` / ``fsdp.load`` are
the ways in and out.
"""
from __future__ import annotations

import weakref

import torch


def guard_state_dicts(sharded) -> None:
    model = sharded.module
    for unit in sharded.saved_units:
        unit.module.register_state_dict_pre_hook(_refuse_freed(sharded, unit))
    trained_ids = {id(p) for unit in sharded.all_units for p in unit.params}
    # frozen ones in units too (stage 3's shard_frozen): a load would reach the gathered copy only
    sharded_ids = {id(p) for unit in sharded.frozen_units for p in unit.params}
    for mod in dict.fromkeys([model] + [unit.module for unit in sharded.saved_units]):
        named = list(mod.named_parameters(remove_duplicate=False))
        trained = {name for name, p in named if id(p) in trained_ids}
        frozen = {name for name, p in named if id(p) in sharded_ids}
        mod.register_load_state_dict_pre_hook(_refuse_load(sharded, trained, frozen))


def _refuse_freed(sharded, unit):
    def hook(module, *_):
        if not unit.gathered and not sharded._reading_full_state:
            raise RuntimeError(
                f"state_dict() of {type(module).__name__} (fsdp unit {unit.name!r}): its parameters are sharded "
                f"(stage {sharded.stage}) and freed between forward passes. Use sharded.full_state_dict() (a "
                "collective; models.gather_dense_state_dict(sharded) for a tensor-parallel model's dense weights) or "
                "fsdp.save / fsdp.load instead")
    return hook


def _refuse_load(sharded, trained: set, frozen: set):
    def hook(module, state_dict, prefix, *_):
        names = [k[len(prefix):] for k in state_dict if k.startswith(prefix)]
        if loaded := sorted(k for k in names if k in trained):
            raise RuntimeError(
                f"load_state_dict() into {type(module).__name__} after fsdp.shard, of the trained parameters "
                f"{', '.join(loaded[:3])}{' ...' if len(loaded) > 3 else ''}: the optimizer trains master "
                f"shards of them (stage {sharded.stage}), which a load would not reach, so the next step would "
                "undo it. Load before fsdp.shard, or use fsdp.load (frozen parameters and buffers load)")
        if loaded := sorted(k for k in names if k in frozen):
            raise RuntimeError(
                f"load_state_dict() into {type(module).__name__} after fsdp.shard, of the frozen parameters "
                f"{', '.join(loaded[:3])}{' ...' if len(loaded) > 3 else ''}: shard_frozen keeps only shards of them, "
                "which a load would not reach. Load before fsdp.shard, or use fsdp.load")
    return hook


def full_state_dict(sharded) -> dict:
    """Unsharded tensors under the keys of ``model.state_dict()``, on every rank (a collective)."""
    values = {}
    for unit in sharded.saved_units:
        for p, full in zip(unit.params, unit.full_tensors()):
            values[id(p)] = full
    sharded._reading_full_state = True  # only for the keys (_refuse_freed): the values come from the masters
    try:
        entries = sharded.module.state_dict(keep_vars=True)
    finally:
        sharded._reading_full_state = False
    # buffers, and non-tensor extra state (Megatron's _extra_state), as they are
    return {name: values[id(t)] if id(t) in values else t.detach().clone() if torch.is_tensor(t) else t
            for name, t in entries.items()}


def check_steppable(sharded) -> None:
    """Before ``step``: a frozen model has nothing to step, and a parameter sharded as frozen that
    takes gradients now has no master or optimizer state to receive them."""
    if sharded.optimizer is None:
        raise RuntimeError(f"fsdp step: {type(sharded.module).__name__} was sharded with no trainable parameter "
                           "(a frozen model, for inference): there is nothing to step")
    if thawed := [u.name for u in sharded.frozen_units if any(p.requires_grad for p in u.params)]:
        raise RuntimeError(f"fsdp step: parameters sharded as frozen (shard_frozen) in {thawed} take gradients "
                           "now; they have no master and no optimizer state: unfreeze before fsdp.shard")


def guard_optimizer_step(sharded) -> None:
    """``sharded.optimizer`` steps the masters, which only ``sharded.step()`` gives their gradients
    (reduced over DP) and takes the results back from. Stepped directly - as GradScaler.step(opt),
    Lightning or accelerate do - it stepped stale gradients and the model never changed (stages 1-2),
    silently: refused by name."""
    if sharded.optimizer is None:
        return
    owner = weakref.ref(sharded)  # (the optimizer must not keep the model alive)

    def hook(optimizer, args, kwargs):
        if (s := owner()) is not None and not s._in_step:
            raise RuntimeError(
                f"{type(optimizer).__name__}.step() called directly on an fsdp-sharded model's optimizer: it steps "
                "the master shards, whose gradients only ShardedModule.step() reduces and whose updates only it "
                "publishes into the model. Call sharded.step() instead (it steps this optimizer; LR schedulers on "
                "it work as usual). For loss scaling (torch.amp.GradScaler steps the optimizer itself) use "
                "fsdp.GradScaler: scaler.step(sharded) agrees over every rank whether to skip")
    sharded.optimizer.register_step_pre_hook(hook)


def check_apply(sharded, fn) -> None:
    """``.to(dtype)``, ``.half()``, ``.cuda()`` on a sharded model replace its parameters' data, which
    views fsdp's flat buffers: training went on with buffers nobody read (stages 1-2) or the cast was
    undone at the next gather (stage 3), silently. Refused when any parameter would change: tried
    on an empty tensor like each (a freed stage-3 parameter has no storage to read)."""
    for name, p in sharded.module.named_parameters():
        probe = torch.empty(0, dtype=p.dtype, device=p.device)
        if fn(probe) is not probe:
            raise RuntimeError(
                f"fsdp: moving or casting a sharded model (.to(), .half(), .cuda(), ...) would replace its "
                f"parameters (the first: {name!r}), which view fsdp's flat buffers: the replacements would be "
                "neither trained nor gathered. Move or cast the model before fsdp.shard, or use param_dtype= "
                "for mixed precision")
