"""Autograd helpers shared by the ops' ``torch.autograd.Function``s."""
from __future__ import annotations

import functools

import torch

from .._compat import eager_under_compile


def first_order_only(op: str, why: str = "its backward communicates, which autograd cannot differentiate"):
    """Decorates a ``backward`` whose communication autograd cannot see: building a graph of it
    (``create_graph=True``, for a second derivative) raises at once, naming ``op``.

    Why not ``torch.autograd.function.once_differentiable``: it defers the error to a node that
    runs only if the second backward reaches it, and that node hangs off the graph (detached
    outputs): with a loss linear in the op's output, or ``autograd.grad(..., inputs=...)`` /
    ``backward(inputs=...)``, autograd skips it and the second derivative silently lacks every
    term through the op. A graph of this backward is only ever built for a second derivative, so
    refusing to build it loses nothing that could be right."""
    message = f"{op}: create_graph=True (a second derivative) is not supported through it: {why}; differentiate it once"

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            if torch.is_grad_enabled() and any(ctx.needs_input_grad):  # only under create_graph=True
                raise RuntimeError(message)
            return backward(ctx, *grads)
        # eager under torch.compile, as the forwards are: a compiled step that calls backward() (and
        # compiled autograd) would otherwise trace these frames into their ProcessGroups - a hard error
        return eager_under_compile(wrapper)
    return decorate


def not_a_view(t: torch.Tensor) -> torch.Tensor:
    """``t`` (an op's final result: contiguous, internal, never seen again) as a tensor autograd does not
    mark as a view of another: ``aten._unsafe_view``, as ``torch.matmul`` returns its folded GEMM. Why:
    a module returning a view (an op's output straight from a layer without a bias) makes FSDP2 warn,
    and an in-place op on that output (``out += y``, which we allow) would drop FSDP2's pre-backward
    hook on it and skip the all-gather backward needs."""
    return torch.ops.aten._unsafe_view.default(t, t.shape)
