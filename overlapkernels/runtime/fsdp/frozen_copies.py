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
forward that runs outside the root's - activation checkpointing's recompute of a block during
backward, a submodule called directly - casts too. (A checkpointed closure of a *parent* that reads
a child's frozen weight recomputes outside both and meets the original: not supported.) The copies
are made per forward, one per parameter however many modules hold it, not cached across forwards:
autograd keeps a copy as long as backward needs it, and a cache would hold one more copy of the
base between steps and go stale when the original changes (``fsdp.load``). The cost: while a root
forward runs, a ``param_dtype`` copy of every such frozen parameter is alive.

Only the usual floating dtypes (fp64/fp32/fp16/bf16) are cast: a frozen fp8 weight is read by code
that wants it as it is. A forward that writes a shadowed parameter in place (an EMA codebook kept
as a frozen Parameter) has the write copied back to the original, with a warning.
"""
from __future__ import annotations

import warnings

import torch
from torch import nn

CAST_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


class FrozenComputeCopies:
    def __init__(self, model: nn.Module, dtype: torch.dtype, sharded: set = frozenset()):
        """``sharded``: ids of frozen parameters stage 3 shards (gathered in ``dtype``: no copies)."""
        self.dtype = dtype
        self.holders: dict[nn.Module, list[str]] = {}
        for mod in model.modules():
            names = [name for name, p in mod._parameters.items() if p is not None and not p.requires_grad
                     and p.dtype in CAST_DTYPES and p.dtype != dtype and id(p) not in sharded]
            if names:
                self.holders[mod] = names
        # per module, the (name, copy, its version) each open forward shadowed; the root's frames
        # last for its whole forward, and copies made in one are shared by every holder of a parameter
        self._frames: dict[int, list[list]] = {}
        self._root_copies: dict[int, torch.Tensor] | None = None
        for mod in self.holders:
            mod.register_forward_pre_hook(lambda m, args: self._shadow(m))
            mod.register_forward_hook(lambda m, args, out: self._unshadow(m), always_call=True)
        if self.holders:
            model.register_forward_pre_hook(lambda m, args: self.shadow_all())
            model.register_forward_hook(lambda m, args, out: self.unshadow_all(), always_call=True)

    def _copy_of(self, param: nn.Parameter) -> torch.Tensor:
        if self._root_copies is None:
            return param.detach().to(self.dtype)
        if id(param) not in self._root_copies:
            self._root_copies[id(param)] = param.detach().to(self.dtype)
        return self._root_copies[id(param)]

    def _shadow(self, mod: nn.Module) -> None:
        frame = []
        self._frames.setdefault(id(mod), []).append(frame)  # first: whatever is written gets undone
        for name in self.holders[mod]:
            if name not in mod.__dict__:  # an enclosing forward (the root's) has shadowed it already
                copy = self._copy_of(mod._parameters[name])
                frame.append((name, copy, copy._version))
                mod.__dict__[name] = copy

    def _unshadow(self, mod: nn.Module) -> None:
        stack = self._frames.get(id(mod))
        for name, copy, version in stack.pop() if stack else ():
            if mod.__dict__.pop(name, None) is copy and copy._version != version:
                original = mod._parameters[name]
                with torch.no_grad():
                    original.copy_(copy)
                warnings.warn(f"fsdp param_dtype: the forward of {type(mod).__name__} wrote its frozen parameter "
                              f"{name!r} in place while it computed as a {self.dtype} copy; the write was copied back "
                              f"to the {original.dtype} original (rounded through {self.dtype})", stacklevel=2)

    def shadow_all(self) -> None:
        if self._root_copies is None:  # an outermost root forward: nothing of an earlier one may remain
            for mod, names in self.holders.items():  # (a forward stopped by a BaseException, or compiled:
                for name in names:                   # torch then skips always_call hooks)
                    mod.__dict__.pop(name, None)
            self._frames.clear()
            self._root_copies = {}
        for mod in self.holders:
            self._shadow(mod)

    def unshadow_all(self) -> None:
        for mod in self.holders:
            self._unshadow(mod)
        if not any(self._frames.values()):
            self._root_copies = None
