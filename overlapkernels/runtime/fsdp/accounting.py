"""ShardedModule's accounting (ZeRO's memory and traffic figures) and the walk over a unit's output."""
from __future__ import annotations

import dataclasses

import torch


def each_tensor(value, fn, depth: int = 0) -> None:
    """``fn(t)`` for every tensor in a unit's output: inside dicts, lists, tuples (named too), sets
    and dataclasses, which pytree takes for leaves. Read in place, never rebuilt (torch FSDP's
    ``_apply_to_tensors`` rebuilds dataclasses with ``replace``, which refuses init=False fields)."""
    if torch.is_tensor(value):
        fn(value)
    elif depth > 32:  # a self-referencing output: enough
        return
    elif isinstance(value, dict):
        for v in value.values():
            each_tensor(v, fn, depth + 1)
    elif isinstance(value, (list, tuple, set, frozenset)):
        for v in value:
            each_tensor(v, fn, depth + 1)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            each_tensor(getattr(value, field.name, None), fn, depth + 1)


class Accounting:
    """Mixed into ShardedModule: its units (``saved_units``, ``all_units``, ``roots``), ``stage`` and
    ``optimizer`` are what it counts."""

    def _track(self) -> None:
        gathered = sum(u.flat_bytes for u in self.saved_units if u.gathered or u.pending_gather is not None)
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, gathered)

    def memory_stats(self) -> dict:
        """Bytes this rank keeps between steps (ZeRO's accounting) and the peak of gathered params."""
        stage = self.stage
        full_params = sum(u.flat_bytes for u in self.all_units if stage < 3 or u in self.roots)
        # (a master that is the flat buffer's own shard, stages 1/2 in one dtype, is not kept twice)
        master = sum(u.master.numel() * u.master.element_size() for u in self.all_units if not u.master_in_flat)
        frozen = sum(u.master.numel() * u.master.element_size() for u in self.saved_units if not u.trained)
        in_units = {id(p) for u in self.saved_units for p in u.params}
        whole = {id(p): p for p in self.module.parameters() if not p.requires_grad and id(p) not in in_units}
        frozen += sum(p.numel() * p.element_size() for p in whole.values())  # kept whole on every rank
        master_grads = sum(u.master.numel() * u.master.element_size() for u in self.all_units)
        full_grads = sum(u.padded * torch.empty((), dtype=u.reduce_dtype).element_size() for u in self.all_units)
        states = self.optimizer.state.values() if self.optimizer is not None else ()  # (None: a frozen model)
        optim = sum(t.numel() * t.element_size() for state in states
                    for t in state.values() if torch.is_tensor(t) and t.dim() > 0)
        return {"param_bytes": full_params + master + frozen, "grad_bytes": full_grads if stage == 1 else master_grads,
                "optim_bytes": optim, "peak_gathered_param_bytes": self.peak_gathered_bytes}

    def comm_stats(self, reset: bool = False) -> dict:
        """Bytes of full buffers all-gathered / reduce-scattered since start (or the last reset),
        comparable with ZeRO's per-step volume: 2 Psi for stages 1-2, 3 Psi for stage 3."""
        stats = {"gathered_bytes": sum(u.bytes_gathered for u in self.saved_units),
                 "reduced_bytes": sum(u.bytes_reduced for u in self.saved_units)}
        if reset:
            for u in self.saved_units:
                u.bytes_gathered = u.bytes_reduced = 0
        return stats
