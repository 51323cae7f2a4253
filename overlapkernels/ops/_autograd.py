"""Autograd helpers shared by the ops' ``torch.autograd.Function``s."""
from __future__ import annotations

import functools

import torch


def first_order_only(op: str):
    """Decorates a ``backward`` whose communication autograd cannot see: a second derivative
    through it raises, naming ``op``, instead of returning one that misses the communication.

    Why not ``torch.autograd.function.once_differentiable``: it guards only when an incoming
    gradient requires grad, so under ``create_graph=True`` a loss linear in the op's output (or a
    loss op first in backward) got the first-order gradient as a constant, and the second order
    silently lost every term through it. Here any input that needs a gradient is enough."""
    message = (f"{op}: a second derivative through it is not supported (its backward communicates, which "
               "autograd cannot differentiate); differentiate it once").encode()

    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not torch.is_grad_enabled() or not any(ctx.needs_input_grad):  # no graph of backward is built
                return outputs
            single = not isinstance(outputs, tuple)
            outputs = (outputs,) if single else outputs
            error = torch._C._functions.DelayedError(message, len(outputs))
            # the outputs pass through a node that raises when differentiated: each needs
            # requires_grad for the node to be in the graph
            wrapped = error(*[None if o is None else o.detach().requires_grad_() for o in outputs])
            wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
            return wrapped[0] if single else wrapped
        return wrapper
    return decorate
