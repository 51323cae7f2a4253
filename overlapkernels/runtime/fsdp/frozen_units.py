"""Stage 3 shards frozen parameters too, as FSDP2 and ZeRO-3 do: a LoRA base is most of the model.

Each unit module's frozen parameters (those no other unit, and no module outside the units, also
holds) become flat units of their own, one per dtype: sharded like the trained ones, gathered with
the module's other units before its forward and its backward (cast to ``param_dtype`` on the way,
where ``FrozenComputeCopies`` would have cast them), never reduced or stepped. Their shard stays in
their own dtype; checkpoints hold it like a master (``fsdp.save``), reshardable.

When to free them after backward: a trained unit is freed once all its parameters have their
gradients - every op that read them has run. A frozen weight has no gradient to tell that; it is
read by the ops leading back to the module's inputs (dX = dY W) and to its trained parameters. So
each forward call passes its gradient-taking inputs through an identity autograd Function (FSDP2's
RegisterPostBackwardFunction), whose backward runs once the module's own ops have given them their
gradients - per call and per traversal of its graph (retain_graph), whatever else consumes the
inputs. The module's frozen units are freed once no call whose backward started (its output's
gradient hook, which also gathers them) still waits for that, and its trained units are done; what
is still gathered at the end of backward is freed there. A call none of whose arguments takes a
gradient, or with one inside a container or object, keeps them to the end of backward (see
``watch_inputs``). Writes through ``.data`` to a sharded frozen parameter are not detected (lost).
Like FSDP2's, the wrapping makes the module's inputs outputs of a custom Function: a module that
changes its input in place is refused by torch there (shard_frozen=False does not wrap). And when
a module called twice is gathered again between its calls' backwards depends on autograd's order,
so ranks must run the same code (as FSDP2 needs; trained units are reduced in a fixed order).
"""
from __future__ import annotations

import torch

from .accounting import each_tensor
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


def _split(value, tensors: list, others: list) -> None:
    """The tensors among an argument and inside its (nested) tuples; everything else in ``others``."""
    if torch.is_tensor(value):
        tensors.append(value)
    elif isinstance(value, tuple):
        for item in value:
            _split(item, tensors, others)
    else:
        others.append(value)


class _Call:
    """One forward call of a unit module whose backward may read its frozen units."""
    opaque = False  # a gradient may reach its frozen ops unseen (watch_inputs): held to the end of backward


class _InputsDone(torch.autograd.Function):
    """Identity on a call's gradient-taking inputs (FSDP2's RegisterPostBackwardFunction): its backward
    runs once the module's own ops have given those inputs their gradients, once per traversal of
    this call's graph, whatever else consumes the inputs."""

    @staticmethod
    def forward(ctx, release, index, call, *inputs):
        ctx.release, ctx.index, ctx.call = release, index, call
        ctx.set_materialize_grads(False)  # an input the module ignores keeps a None gradient, not zeros
        return inputs

    @staticmethod
    def backward(ctx, *grads):
        ctx.release._input_done(ctx.index, ctx.call)
        return (None, None, None, *grads)


class FrozenRelease:
    """Per unit module with frozen units: which of its forward calls' backwards are under way (their
    output's gradient came, their inputs' not yet) and how many of its trained units are not done
    this backward. ``free(index)`` frees that module's frozen units."""

    def __init__(self, module_units: list, free):
        self.trained = {units[0].module_index: sum(u.trained for u in units) for units in module_units
                        if any(not u.trained for u in units)}
        self.left = dict(self.trained)
        self.busy: dict = {index: set() for index in self.trained}
        self.free = free

    def has_frozen(self, index: int) -> bool:
        return index in self.trained

    def watch_inputs(self, index: int, args, kwargs):
        """In the module's forward pre-hook (grad enabled) -> (its ``_Call``, the args and kwargs to
        run it with). The gradient-taking tensors among the arguments and inside their tuples go
        through one ``_InputsDone`` (each tensor once, so one passed twice stays one object); nothing
        mutable is rebuilt (a list or dict the module appends to stays the caller's). The call is ``opaque`` -
        its frozen units held to the end of backward - where a gradient-taking tensor hides inside a
        container or object, or where no argument takes a gradient: a gradient can still reach its
        frozen ops through a tensor the module reads otherwise (an attribute, a trained parameter of
        another module), which no hook sees (FSDP2 keeps such a call's parameters alike)."""
        call, tensors, others = _Call(), [], []
        for v in (*args, *kwargs.values()):
            _split(v, tensors, others)
        top = {id(t): t for t in tensors if t.requires_grad}
        nested = []
        each_tensor(others, lambda t: nested.append(t) if t.requires_grad else None)
        call.opaque = bool(nested) or not top
        if not top:
            return call, args, kwargs
        passed = dict(zip(top, _InputsDone.apply(self, index, call, *top.values())))

        def through(v):
            if torch.is_tensor(v):
                return passed.get(id(v), v)
            if isinstance(v, tuple):  # immutable: rebuilt (a subclass it cannot rebuild stays as it was)
                items = [through(x) for x in v]
                if any(a is not b for a, b in zip(items, v)):
                    return tuple(items) if type(v) is tuple else v._make(items) if hasattr(v, "_make") else v
            return v

        return call, tuple(through(v) for v in args), {k: through(v) for k, v in kwargs.items()}

    def backward_started(self, index: int, call) -> None:
        """The call's output got its gradient (its backward starts; the module was gathered)."""
        if call is not None:
            self.busy[index].add(call)

    def _input_done(self, index: int, call) -> None:
        if not call.opaque:
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
