"""Stage 3 shards frozen parameters too, as FSDP2 and ZeRO-3 do: a LoRA base is most of the model.

Each unit module's frozen parameters (those no other unit, and no module outside the units, also
holds) become flat units of their own, one per dtype: sharded like the trained ones, gathered with
the module's other units before its forward and its backward (cast to ``param_dtype`` on the way,
where ``FrozenComputeCopies`` would have cast them), never reduced or stepped. Their shard stays in
their own dtype; checkpoints hold it like a master (``fsdp.save``), reshardable.

When to free them after backward: a trained unit is freed once all its parameters have their
gradients - every op that read them has run. A frozen weight has no gradient to tell that; it is
read by the ops leading back to the module's inputs (dX = dY W) and to its trained parameters. So
the module's frozen units are freed once both are done: every gradient-taking input of each of its
forward calls has its gradient (a tensor hook, which fires once that input's gradient is complete,
so every op of the module on the way to it has run), and its trained units are done. Whatever is
still gathered at the end of backward (an input whose gradient never came) is freed there. A
module called again before its next backward (two forwards, one backward; a pipeline's F F B B)
is gathered again by its output's gradient hook before each backward, so an early free costs a
gather, never a read of freed memory. Not seen: a tensor that the module reads without taking it
as an argument (a closure's), as under FSDP2.
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten

from .flat_unit import FlatUnit
from .frozen_copies import CAST_DTYPES


def frozen_units(modules: list, skip: set, group, *, param_dtype) -> dict:
    """``{index in modules: [FlatUnit(trained=False), ...]}`` for the frozen parameters of each unit
    module that are in no other unit and outside every unit (``skip``: ids left unsharded), one unit
    per (dtype, device). Nothing is re-pointed yet (``attach``)."""
    made, seen = {}, set(skip)
    for index, (name, mod) in enumerate(modules):
        parts: dict = {}
        for p in mod.parameters():
            if not p.requires_grad and id(p) not in seen and p.numel() > 0:
                seen.add(id(p))
                parts.setdefault((p.dtype, p.device), []).append(p)
        for (dtype, device), params in parts.items():
            label = f"{name}#frozen" if len(parts) == 1 else f"{name}#frozen.{str(dtype).removeprefix('torch.')}"
            cast = param_dtype if param_dtype is not None and dtype in CAST_DTYPES else None
            unit = FlatUnit(label, mod, params, group, param_dtype=cast, reduce_dtype=None, trained=False)
            unit.module_index = index
            made.setdefault(index, []).append(unit)
    return made


class _Call:
    """One forward call of a unit module: its inputs whose gradients are still to come."""

    def __init__(self, waiting: int):
        self.waiting = waiting


class FrozenRelease:
    """Per unit module with frozen units: which of its forward calls' backwards are under way (their
    output's gradient came, not all their inputs' yet) and how many of its trained units are not
    done this backward. ``free(index)`` frees that module's frozen units."""

    def __init__(self, module_units: list, free):
        self.trained = {units[0].module_index: sum(u.trained for u in units) for units in module_units
                        if any(not u.trained for u in units)}
        self.left = dict(self.trained)
        self.busy: dict = {index: set() for index in self.trained}
        self.free = free

    def has_frozen(self, index: int) -> bool:
        return index in self.trained

    def watch_inputs(self, index: int, args, kwargs):
        """In the module's forward pre-hook: a ``_Call`` whose inputs' gradients are watched, or None
        (no input takes a gradient: then only its trained units' gradients matter)."""
        inputs = [t for t in tree_flatten((args, kwargs))[0] if torch.is_tensor(t) and t.requires_grad]
        inputs = list({id(t): t for t in inputs}.values())
        if not inputs:
            return None
        call = _Call(len(inputs))
        for t in inputs:
            t.register_hook(lambda grad, call=call: self._input_done(index, call))
        return call

    def backward_started(self, index: int, call) -> None:
        """The call's output got its gradient (its backward starts; the module was gathered)."""
        if call is not None and call.waiting > 0:
            self.busy[index].add(call)

    def _input_done(self, index: int, call) -> None:
        call.waiting -= 1
        if call.waiting == 0:
            self.busy[index].discard(call)
            self._maybe_free(index)

    def trained_unit_done(self, index: int) -> None:
        if index in self.left:
            self.left[index] = max(0, self.left[index] - 1)
            self._maybe_free(index)

    def _maybe_free(self, index: int) -> None:
        if not self.busy[index] and self.left[index] == 0:
            self.free(index)

    def reset(self) -> None:
        """At the end of backward (whatever is still gathered is freed there)."""
        self.left = dict(self.trained)
        for calls in self.busy.values():
            calls.clear()
