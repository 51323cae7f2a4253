"""Deferred weight gradients (zero-bubble W): the store, the context that activates it, and how
an autograd Function hands a weight gradient over to it.

Here, under the ops, so that the ops' own autograd Functions (the fused TP matmuls, ``ops.linear``)
can defer without importing the pipeline runtime. Inside ``deferring(store)`` a backward that
supports it computes only the input gradient (the critical path of a pipeline B) and pushes a
closure computing the weight gradients; ``store.run()`` (the schedule's W) runs them, as
DualPipe's WeightGradStore does. Everything else computes its weight gradient at once: correct,
only less of the bubble gets filled. Outside ``deferring`` nothing changes (one context-variable
read per backward).

A deferred gradient lands in ``.grad`` as autograd's accumulation would (assigned, or added to an
existing one), but later than the parameter's hooks: during backward they still run, seeing no
gradient (``register_hook`` hooks get None, post-accumulate hooks an absent ``.grad``), and W calls
none. So hook-based reducers miss it: ``enable_zero_bubble`` refuses DDP; ``PipelineRunner`` holds
``fsdp``'s ZeRO-2/3 stages in ``no_sync`` through B and has them reduce after W
(``ShardedModule.reduce_grads``), and hands W's gradients to the others' reduce_dtype sum
(``accumulate_grads``). Compiled autograd is not supported here: it traces backward, and W would
run closures over traced tensors.
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from ._autocast import autocast_off

_store: contextvars.ContextVar = contextvars.ContextVar("overlapkernels_weight_grad_store", default=None)


class WeightGradStore:
    """The weight-gradient closures one backward deferred, in the order backward pushed them."""

    def __init__(self):
        self.closures: list = []

    def run(self) -> None:
        while self.closures:  # each taken off before it runs: after one raises, a second run() applies
            self.closures.pop(0)()  # only those left, never one twice


@contextlib.contextmanager
def deferring(store: WeightGradStore):
    """Backward passes run inside defer what they can into ``store``.

    Multithreaded backward is switched off inside: on CUDA the autograd engine runs backward on a
    thread per device, which context variables do not reach, so the Functions would never see the
    store. Single-threaded, backward runs on this thread, with the same streams."""
    token = _store.set(store)
    try:
        with torch.autograd.set_multithreading_enabled(False):
            yield store
    finally:
        _store.reset(token)


def accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    """``param.grad += grad`` as autograd's AccumulateGrad does it (a contiguous copy when none)."""
    if param.grad is None:
        param.grad = grad.detach().clone(memory_format=torch.contiguous_format)
    else:
        param.grad += grad


def _accumulated_by_this_backward(param: torch.Tensor) -> bool:
    """Will the running backward add into ``param.grad``? Not when its caller asked for other
    tensors only (``autograd.grad(loss, x)``, ``backward(inputs=[x])``): a deferred closure would
    then set a gradient the caller excluded. torch's private check, as torch.utils.checkpoint uses
    it; where a torch lacks it, True (deferred as before)."""
    try:
        return torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(param).node)
    except (AttributeError, RuntimeError):
        return True


def defer(params: list, compute) -> bool:
    """Inside ``deferring``, push a closure adding ``compute()`` (one gradient per tensor of
    ``params``, in order) to their ``.grad`` and return True; the caller's backward then returns
    None for them. Else, or if one of ``params`` is not a leaf (autograd must carry its gradient
    further, e.g. a weight cast by autocast), return False: the caller computes them now.

    ``compute`` runs at W, long after backward: it must keep what it needs (the saved input, the
    output gradient) and must not communicate, so W needs no peer to run in step.

    ``params`` must be the tensors the Function's forward received (kept on ctx), not its
    ``saved_tensors``: under activation checkpointing those unpack as recomputed, detached aliases
    of the parameters, and a gradient accumulated into an alias is lost."""
    store = _store.get()
    if store is None or not params or not all(p.is_leaf and _accumulated_by_this_backward(p) for p in params):
        return False

    def closure():
        # no_grad: a gradient, not a graph (inputs recomputed by reentrant checkpointing require
        # grad); autocast off: the dtype backward would have used, even if W runs under autocast
        with torch.no_grad(), autocast_off(params[0].device):
            grads = compute()
        for p, g in zip(params, grads, strict=True):
            accumulate(p, g)

    store.closures.append(closure)
    return True
