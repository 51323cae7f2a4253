"""Zero-bubble support: weight gradients as per-layer closures, run later by the W action.

During a "B" action the runner opens ``deferring(store)`` (``ops.weight_grad_store``); layers that
support it then compute only the input gradient and push a closure that computes their weight
gradient into the store, as DualPipe's WeightGradStore does. Support comes from
``enable_zero_bubble``: ``nn.Linear`` and its plain subclasses, and the parallel layers
(``layers.linear.DefersWeightGrad``: column/row-parallel linears, the MLP's and attention's
projections, with or without sequence parallelism). No autograd graph surgery, so it composes
with activation checkpointing. Layers without support simply compute their weight gradient
during B: still correct, only less of the bubble is filled.
"""
from __future__ import annotations

import types

from torch import nn

from ...layers.linear import DefersWeightGrad
from ...ops.linear import linear
from ...ops.weight_grad_store import WeightGradStore, deferring

__all__ = ["WeightGradStore", "deferring", "splits_weight_grad", "enable_zero_bubble", "check_zero_bubble"]


def _zb_forward(self, x):
    return linear(x, self.weight, self.bias)


def splits_weight_grad(module: nn.Module) -> bool:
    """Whether ``enable_zero_bubble`` can defer this module's weight gradient: a parallel layer
    (``DefersWeightGrad``), or an ``nn.Linear`` (or a subclass) that still computes
    ``F.linear(x, weight, bias)`` with parameters of its own. Subclasses that override ``forward``
    (LoRA, quantised), parametrised or weight-normed weights (tensors computed from other
    parameters) and a forward patched by someone else are left as they are: correct, only their
    weight gradient runs in B."""
    if isinstance(module, DefersWeightGrad):
        return True
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        return False
    patched = module.__dict__.get("forward")
    if patched is not None and getattr(patched, "__func__", None) is not _zb_forward:
        return False
    return isinstance(module.weight, nn.Parameter) and (module.bias is None or isinstance(module.bias, nn.Parameter))


def _hook_reducers() -> list:
    """(class, name, what reduces in its hooks) of torch's data-parallel wrappers that reduce
    gradients in backward hooks: DDP, FSDP2 (``fully_shard``'s FSDPModule), FSDP1 and composable
    DDP (``replicate``, found by name: class None)."""
    from torch.distributed import fsdp
    from torch.nn.parallel import DistributedDataParallel

    found = [(DistributedDataParallel, "DistributedDataParallel", "DDP's reduction hooks")]
    for attr, hooks in (("FSDPModule", "FSDP2's post-backward reduce-scatter"),
                        ("FullyShardedDataParallel", "FSDP's post-backward reduce-scatter")):
        if (cls := getattr(fsdp, attr, None)) is not None:  # (FSDPModule: torch >= 2.6)
            found.append((cls, attr, hooks))
    # torch's composable DDP marks the module it applies to (its class varies with the torch version)
    return found + [(None, "under replicate() (composable DDP)", "its gradient all-reduce hooks")]


def _composable_apis(module: nn.Module) -> list:
    """The names of torch's composable APIs applied to ``module`` (replicate, fully_shard)."""
    try:
        from torch.distributed._composable.contract import _get_registry
    except ImportError:
        return []
    return list(_get_registry(module) or ())


def check_zero_bubble(module: nn.Module) -> None:
    """Refuse a module that is or holds a wrapper reducing gradients in backward hooks (DDP, torch's
    FSDP2, FSDP1 or replicate()): a deferred gradient reaches ``.grad`` after backward, past those
    hooks (they see no gradient for those weights), so it is never reduced - DP replicas drift apart, and under
    FSDP every deferred gradient is lost silently. Use ``fsdp.shard`` over the stage (it reduces
    what W adds), or a 1F1B schedule."""
    reducers = _hook_reducers()
    for name, sub in module.named_modules():
        for cls, kind, hooks in reducers:
            if isinstance(sub, cls) if cls is not None else "replicate" in _composable_apis(sub):
                raise ValueError(f"{type(module).__name__}{'.' + name if name else ''} is {kind}: a W-split "
                                 f"schedule (zb-h1, zb-v) defers weight gradients past {hooks}; wrap the stage in "
                                 "overlapkernels' fsdp.shard, or use a 1F1B schedule (all-reducing gradients after "
                                 "runner.step)")


def enable_zero_bubble(module: nn.Module) -> nn.Module:
    """Make the layers inside ``module`` that can (see ``splits_weight_grad``) defer their weight
    gradients under a W-split schedule; ``PipelineRunner`` calls it for such schedules. Outside a
    B action they compute them at once, as before (``ops.linear``: double backward and torch.func
    too). Refused as ``check_zero_bubble`` says."""
    check_zero_bubble(module)
    for sub in module.modules():
        if isinstance(sub, DefersWeightGrad):
            sub.defer_weight_grad = True
        elif splits_weight_grad(sub):
            sub.forward = types.MethodType(_zb_forward, sub)
    return module
