"""Parameters no rank had a gradient for in a step, inside units that others had gradients in (a
branch not taken, an expert without tokens, one frozen mid-training).

The optimizer steps a unit's master as one tensor, so they get a zero gradient - which weight decay
and momentum still move, where torch skips a parameter whose grad is None. ``step`` holds their
master and elementwise optimizer-state elements and puts them back after the optimizer's step, and
zeroes their part of state that step created (a step counter shared by the unit still advances). Decided from the per-parameter flags
``_finish_gradients`` agreed on across ranks: no collective of its own.
"""
from __future__ import annotations

import torch


def hold_gradless(units: list, param_had_grad: list, optimizer) -> list:
    """What ``restore_gradless`` needs after the step: per unit with such parameters, its master, their
    slices, a copy of each slice of the master and of every elementwise state tensor (Adam's moments,
    momentum: state tensors shaped like the master), and the state keys the optimizer had before.
    ``param_had_grad``: one flag per parameter of ``units``, in order."""
    held, k = [], 0
    for unit in units:
        had = param_had_grad[k:k + len(unit.params)]
        k += len(unit.params)
        slices = [s for s in (unit.master_slice(i) for i, seen in enumerate(had) if not seen) if s.stop > s.start]
        if not (unit.grad_anywhere and slices):
            continue
        state = optimizer.state.get(unit.master, {})
        tensors = [unit.master.data] + [t for t in state.values() if _elementwise(t, unit.master)]
        held.append((unit.master, slices, set(state), [(t, s, t[s].clone()) for t in tensors for s in slices]))
    return held


# torch's optimizer state that starts at zero when made lazily at a parameter's first gradient (SGD's
# and RMSprop's momentum, the Adam family's moments, RMSprop's and Adadelta's averages, ASGD's average,
# Rprop's previous gradient). Others start elsewhere (Rprop's step_size at lr; a parameter's clone in
# schedule-free optimizers): left as the step left them, which for a zero gradient is their start.
ZERO_STARTED_STATE = frozenset({"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "square_avg",
                                "grad_avg", "exp_inf", "acc_delta", "ax", "prev"})


def restore_gradless(held: list, optimizer) -> None:
    """After the optimizer's step: the held elements as they were, and the zero-started state this
    step created (a unit's first step: momentum, Adam's moments are made lazily) zero in their slices,
    as torch would first make it for them at their first gradient (SGD with dampening != 0 starts
    from the undamped gradient instead, which this does not reproduce)."""
    with torch.no_grad():
        for master, slices, keys_before, copies in held:
            for tensor, where, before in copies:
                tensor[where] = before
            state = optimizer.state.get(master, {})
            for key, t in state.items():
                if key not in keys_before and key in ZERO_STARTED_STATE and _elementwise(t, master):
                    for where in slices:
                        t[where] = 0


def _elementwise(t, master) -> bool:
    return torch.is_tensor(t) and t.shape == master.shape
