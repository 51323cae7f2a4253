"""ShardedModule's gradient reductions: one order on every rank, decided together.

A DP (and CP) group's reduce-scatters pair up by the order they are posted, so every rank must
post the same units' in the same order, whatever its own backward did (a data-dependent branch,
an expert that got no tokens, a unit this rank has no gradient for): the order is fixed
(``_reduce_order``) and what is left at the end of backward, or at ``step`` for stage 1 and
``no_sync`` accumulation, is agreed by one all-reduce of flags.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..._compat import eager_under_compile


class GradientReduction:
    """Mixed into ShardedModule: its ``all_units``, ``group``, ``_reduce_order``, ``_backward_done``,
    ``_next_reduce`` and ``_frozen_release`` are what it reduces and resets; ``_sync`` and
    ``_keep_gathered`` what ``no_sync`` switches. The public part: ``no_sync``,
    ``requires_gradient_sync``, ``accumulate_grads``, ``reduce_grads``."""

    @eager_under_compile
    def _reduce_in_order(self, *, to_the_end: bool = False) -> None:
        """Reduce-scatter gradients in one order on every rank (``_reduce_order``): a unit as soon as
        its backward and that of every unit before it in the order are done here; at the end of
        backward (``to_the_end``) all the rest, with zeros where this rank has no gradient. Ranks
        whose losses used different units (a data-dependent branch, an expert that got no tokens)
        thus still post the same reduce-scatters in the same order; reducing each unit when it
        happens to finish here paired one rank's reduce-scatter with another's of another unit
        (a crash or a hang, or mixed-up gradients where the sizes matched)."""
        order = self._reduce_order
        while self._next_reduce < len(order) and (to_the_end or order[self._next_reduce] in self._backward_done):
            order[self._next_reduce].reduce_grads(async_op=True)
            self._next_reduce += 1

    @contextlib.contextmanager
    def no_sync(self, *, reshard_after_backward: bool = True):
        """Accumulate gradients locally (no communication) across several backward passes.

        Stage 3 gathers each unit before its forward and again before its backward, in every
        micro-step: k micro-steps move 2k full copies of the parameters (DeepSpeed's "too many
        all-gathers" with gradient accumulation). ``reshard_after_backward=False`` keeps each unit
        gathered from its first use inside until the first forward outside (FSDP2's
        ``set_reshard_after_backward(False)``): the parameters are gathered once for all the
        micro-steps inside, plus once for the last backward, at the memory of the full parameters
        (ZeRO-2's) meanwhile. ``step`` frees them in any case, ``zero_grad`` all but the root unit.
        Nested, each applies its own ``reshard_after_backward`` inside, and the outer one's state
        comes back after it."""
        if not isinstance(reshard_after_backward, bool):
            raise TypeError(f"reshard_after_backward={reshard_after_backward!r}: expected a bool")
        outer = self._sync, self._keep_gathered  # (nested: the outer one's state comes back)
        self._sync, self._keep_gathered = False, not reshard_after_backward
        try:
            yield
        finally:
            self._sync, self._keep_gathered = outer

    @property
    def requires_gradient_sync(self) -> bool:
        """False inside ``no_sync``, whose backward passes leave their gradients to a later
        reduction; outside, a backward reduces them at stages 2/3 (stage 1 always at ``step``)."""
        return self._sync

    @eager_under_compile
    def accumulate_grads(self) -> None:
        """Take what is in the wrapped model's ``.grad`` into the sum that waits for a later
        reduction, as a backward's hooks take the gradients they see: for gradients assigned after
        a backward (a zero-bubble W's; ``PipelineRunner`` calls it after each W), which would else
        sum in ``.grad``, in the compute dtype. A no-op unless they wait (stage 1, inside
        ``no_sync``) and ``reduce_dtype`` is wider than they are. No communication."""
        if self.stage >= 2 and self._sync:
            return
        for unit in self.all_units:
            for i in range(len(unit.params)):
                unit.stash_grad(i)

    @eager_under_compile
    def reduce_grads(self) -> None:
        """Start reducing now every gradient held for a later reduction - what ``no_sync`` or
        stage 1 accumulated, what a zero-bubble W added after its backward - instead of at the
        next synced backward's end or ``step`` (which waits for it). Collective: every rank of the
        group - and of the units' CP groups, and TP groups for sequence-parallel parameters - calls
        it at the same point of its step. It first waits for the reductions it started last time,
        so back-to-back calls (ZB-H1's closing Ws) hold one set of full gradients in flight, not
        one per call. ``PipelineRunner`` calls it after each W of a stage it held in ``no_sync``
        through the B before (stages 2/3), so a microbatch's gradients are reduced once, B's and
        W's together."""
        if torch._C._current_autograd_node() is not None:  # (a hook's call: the backward's own reductions race it)
            raise RuntimeError("ShardedModule.reduce_grads() inside a backward: call it after the backward ends")
        for unit in self.all_units:  # (they overlapped whatever ran since: on CUDA a stream wait)
            unit.finish_reduce()
        self._reduce_leftovers(async_op=True)

    def _reset_backward(self) -> None:
        self._next_reduce = 0
        self._backward_done.clear()
        for unit in self.all_units:
            unit.grads_ready = 0
        self._frozen_release.reset()

    def _agree_on_gradients(self, local_flags: list) -> list:
        """Per flag (a unit's or a parameter's), whether any rank of the group (and of its CP group)
        has it set."""
        if not local_flags:  # no trained unit (a frozen model): the same on every rank, nothing to agree on
            return []
        flags = torch.tensor(local_flags, dtype=torch.int32, device=self.all_units[0].device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.group)
        # under CP a reduced shard is then summed over the CP group: its ranks must agree too, or
        # one side would wait in that sum for a peer that decided it had nothing to reduce
        for cp_group in dict.fromkeys(u.cp_group for u in self.all_units if u.cp_group is not None):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=cp_group)
        return [bool(f) for f in flags.tolist()]

    def _reduce_leftovers(self, *, async_op: bool) -> None:
        """Reduce-scatter every unit that still holds full gradients on any rank (stage 1, or
        gradients accumulated under no_sync). Decided collectively - one all-reduce of flags - so
        every rank reduces the same units in the same order; a rank with no gradient for such a
        unit reduces zeros: its DP/CP peers' collectives need a partner. The same all-reduce
        agrees, per parameter, whether any rank had a gradient for it this step (``step``)."""
        units = self.all_units
        per_param = [seen or stashed or p.grad is not None for u in units
                     for seen, stashed, p in zip(u.param_grad_seen, u.param_stashed, u.params)]
        flags = self._agree_on_gradients([u.has_full_grads() for u in units] + per_param)
        self._param_had_grad = flags[len(units):]
        for unit, flag in zip(units, flags):
            if flag:
                unit.reduce_grads(async_op=async_op)
                unit.grad_anywhere = True

    def _finish_gradients(self) -> None:
        """Every unit's reduced gradient in its master shard (idempotent within a step)."""
        self._reduce_leftovers(async_op=False)  # stage 1, or gradients accumulated under no_sync
        for unit in self.all_units:
            unit.finish_reduce()
            if not unit.grad_anywhere:  # no rank produced a gradient: the optimizer skips it, as torch does
                unit.master.grad = None
