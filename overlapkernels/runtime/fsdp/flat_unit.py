"""One FSDP unit: its parameters as views of one flat buffer, sharded evenly over the group.

The flat buffer (compute dtype) holds every parameter of the unit back to back, padded to a
multiple of the group size; rank r owns elements [r*S, (r+1)*S) of it as the master shard, the
optimizer's parameter: fp32 for a 16-bit model (so updates smaller than a bf16 ulp are not lost),
else the model's dtype (fp64 stays fp64). Parameters stay the same ``nn.Parameter`` objects with
``.data`` viewing the flat buffer, so freeing the buffer's storage (``resize_(0)``) and gathering it
back never touches the module or the autograd graph (the trick FSDP uses); autograd's saved views
of the buffer see the storage again once it is re-gathered. Outside a training step a freed
unit's parameters are size-0 tensors (as in torch FSDP), so reading one gives an empty tensor, not
freed memory. Between a forward with autograd and ``step`` they keep their shapes over the empty
storage (``keep_shapes``): deferred weight-gradient closures (zero-bubble W) assign ``.grad`` after
backward, which torch only allows on a parameter of the gradient's shape.

At stages 1/2 (the buffer is never freed) a master in the buffer's own dtype is this rank's slice of
the buffer itself, not a copy: ZeRO's Psi of parameters, where a copy kept Psi (1 + 1/N). The
optimizer's step then writes the parameters' own shard, and ``publish`` brings the others' in.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..._compat import all_gather_single, eager_under_compile, reduce_scatter_single
from ...comm.collectives import all_reduce_coalesced
from ...profiling.ranges import span
from .grad_stash import GradStash


_WIRE_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What a collective moves: the tensor, or its bytes where a backend may lack the dtype (a frozen
    fp8 weight: gloo has no float8; an all-gather only moves bytes)."""
    return t if t.dtype in _WIRE_DTYPES else t.view(torch.uint8)


def check_unit_params(name: str, params: list) -> None:
    """What a unit of ``params`` needs: one device, one dtype, one context-parallel group. Checked for
    every unit before any re-points its parameters into a flat buffer, so a refused ``shard()``
    leaves the model as it was."""
    devices = {p.device for p in params}
    dtypes = {p.dtype for p in params}
    if len(devices) > 1 or len(dtypes) > 1:
        raise ValueError(f"unit {name!r}: parameters must share one device and dtype, got devices "
                         f"{sorted(map(str, devices))} and dtypes {sorted(map(str, dtypes))}")
    if len({getattr(p, "context_parallel_group", None) for p in params}) > 1:
        raise ValueError(f"unit {name!r}: some parameters carry a context_parallel_group and some do not (or "
                         "different ones); tag every parameter of a context-parallel model alike")


class FlatUnit:
    def __init__(self, name: str, module: nn.Module, params: list, group, *, param_dtype, reduce_dtype,
                 trained: bool = True, share_master: bool = False):
        """``params`` passed ``check_unit_params`` (ShardedModule checks every unit before building any).
        ``trained=False``: frozen parameters (stage 3, ``frozen_units.py``): the shard is kept in their
        own dtype, a plain tensor no optimizer sees, and no gradient is ever reduced.
        ``share_master``: the flat buffer is never freed (stages 1/2), so a master of its dtype may be
        its shard itself (see the module's docstring; ``master_in_flat`` says whether it is)."""
        self.name, self.module, self.params, self.group = name, module, params, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.device, self.model_dtype = params[0].device, params[0].dtype
        self.trained = trained
        self.master_dtype = torch.float32 if trained and self.model_dtype.itemsize < 4 else self.model_dtype
        self.param_dtype = param_dtype or self.model_dtype
        self.reduce_dtype = reduce_dtype or self.param_dtype
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [sum(self.numels[:i]) for i in range(len(params))]  # each parameter's start in the flat buffer
        self.numel = sum(self.numels)
        self.padded = -(-self.numel // self.world) * self.world
        self.shard_numel = self.padded // self.world
        full = self.flatten(params, self.master_dtype)
        self.flat = full.to(self.param_dtype)  # the gathered buffer the parameters view, from attach()
        if trained:  # what the optimizer updates
            shared = share_master and self.flat.dtype == self.master_dtype  # (then flat is full)
            self.master = nn.Parameter(self.local_shard(full) if shared else self.local_shard(full).clone())
            self.master.grad = torch.zeros_like(self.master)
        else:
            self.master = self.local_shard(full).clone()
        # context parallelism: each CP rank saw part of the sequence, so every gradient of a model
        # tagged ``context_parallel_group`` is partial; the unit sums its reduced shard over that
        # group (CP peers own the same shard), at any stage, before the optimizer sees it
        self.cp_group = getattr(params[0], "context_parallel_group", None)
        self.gathered = True
        self._gathered_version = self._versions()  # a write since shows as a change (take_written, free)
        self._freed_version = None  # the versions when stage 3 emptied the parameters
        self.pending_gather = None   # (work, staged shard) of an async gather in flight
        self.pending_reduce = []     # (work, output) of async reduce-scatters in flight
        self.grads_ready = 0
        self.clear_grad_flags()
        # gradients kept for a later reduction, summed in reduce_dtype (stash_grad)
        self.stash = GradStash(self.offsets, self.numels, self.padded, self.reduce_dtype, self.device)
        self.bytes_gathered = self.bytes_reduced = 0  # full-buffer bytes each collective covered

    def flatten(self, tensors: list, dtype: torch.dtype) -> torch.Tensor:
        """One tensor per parameter (shaped like it) -> the unit's padded flat layout in ``dtype``."""
        full = torch.zeros(self.padded, dtype=dtype, device=self.device)
        full[:self.numel].copy_(torch.cat([t.detach().reshape(-1) for t in tensors]))
        return full

    def local_shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's part of a tensor in the flat layout: elements [r*S, (r+1)*S) (a view)."""
        start = self.rank * self.shard_numel
        return full[start:start + self.shard_numel]

    # -- parameters ---------------------------------------------------------------------------
    def attach(self) -> None:
        """Take the module's parameters over: they view the flat buffer from now on, and fsdp sums
        their sequence- and context-parallel gradients. Apart from __init__ so that the unit
        builder does it only once nothing can fail any more (the optimizer factory is the user's
        code): a refused ``shard()`` leaves the model as it was."""
        self._view_params()
        self._gathered_version = self._versions()
        for p in self.params:  # fsdp sums these over TP itself; the layers' helper leaves them alone
            p._fsdp_sharded = True  # their gradients live in the shards: ok.clip_grad_norm_ refuses them
            if getattr(p, "sequence_parallel", False) and getattr(p, "sequence_parallel_group", None) is not None:
                p._fsdp_sums_sequence_parallel = True
            if self.cp_group is not None:  # GPT.sync_grads leaves these to fsdp
                p._fsdp_sums_context_parallel = True

    def _view_params(self) -> None:
        offset = 0
        for p, shape, n in zip(self.params, self.shapes, self.numels):
            p.data = self.flat[offset:offset + n].view(shape)
            offset += n

    def _versions(self) -> tuple:
        """The parameters' version counters (each its own: ``p.data = view`` does not share the
        buffer's), which an in-place write advances."""
        return tuple(p._version for p in self.params)

    @property
    def flat_bytes(self) -> int:
        return self.padded * self.flat.element_size()

    @property
    def master_in_flat(self) -> bool:
        """The master is this rank's shard of the flat buffer itself (not a copy of it)."""
        if self.flat.untyped_storage().nbytes() == 0:  # freed (stage 3): the master is apart
            return False
        shard = self.local_shard(self.flat)
        return self.master.data_ptr() == shard.data_ptr() and self.master.dtype == shard.dtype

    def _staged_master(self) -> torch.Tensor:
        """What an all-gather into the flat buffer sends: the master cast to ``param_dtype``. A master
        that is the buffer's own shard goes as it is: an input inside its output, at this rank's
        offset (an in-place all-gather, as NCCL documents and torch's FSDP2 sends on every backend)."""
        return self.master.detach().to(self.param_dtype)

    @eager_under_compile  # (collectives and storage resizes: see ShardedModule)
    def free(self, *, keep_shapes: bool = False) -> None:
        """Drop the gathered parameters (stage 3, between uses)."""
        self.wait_gather()
        self.take_written()  # a trained unit's forward that wrote its parameters (stage 3's free)
        # the only copy of a frozen parameter is the shard: a write into the gathered one would be lost
        written = self.gathered and not self.trained and self._versions() != self._gathered_version
        if self.gathered:
            self.flat.untyped_storage().resize_(0)
            self.gathered = False
        if not keep_shapes:
            empty = self.flat.new_empty(0)
            for p in self.params:
                p.data = empty
        self._freed_version = self._versions()  # a write into the freed parameters shows as a change
        if written:  # (after the free: the module is left usable)
            raise RuntimeError(f"fsdp unit {self.name!r}: a forward wrote its frozen parameters in place (an EMA "
                               "codebook kept as a frozen Parameter, nn.Embedding(max_norm=...)'s renorm?); sharded "
                               "(shard_frozen=True) that write is lost when the unit is freed. Keep such a tensor as "
                               "a buffer, or shard_frozen=False")

    @eager_under_compile  # (collectives and storage resizes: see ShardedModule)
    def gather(self, *, async_op: bool = False) -> None:
        """Materialise the full parameters from every rank's master shard (cast to param_dtype)."""
        if self.gathered or self.pending_gather is not None:
            if not async_op:
                self.wait_gather()
            return
        if self._freed_version is not None and self._versions() != self._freed_version:
            raise RuntimeError(f"fsdp unit {self.name!r}: its parameters were written in place while sharded (stage 3 "
                               "keeps them empty outside their module's forward: model.apply(init) after "
                               "fsdp.shard?); the write was lost. Initialise before fsdp.shard, or restore through "
                               "fsdp.load")
        self.flat.untyped_storage().resize_(self.flat_bytes)
        # an async gather's parameters view the buffer only once it has landed (wait_gather): read
        # outside the unit's forward before that, they are empty at a step's first forward (an
        # error, not a race). Later in a step (accumulation) they keep their shapes over the same
        # storage (autograd's saved views need it), so such a read is not caught: reading a unit's
        # parameters outside its forward is unsupported at stage 3, as under FSDP2
        if not async_op:
            self._view_params()
        staged = self._staged_master()
        with span(f"ok/fsdp/{self.name}/gather/comm"):
            work = all_gather_single(_wire(self.flat), _wire(staged), group=self.group, async_op=async_op)
        self.bytes_gathered += self.flat_bytes
        if async_op:
            self.pending_gather = (work, staged)
        else:
            self.gathered = True
            self._gathered_version = self._versions()

    @eager_under_compile  # (collectives and storage resizes: see ShardedModule)
    def wait_gather(self) -> None:
        if self.pending_gather is not None:
            self.pending_gather[0].wait()
            self.pending_gather = None
            self._view_params()
            self.gathered = True
            self._gathered_version = self._versions()

    # -- gradients ----------------------------------------------------------------------------
    def stashes(self, grad: torch.Tensor) -> bool:
        """Whether a gradient that waits for a later reduction (stage 1, ``no_sync``) is summed apart
        in ``reduce_dtype``: when that is wider than the gradient (bf16 parameters, fp32 reductions).
        Else ``.grad`` sums it, in its own dtype, as before."""
        return self.reduce_dtype.itemsize > grad.dtype.itemsize

    def stash_grad(self, i: int) -> None:
        """Move parameter ``i``'s ``.grad``, if any, into the stash (``grad_stash.py``: summed in
        ``reduce_dtype``) where ``stashes`` says so; the caller knows it waits for a later reduction."""
        grad = self.params[i].grad
        if grad is not None and self.stashes(grad):
            self.stash.add(i, grad)
            self.params[i].grad = None

    @property
    def param_stashed(self) -> list:
        """Per parameter: a gradient of this step is in the stash."""
        return [i in self.stash for i in range(len(self.params))]

    @eager_under_compile  # (collectives and storage resizes: see ShardedModule)
    def reduce_grads(self, *, async_op: bool) -> None:
        """Reduce-scatter the unit's full gradients (averaged over the group), those stashed and
        those in ``.grad``, into pending shards, then drop the full gradients."""
        flat_grad, stashed = self.stash.take()  # (zeros where nothing was stashed)
        sp_groups = {}  # sequence-parallel partial gradients: first summed over their TP group
        for i, (p, begin, n) in enumerate(zip(self.params, self.offsets, self.numels)):
            if i in stashed:
                self.param_grad_seen[i] = True
            if p.grad is not None:
                flat_grad[begin:begin + n].add_(p.grad.reshape(-1))
                p.grad = None
                self.param_grad_seen[i] = True
            group = getattr(p, "sequence_parallel_group", None)
            if getattr(p, "sequence_parallel", False) and group is not None:
                # every one, with a gradient here or not (zeros): the TP ranks' all-reduces then pair
                # up whatever each computed, and sum in reduce_dtype, not in the compute dtype
                sp_groups.setdefault(group, []).append(flat_grad[begin:begin + n])
        for group, grads in sp_groups.items():
            all_reduce_coalesced(grads, group)
        flat_grad.div_(self.world)  # DDP semantics: the mean over ranks
        out = torch.empty(self.shard_numel, dtype=self.reduce_dtype, device=self.device)
        with span(f"ok/fsdp/{self.name}/reduce_scatter/comm"):
            work = reduce_scatter_single(out, flat_grad, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        self.bytes_reduced += flat_grad.numel() * flat_grad.element_size()
        self.pending_reduce.append((work, out, flat_grad))
        self.grads_ready = 0

    @eager_under_compile  # (collectives and storage resizes: see ShardedModule)
    def finish_reduce(self) -> None:
        """Wait for in-flight reduce-scatters and add them to the master gradient shard."""
        if not self.pending_reduce:
            return
        total = None
        for work, out, _ in self.pending_reduce:
            if work is not None:
                work.wait()
            out = out.to(self.master_dtype)  # accumulated as the master is, never in a 16-bit reduce_dtype
            total = out if total is None else total.add_(out)
        if self.cp_group is not None:  # shards of the DP mean, partial over CP: one sum for all of them
            with span(f"ok/fsdp/{self.name}/cp_all_reduce/comm"):
                dist.all_reduce(total, group=self.cp_group)
        if self.master.grad is None:  # the optimizer's zero_grad() (set_to_none) ran since the last step
            self.master.grad = torch.zeros_like(self.master)
        self.master.grad += total
        self.pending_reduce = []

    def clear_grad_flags(self) -> None:
        self.param_grad_seen = [False] * len(self.params)  # this rank reduced a gradient for it this step
        self.grad_anywhere = False  # some rank did, for the unit (agreed): else the optimizer skips it

    def drop_stashed(self) -> None:
        """Forget the gradients ``stash_grad`` kept (``zero_grad``): none summed apart, no parameter's
        gradient in the stash."""
        self.stash.clear()

    @property
    def grad_seen(self) -> bool:
        """This rank reduced a gradient of its own for the unit this step."""
        return any(self.param_grad_seen)

    def master_slice(self, i: int) -> slice:
        """Where parameter ``i`` lies in this rank's master shard (empty if elsewhere)."""
        begin = self.offsets[i]
        start = self.rank * self.shard_numel
        lo = min(max(begin - start, 0), self.shard_numel)
        return slice(lo, max(lo, min(begin + self.numels[i] - start, self.shard_numel)))

    def has_full_grads(self) -> bool:
        return bool(self.stash) or any(p.grad is not None for p in self.params)

    def take_written(self) -> None:
        """A gathered trained unit whose parameters were written in place since the last gather or
        publish (``model.apply(init)`` after fsdp.shard, an edit between steps at stages 1/2; a
        forward's own write, as ``nn.Embedding(max_norm=...)``'s renorm, at any stage): the elements
        of this rank's shard that changed become its master's, as the write would change the
        parameters without fsdp (the next publish, or stage 3's free, dropped them silently). Only
        those: the rest of the master keeps its precision under a lower ``param_dtype``. Each rank
        takes its own shard of what it wrote. (A write through ``.data`` is not seen: no version.)"""
        if self.trained and self.gathered and self._versions() != self._gathered_version:
            if self.master_in_flat:  # the write is in the master already
                self._gathered_version = self._versions()
                return
            with torch.no_grad():
                # what the shard held before the write: the master's cast, as every gather and publish
                # sends it (fsdp.load lets a prefetch in flight land first, so none is stale)
                shard, kept = self.local_shard(self.flat), self.master.detach().to(self.param_dtype)
                changed = (shard != kept) & ~(shard.isnan() & kept.isnan())
                self.master[changed] = shard[changed].to(self.master.dtype)
            self._gathered_version = self._versions()

    @eager_under_compile  # (collectives and storage resizes: see ShardedModule)
    def publish(self) -> None:
        """After the optimizer step: the new master shards, gathered into the full parameters."""
        if self.gathered:
            all_gather_single(_wire(self.flat), _wire(self._staged_master()), group=self.group)
            self.bytes_gathered += self.flat_bytes
            self._gathered_version = self._versions()

    @eager_under_compile  # (collectives and storage resizes: see ShardedModule)
    def full_tensors(self) -> list:
        """The unit's parameters, unsharded, in the model's dtype (a collective)."""
        full = torch.empty(self.padded, dtype=self.master_dtype, device=self.device)
        all_gather_single(_wire(full), _wire(self.master.detach().contiguous()), group=self.group)
        out, offset = [], 0
        for shape, n in zip(self.shapes, self.numels):
            out.append(full[offset:offset + n].view(shape).to(self.model_dtype, copy=True))
            offset += n
        return out
