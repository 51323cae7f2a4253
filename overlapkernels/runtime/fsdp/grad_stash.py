"""Gradients a flat unit keeps for a later reduction (stage 1, ``no_sync``, a zero-bubble W's),
summed in ``reduce_dtype`` where that is wider than the gradients (FSDP2's accumulation of unsynced
gradients in the reduce dtype): m microbatches of bf16 gradients would otherwise be summed in bf16
before the fp32 reduction ``reduce_dtype`` asked for.

Per parameter while few of the unit's elements wait (a ZB-H1 B held until its W stashes only its
norms' gradients, its linears leaving theirs to W: a buffer of the whole unit would hold their
room from B to W); one padded buffer of the unit once half do (stage 1, ``no_sync``), which the
reduce-scatter then takes as its input - no second full copy when it is reduced.
"""
from __future__ import annotations

import torch


class GradStash:
    """Sums per parameter index of a flat unit (``offsets``, ``numels``, ``padded`` elements)."""

    def __init__(self, offsets: list, numels: list, padded: int, dtype: torch.dtype, device: torch.device):
        self.offsets, self.numels, self.padded, self.dtype, self.device = offsets, numels, padded, dtype, device
        self.numel = sum(numels)
        self.clear()

    def clear(self) -> None:
        self.sums: dict = {}  # index -> its sum ([numel], dtype); in flat mode a view of ``flat``
        self.flat = None  # the whole unit's buffer, once half its elements wait
        self.per_param_elements = 0  # elements of the per-parameter sums (before ``flat``)

    def __contains__(self, i: int) -> bool:
        return i in self.sums

    def __bool__(self) -> bool:
        return bool(self.sums)

    @property
    def held_elements(self) -> int:
        """Elements this stash holds in memory (the whole padded unit in flat mode)."""
        return self.padded if self.flat is not None else self.per_param_elements

    def add(self, i: int, grad: torch.Tensor) -> None:
        grad = grad.reshape(-1)
        if i not in self.sums and self.flat is None and 2 * (self.per_param_elements + grad.numel()) >= self.numel:
            self._to_flat()  # before this gradient's copy: never a per-parameter copy and the buffer at once
        if i in self.sums:
            self.sums[i].add_(grad)
        elif self.flat is not None:  # (a zero slice: the first add is the value, exactly)
            begin = self.offsets[i]
            self.sums[i] = self.flat[begin:begin + self.numels[i]]
            self.sums[i].add_(grad)
        else:
            self.sums[i] = grad.to(self.dtype, copy=True)
            self.per_param_elements += grad.numel()

    def _to_flat(self) -> None:
        self.flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        for i, s in self.sums.items():
            begin = self.offsets[i]
            view = self.flat[begin:begin + self.numels[i]]
            view.copy_(s)
            self.sums[i] = view
        self.per_param_elements = 0

    def take(self) -> tuple:
        """(the unit's padded buffer holding every sum, zeros elsewhere; the indices it holds); the
        stash is empty after. Per parameter, each sum is freed as it is copied in."""
        indices = set(self.sums)
        if self.flat is not None:
            flat = self.flat
        else:
            flat = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
            for i in sorted(indices):
                begin = self.offsets[i]
                flat[begin:begin + self.numels[i]].add_(self.sums.pop(i))
        self.clear()
        return flat, indices
