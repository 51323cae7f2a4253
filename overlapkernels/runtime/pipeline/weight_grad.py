"""Zero-bubble support: weight gradients as per-layer closures, run later by the W action.

During a "B" action the runner opens ``deferring(store)``; layers that support it (``nn.Linear``
and its plain subclasses after ``enable_zero_bubble``) then compute only the input gradient and push
a closure that computes their weight gradient into the store, as DualPipe's WeightGradStore does.
No autograd graph surgery, so it composes with activation checkpointing. Layers without support
simply compute their weight gradient during B: still correct, only less of the bubble is filled.
"""
from __future__ import annotations

import contextlib
import contextvars
import types

import torch
from torch import nn
from torch.autograd.function import once_differentiable
from torch.nn import functional as F

_store: contextvars.ContextVar = contextvars.ContextVar("overlapkernels_weight_grad_store", default=None)


class WeightGradStore:
    def __init__(self):
        self.closures: list = []

    def run(self) -> None:
        for fn in self.closures:
            fn()
        self.closures = []


@contextlib.contextmanager
def deferring(store: WeightGradStore):
    token = _store.set(store)
    try:
        yield store
    finally:
        _store.reset(token)


def _accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad += grad


class _ZBLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.bias = bias
        return F.linear(x, weight, bias)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        bias = ctx.bias
        # a frozen weight or bias (requires_grad=False) gets no gradient, as under plain autograd
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_out @ weight if need_x else None

        def weight_grads():
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            return (g2.T @ x.reshape(-1, x.shape[-1]) if need_w else None), (g2.sum(0) if need_b else None)

        store = _store.get()
        if store is None or not (need_w or need_b):
            return (grad_x, *weight_grads())

        def deferred():
            grad_w, grad_b = weight_grads()
            if grad_w is not None:
                _accumulate(weight, grad_w)
            if grad_b is not None:
                _accumulate(bias, grad_b)

        store.closures.append(deferred)
        return grad_x, None, None


def _zb_forward(self, x):
    # under autocast F.linear computes in a lower dtype than the tensors saved for W would: no split
    if torch.is_autocast_enabled(x.device.type):
        return F.linear(x, self.weight, self.bias)
    return _ZBLinear.apply(x, self.weight, self.bias)


def splits_weight_grad(module: nn.Module) -> bool:
    """Whether ``enable_zero_bubble`` can defer this module's weight gradient: an ``nn.Linear``
    (or a subclass) that still computes ``F.linear(x, weight, bias)`` with parameters of its own.
    Subclasses that override ``forward`` (LoRA, quantised), parametrised or weight-normed weights
    (tensors computed from other parameters) and a forward patched by someone else are left as
    they are: correct, only their weight gradient runs in B."""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False
    patched = module.__dict__.get("forward")
    if patched is not None and getattr(patched, "__func__", None) is not _zb_forward:
        return False
    return isinstance(module.weight, nn.Parameter) and (module.bias is None or isinstance(module.bias, nn.Parameter))


def enable_zero_bubble(module: nn.Module) -> nn.Module:
    """Make the linears inside ``module`` (see ``splits_weight_grad``) defer their weight gradient
    under a W-split schedule; ``PipelineRunner`` calls it for such schedules. Outside a B action
    they compute it at once, as before."""
    for sub in module.modules():
        if splits_weight_grad(sub):
            sub.forward = types.MethodType(_zb_forward, sub)
    return module
