"""``torch.autocast`` for the fused ops: each behaves like the matmul or attention it replaces.

Inside ``torch.autocast(device, dtype)``, ``torch.cat(all_gather(a)) @ b`` runs in the autocast
dtype, and so do our ops: their floating operands are cast on entry as autocast casts a matmul's
(float64 is left alone, as autocast leaves it), and the op bodies run with autocast off. Off,
because the bodies pick their own precisions (fp32 partial sums of the reduce-scatter, fp32
softmax statistics), which autocast would otherwise cast back down.
"""
from __future__ import annotations

import contextlib
import functools

import torch


def autocast_dtype(device: torch.device) -> torch.dtype | None:
    """The dtype autocast runs a matmul in on ``device``, or None where autocast is off."""
    try:
        if not torch.is_autocast_enabled(device.type):
            return None
    except RuntimeError:  # a device type autocast does not know (meta, ...)
        return None
    return torch.get_autocast_dtype(device.type)


def cast_operands(dtype: torch.dtype | None, *tensors):
    """``tensors`` with every float32/16-bit one cast to ``dtype`` (None: unchanged)."""
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64
                 else t for t in tensors)


def autocast_off(device: torch.device):
    """A context with autocast disabled on ``device`` (a no-op where it was off)."""
    if autocast_dtype(device) is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def cast_weights(dtype: torch.dtype | None, b):
    """``b`` (a tensor, or a list/tuple of them, or anything the checks will reject) cast like
    ``cast_operands``, keeping its container type."""
    if isinstance(b, (list, tuple)):
        return type(b)(cast_operands(dtype, *b))
    if not isinstance(b, (torch.Tensor, str, bytes)) and hasattr(b, "__iter__"):
        return list(cast_operands(dtype, *b))  # a generator: read once, here
    return cast_operands(dtype, b)[0]


def backward_without_autocast(backward):
    """For an autograd Function's backward: its body runs with autocast off on the device its
    forward recorded in ``ctx.device`` (a caller may run ``loss.backward()`` inside autocast)."""
    @functools.wraps(backward)
    def run(ctx, *grads):
        with autocast_off(ctx.device):
            return backward(ctx, *grads)
    return run
