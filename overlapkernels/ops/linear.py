"""``F.linear`` whose weight and bias gradients a zero-bubble B can leave to W."""
from __future__ import annotations

import torch
from torch.nn import functional as F

from .._compat import eager_under_compile
from ._autocast import autocast_dtype
from .weight_grad_store import defer


class Linear(torch.autograd.Function):
    """``out = x @ w.T + b`` with no communication (local, like ``F.linear``).

    | tensor | shape      | forward          | dgrad (backward)  | wgrad (backward, or W when deferring) |
    |--------|------------|------------------|-------------------|---------------------------------------|
    | x      | [..., K]   |                  | grad_out @ w      |                                       |
    | w      | [N, K]     | out = x @ w.T + b|                   | grad_out.T @ x (tokens flattened)     |
    | b      | [N]        |                  |                   | grad_out summed over tokens           |
    | out    | [..., N]   |                  |                   |                                       |
    """

    # forward and setup_context apart, and a generated vmap rule: torch.func (grad, vmap, jacrev)
    # transforms it as it does F.linear
    generate_vmap_rule = True

    @staticmethod
    def forward(x, weight, bias):
        return F.linear(x, weight, bias)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, weight, bias = inputs
        ctx.save_for_backward(x, weight, bias)
        ctx.grad_targets = (weight, bias)  # the parameters themselves: see weight_grad_store.defer

    @staticmethod
    @eager_under_compile
    def backward(ctx, grad_out):
        x, weight, bias = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad
        grad_x = grad_out @ weight if need_x else None
        # a frozen weight or bias (requires_grad=False) gets no gradient, as under plain autograd
        wanted = [(t, kind) for t, kind, need in zip(ctx.grad_targets, "wb", (need_w, need_b)) if need]

        def weight_grads():
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            return [g2.T @ x.reshape(-1, x.shape[-1]) if kind == "w" else g2.sum(0) for _, kind in wanted]

        # under create_graph=True (a second derivative, grad mode on in here) nothing is deferred: the
        # gradients are computed now, by ops autograd records, so a gradient penalty differentiates them
        if not torch.is_grad_enabled() and defer([t for t, _ in wanted], weight_grads):
            return grad_x, None, None
        grads = dict(zip((kind for _, kind in wanted), weight_grads()))
        return grad_x, grads.get("w"), grads.get("b")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``; inside ``ops.weight_grad_store.deferring`` its backward
    leaves the weight and bias gradients to W. Under autocast it is plain ``F.linear``: that
    computes in a lower dtype than the tensors saved here would (no split, still correct)."""
    if autocast_dtype(x.device) is not None:
        return F.linear(x, weight, bias)
    return Linear.apply(x, weight, bias)
