"""Compute copies of frozen parameters under ``param_dtype``, as FSDP2 casts them for compute only.

Frozen parameters stay out of the units: never sharded, and never cast in place, because that copy
would be their only one (checkpoints and ``full_state_dict`` would hold them rounded, and a resume
under another ``param_dtype`` would be refused). Yet a frozen fp32 base beside bf16 adapters (LoRA)
must meet bf16 activations in the forward. So while a forward runs, each such parameter is shadowed
by a cast copy: the copy goes into its module's instance ``__dict__``, which attribute lookup reads
before ``nn.Module.__getattr__`` reaches ``_parameters``. ``self.weight`` in any forward (the
module's own, or a parent's that reads it, like a tied LM head) gets the copy; ``state_dict``,
``parameters()`` and the optimizer still see the original.

Shadows are set for the whole root forward and again around each holder's own forward, so a
forward that runs outside the root's - activation checkpointing's recompute during backward, a
submodule called directly - casts too. The copy is made per forward, not cached: autograd keeps it
as long as backward needs it, and a cache would hold one more copy of the base between steps and go
stale when the original changes (``fsdp.load``).
"""
from __future__ import annotations

import torch
from torch import nn


class FrozenComputeCopies:
    def __init__(self, model: nn.Module, dtype: torch.dtype):
        self.dtype = dtype
        self.holders: dict[nn.Module, list[str]] = {}
        for mod in model.modules():
            names = [name for name, p in mod._parameters.items()
                     if p is not None and not p.requires_grad and p.is_floating_point() and p.dtype != dtype]
            if names:
                self.holders[mod] = names
        self._pushed: dict[int, list[list[str]]] = {}  # per module, the names each open forward shadowed
        for mod in self.holders:
            mod.register_forward_pre_hook(lambda m, args: self._shadow(m))
            mod.register_forward_hook(lambda m, args, out: self._unshadow(m), always_call=True)
        if self.holders:
            model.register_forward_pre_hook(lambda m, args: self.shadow_all())
            model.register_forward_hook(lambda m, args, out: self.unshadow_all(), always_call=True)

    def __bool__(self) -> bool:
        return bool(self.holders)

    def _shadow(self, mod: nn.Module) -> None:
        fresh = []
        for name in self.holders[mod]:
            if name not in mod.__dict__:  # an enclosing forward (the root's) has shadowed it already
                mod.__dict__[name] = mod._parameters[name].detach().to(self.dtype)
                fresh.append(name)
        self._pushed.setdefault(id(mod), []).append(fresh)

    def _unshadow(self, mod: nn.Module) -> None:
        stack = self._pushed.get(id(mod))
        for name in stack.pop() if stack else ():
            mod.__dict__.pop(name, None)

    def shadow_all(self) -> None:
        for mod in self.holders:
            self._shadow(mod)

    def unshadow_all(self) -> None:
        for mod in self.holders:
            self._unshadow(mod)
