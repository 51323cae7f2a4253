"""Parameters no rank had a gradient for in a step, inside units that others had gradients in (a
branch not taken, an expert without tokens, one frozen mid-training).

The optimizer steps a unit's master as one tensor, so they get a zero gradient - which weight decay
and momentum still move, where torch skips a parameter whose grad is None. ``step`` holds their
master and elementwise optimizer-state elements and puts them back after the optimizer's step (a
step counter shared by the unit still advances). Decided from the per-parameter flags
``_finish_gradients`` agreed on across ranks: no collective of its own.
"""
from __future__ import annotations

import torch


def hold_gradless(units: list, param_had_grad: list, optimizer) -> list:
    """``(tensor, slice, copy)`` of every master and elementwise state element (Adam's moments,
    momentum: state tensors shaped like the master) of those parameters, to put back after the step.
    ``param_had_grad``: one flag per parameter of ``units``, in order."""
    held, k = [], 0
    for unit in units:
        had = param_had_grad[k:k + len(unit.params)]
        k += len(unit.params)
        slices = [s for s in (unit.master_slice(i) for i, seen in enumerate(had) if not seen) if s.stop > s.start]
        if not (unit.grad_anywhere and slices):
            continue
        state = optimizer.state.get(unit.master, {})
        tensors = [unit.master.data] + [t for t in state.values() if torch.is_tensor(t) and t.shape == unit.master.shape]
        held += [(t, s, t[s].clone()) for t in tensors for s in slices]
    return held
