"""Zero-bubble support: weight gradients as per-layer closures, run later by the W action.

During a "B" action the runner opens ``deferring(store)``; layers that support it (``ZBLinear``,
or any ``nn.Linear`` after ``enable_zero_bubble``) then compute only the input gradient and push
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
        ctx.has_bias = bias is not None
        ctx.bias = bias
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        grad_x = grad_out @ weight
        bias = ctx.bias

        def weight_grads():
            g2, x2 = grad_out.reshape(-1, grad_out.shape[-1]), x.reshape(-1, x.shape[-1])
            return g2.T @ x2, g2.sum(0) if bias is not None else None

        store = _store.get()
        if store is None:
            grad_w, grad_b = weight_grads()
            return grad_x, grad_w, grad_b

        def deferred():
            grad_w, grad_b = weight_grads()
            _accumulate(weight, grad_w)
            if bias is not None:
                _accumulate(bias, grad_b)

        store.closures.append(deferred)
        return grad_x, None, None


def _zb_forward(self, x):
    return _ZBLinear.apply(x, self.weight, self.bias)


def enable_zero_bubble(module: nn.Module) -> nn.Module:
    """Make every ``nn.Linear`` inside ``module`` defer its weight gradient under a W-split schedule."""
    for sub in module.modules():
        if type(sub) is nn.Linear:
            sub.forward = types.MethodType(_zb_forward, sub)
    return module
