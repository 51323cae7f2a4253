"""Loss scaling for float16 training of ShardedModules: torch.amp.GradScaler's algorithm, on the
reduced gradient shards, with one decision for every rank.

torch's GradScaler cannot serve a sharded model: it unscales the gradients the optimizer's
parameters hold - here the master shards, which only ``ShardedModule.step()`` fills - and each
rank would decide alone whether to skip: an overflow lands in the shard of one rank, which would
skip while its peers step, and the replicas drift apart for good. Here the reduced shards are
unscaled in place, "found an inf or NaN" is all-reduced (MAX of a 0/1 flag: NCCL's MAX drops a
NaN) over the modules' group or, with ``dims``, the world (TP/PP/CP ranks hold other parts of
one model), and every rank then steps or skips alike. The scale's update is torch's own kernel.

    scaler = fsdp.GradScaler()
    scaler.scale(loss).backward()
    scaler.unscale_(sharded)            # optional: before clipping by the true norm
    sharded.clip_grad_norm_(1.0)
    scaler.step(sharded)                # steps, or drops the step's gradients on every rank alike
    scaler.update()
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from ...parallel import comm_device
from .clip import sharded_modules, step_group

_READY, _UNSCALED, _STEPPED = "ready", "unscaled", "stepped"


def _positive(name: str, value, *, above_one: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0 \
            or (above_one and not value > 1):
        raise ValueError(f"{name}={value!r}: expected a number {'> 1' if above_one else '> 0'}")
    return float(value)


class GradScaler:
    """``torch.amp.GradScaler``'s arguments and defaults; ``scale`` / ``unscale_`` / ``step`` /
    ``update`` / ``get_scale`` / ``state_dict`` / ``load_state_dict`` as there, except that
    ``unscale_`` and ``step`` take the ShardedModules (one, or a list: an interleaved pipeline's
    chunks) instead of an optimizer, and ``dims`` where the model is also split over TP/PP/CP.
    Every rank calls each method alike. ``enabled=False``: every method passes through."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True):
        if not isinstance(enabled, bool):
            raise TypeError(f"enabled={enabled!r}: expected a bool")
        self._init_scale = _positive("init_scale", init_scale)
        self._growth_factor = _positive("growth_factor", growth_factor, above_one=True)
        backoff = _positive("backoff_factor", backoff_factor)
        if not backoff < 1:
            raise ValueError(f"backoff_factor={backoff_factor!r}: expected a number in (0, 1)")
        self._backoff_factor = backoff
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, numbers.Integral) \
                or growth_interval < 1:
            raise ValueError(f"growth_interval={growth_interval!r}: expected an integer >= 1")
        self._growth_interval = int(growth_interval)
        self._enabled = enabled
        self._scale = None  # made on the device of the first scaled output
        self._growth_tracker = None
        self._loaded_tracker = 0  # a loaded state's, until the tensors exist
        self._found_inf = None  # this step's agreed flag (0/1, float32), once unscaled
        self._unscaled = None  # (module ids, group) that flag covers
        self._state = _READY

    def is_enabled(self) -> bool:
        return self._enabled

    def _lazy_init(self, device) -> None:
        if self._scale is None:
            self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.full((), self._loaded_tracker, dtype=torch.int32, device=device)

    def scale(self, outputs):
        """``outputs`` (a tensor, or lists/tuples of them) times the current scale."""
        if not self._enabled:
            return outputs
        if torch.is_tensor(outputs):
            self._lazy_init(outputs.device)
            return outputs * self._scale.to(outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        raise TypeError(f"outputs: expected a tensor or a list/tuple of tensors, got {type(outputs).__name__}")

    def unscale_(self, modules, *, dims=None) -> None:
        """Divide the step's reduced gradient shards by the scale, in place, and agree over every
        rank whether any of them holds an inf or NaN. Once per step, after the last backward."""
        if self._enabled:
            self._unscale(sharded_modules(modules), dims, "GradScaler.unscale_")

    def _unscale(self, mods: list, dims, op: str) -> None:
        if self._state == _UNSCALED:
            raise RuntimeError("unscale_() has already been called since the last update()")
        if self._state == _STEPPED:
            raise RuntimeError("unscale_() is being called after step(): call update() first")
        group = step_group(mods, dims, op, "unscale once", "the overflow check")
        # a rank that scaled no loss is normal (a pipeline's stages before the last): it still unscales
        # the gradients that reached it, and keeps the same scale as every rank (the same updates)
        device = comm_device(group)
        self._lazy_init(device)
        grads: dict = {}
        for m in mods:
            m._finish_gradients()
            for unit in m.all_units:
                if unit.master.grad is not None:
                    grads.setdefault(unit.master.grad.device, []).append(unit.master.grad)
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv_scale = self._scale.double().reciprocal().float().reshape(1)
        for grad_device, tensors in grads.items():
            found_here = torch.zeros(1, dtype=torch.float32, device=grad_device)
            # torch's own fused check-and-unscale (the kernel torch.amp.GradScaler runs: one launch per
            # device on CUDA); it sets found_here to 1 where any element is inf or NaN
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_here, inv_scale.to(grad_device))
            found = torch.maximum(found, found_here.to(found.device))
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=group)  # 0/1: finite, so MAX is exact everywhere
        self._found_inf = found.to(self._scale.device)
        self._unscaled = ([id(m) for m in mods], group)  # what step() may then step
        self._state = _UNSCALED

    def step(self, modules, *, dims=None) -> bool:
        """``ShardedModule.step()`` of each of ``modules`` if no rank found an inf or NaN in the
        step's gradients, else ``zero_grad()`` of each (the step skipped on every rank alike).
        Unscales first unless ``unscale_`` did. Returns whether it stepped (a host read)."""
        mods = sharded_modules(modules)
        if not self._enabled:
            for m in mods:
                m.step()
            return True
        if self._state == _STEPPED:
            raise RuntimeError("step() has already been called since the last update()")
        if self._state == _READY:
            self._unscale(mods, dims, "GradScaler.step")
        elif self._unscaled != ([id(m) for m in mods], step_group(mods, dims, "GradScaler.step", "step once",
                                                                  "the overflow check")):
            # torch tracks each optimizer; one agreed flag covers exactly what unscale_ checked
            raise RuntimeError("step(): other modules or another dims= than unscale_() was given this step; the "
                               "modules it did not unscale would step from scaled gradients, or the skip would be "
                               "agreed over another group: pass step() what was passed to unscale_()")
        stepped = not bool(self._found_inf.item())
        for m in mods:
            if stepped:
                m.step()
            else:
                m.zero_grad()
        self._state = _STEPPED
        return stepped

    def _abandon_step(self) -> None:
        """Forget this step's overflow check without touching the scale: a step that raised
        between ``unscale_`` and ``update`` (the Trainer's) leaves the next step free to start."""
        self._found_inf, self._unscaled, self._state = None, None, _READY

    def update(self, new_scale=None) -> None:
        """Back off the scale after a skipped step, grow it after ``growth_interval`` steps in a row
        (torch's kernel); or set ``new_scale`` (a number or a one-element tensor)."""
        if not self._enabled:
            return
        if new_scale is not None:
            value = float(new_scale.item() if torch.is_tensor(new_scale) else _positive("new_scale", new_scale))
            if self._scale is None:
                self._lazy_init(torch.device("cpu"))
            self._scale.fill_(value)
        else:
            if self._found_inf is None:  # (set by unscale_, which step runs where not called)
                raise RuntimeError("update() without a step(): no overflow check was recorded this step")
            torch._amp_update_scale_(self._scale, self._growth_tracker, self._found_inf,
                                     self._growth_factor, self._backoff_factor, self._growth_interval)
        self._found_inf, self._state = None, _READY

    def get_scale(self) -> float:
        """The current scale (a host read); 1.0 when disabled."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    def state_dict(self) -> dict:
        """torch.amp.GradScaler's keys: a checkpoint of either loads into the other."""
        if not self._enabled:
            return {}
        return {"scale": self.get_scale(), "growth_factor": self._growth_factor,
                "backoff_factor": self._backoff_factor, "growth_interval": self._growth_interval,
                "_growth_tracker": (self._loaded_tracker if self._growth_tracker is None
                                    else int(self._growth_tracker.item()))}

    def load_state_dict(self, state_dict: dict) -> None:
        if not self._enabled:
            return
        if not state_dict:
            raise RuntimeError("load_state_dict: the state dict is empty (saved by a disabled scaler?)")
        self._init_scale = float(state_dict["scale"])
        self._growth_factor = float(state_dict["growth_factor"])
        self._backoff_factor = float(state_dict["backoff_factor"])
        self._growth_interval = int(state_dict["growth_interval"])
        self._loaded_tracker = int(state_dict["_growth_tracker"])
        if self._scale is not None:
            self._scale.fill_(self._init_scale)
            self._growth_tracker.fill_(self._loaded_tracker)
