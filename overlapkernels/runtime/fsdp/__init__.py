"""A thin FSDP: ZeRO stages 1, 2 and 3 with overlapped prefetch, mixed precision and sharded,
atomic checkpoints (``fsdp.save`` / ``fsdp.load`` through torch.distributed.checkpoint)."""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from ...parallel import resolve_group
from .checkpoint import load, save
from .clip import clip_grad_norm_
from .grad_scaler import GradScaler
from .sharded import ShardedModule


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-3)


def check_precision_dtype(name: str, dt) -> None:
    """``param_dtype`` / ``reduce_dtype`` (``name``): None or a dtype that computes and reduces."""
    # (fp8 is floating too, but neither computes nor reduces: it failed in the first backward)
    if dt is not None and dt not in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"{name}={dt!r}: expected torch.float64, float32, float16, bfloat16 or None")


def shard(model, group=None, *, stage=3, optimizer=_adamw, prefetch=1, param_dtype=None, reduce_dtype=None,
          units=None, shard_frozen=False) -> ShardedModule:
    """Shard ``model`` over ``group``: the dp group of a ParallelDims, or the world (None) for pure
    data parallelism only - a group that also holds the model's TP or CP peers is refused.

    ``optimizer(params)`` is called once with the model's trainable parameters (in
    ``model.parameters()`` order) and returns a torch optimizer over them, param groups included
    (no weight decay for biases and norms, an lr per layer); fsdp then moves each group onto flat
    1-D shards of its parameters, which the optimizer steps from then on (param_groups.py).

    ``param_dtype`` / ``reduce_dtype``: FSDP2's mixed precision (the masters keep the model's dtype, or
    fp32 for a 16-bit model). Gradients kept for a later reduction - stage 1's, any stage's under
    ``no_sync`` - are summed over the backward passes in ``reduce_dtype`` where it is wider than
    the gradients (bf16 compute, fp32 reductions), as FSDP2 does: they leave ``.grad`` then, and
    only ``sharded.zero_grad()`` drops them (not the wrapped model's). Gradients assigned after a
    backward (a zero-bubble W's) join them through ``sharded.accumulate_grads()``; after each W
    ``PipelineRunner`` calls it, or, for the ZeRO-2/3 stages it held in ``no_sync`` through the
    B, ``sharded.reduce_grads()``. Sequence-parallel gradients are summed over their
    TP group in ``reduce_dtype`` too.

    ``shard_frozen=True`` (stage 3): frozen parameters are sharded too (a LoRA base), gathered with
    their unit and, like its trained ones, readable only inside its forward (frozen_units.py);
    otherwise every rank keeps them whole. A model with no trainable parameter at all (a distillation
    teacher, a DPO reference model) is sharded that way for inference: ``optimizer`` is not called,
    ``step`` is refused, and the model's forward - under ``no_grad`` or with gradients flowing
    through it to a trained input - gathers one unit module at a time."""
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or stage not in (1, 2, 3):
        raise ValueError(f"stage={stage!r}: expected 1, 2 or 3")
    if not callable(optimizer):
        raise TypeError(f"optimizer must be a callable taking the model's trainable parameters and returning a "
                        f"torch optimizer over them, got {type(optimizer).__name__}")
    if not isinstance(shard_frozen, bool):
        raise TypeError(f"shard_frozen={shard_frozen!r}: expected a bool")
    if shard_frozen and stage != 3:
        raise ValueError(f"shard_frozen=True with stage={stage!r}: only stage 3 shards parameters (stages 1 and 2 "
                         "keep every parameter whole on every rank)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    params = list(model.parameters())
    if not params:
        raise ValueError(f"fsdp.shard: {type(model).__name__} has no parameter: nothing to shard")
    if not shard_frozen and not any(p.requires_grad for p in params):
        raise ValueError(f"fsdp.shard: {type(model).__name__} has no trainable parameter, and with shard_frozen=False "
                         "frozen parameters stay whole on every rank: nothing would be sharded. To shard a frozen "
                         "model (a distillation teacher, a reference model) for inference: stage=3, shard_frozen=True")
    if isinstance(prefetch, bool) or not isinstance(prefetch, numbers.Integral) or prefetch < 0:
        raise ValueError(f"prefetch={prefetch!r}: expected an integer >= 0")
    for name, dt in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        check_precision_dtype(name, dt)
    if param_dtype is not None:
        _check_buffers_compute_in(model, param_dtype)
    if not dist.is_initialized():
        raise RuntimeError("fsdp.shard needs an initialised process group (ok.init_parallel())")
    group = resolve_group(group)
    return ShardedModule(model, group, stage=int(stage), optimizer=optimizer, prefetch=prefetch, param_dtype=param_dtype,
                         reduce_dtype=reduce_dtype, units=units, shard_frozen=shard_frozen)


def _check_buffers_compute_in(model, param_dtype) -> None:
    """``param_dtype`` casts parameters and inputs, not buffers: a norm computing its parameters
    with running statistics (BatchNorm, InstanceNorm tracking them) failed deep in its forward
    ("expected scalar type BFloat16 but found Float"). Refused by name here. (torch's FSDP1 keeps
    BatchNorm in full precision instead: not done here. Other modules with floating buffers - a
    RoPE cache beside projections - compute in mixed dtypes fine and are left alone.)"""
    norms = getattr(torch.nn.modules.batchnorm, "_NormBase", torch.nn.modules.batchnorm._BatchNorm)
    for name, mod in model.named_modules():
        stats = [b for b in (getattr(mod, "running_mean", None), getattr(mod, "running_var", None))
                 if torch.is_tensor(b) and b.is_floating_point() and b.dtype != param_dtype]
        if isinstance(mod, norms) and stats and any(True for _ in mod.parameters(recurse=False)):
            raise ValueError(f"param_dtype={param_dtype}: {type(mod).__name__} {name or '<model>'!r} computes its "
                             f"parameters with {stats[0].dtype} running statistics, which param_dtype does not "
                             "cast: shard without param_dtype, cast the model itself (model.to(dtype)), or use a "
                             "norm without them (GroupNorm, LayerNorm)")


__all__ = ["shard", "save", "load", "clip_grad_norm_", "GradScaler", "ShardedModule"]
