"""ZeRO stages 1-3 over FlatUnits: the hooks that gather, free and reduce at the right moments.

Stage 1: optimizer state sharded; full gradients reduce-scattered at ``step``; each rank updates
its shard, then all-gathers. Stage 2: + each unit's gradients reduce-scattered as soon as its
backward is done (async), full gradients dropped. Stage 3: + parameters sharded: gathered just
before a unit's forward and again before its backward, freed after each; the next ``prefetch``
units (forward order; reverse in backward) are gathered asynchronously ahead of time.

Sequence-parallel parameters (norm weights, row-parallel biases under SP) have gradients that are
partial per TP rank; each unit sums them over the parameter's ``sequence_parallel_group`` tag
before reducing over DP; under context parallelism each reduced shard is then summed over the
units' ``context_parallel_group`` (CP peers own the same shard). Mixed precision as in torch FSDP2:
with ``param_dtype`` the floating inputs of the wrapped model are cast to it, so callers can keep
feeding fp32; frozen parameters are not cast in place: each forward computes with a cast copy of
those in another dtype (``frozen_copies.py``), as FSDP2 does - or, at stage 3 with
``shard_frozen``, they are sharded in units of their own and gathered cast (``frozen_units.py``).

At stages 2/3 a unit reduces once its backward and those before it in one fixed order are done,
and what is left at the end of backward by a collective decision (``reduction.py``), so ranks whose
code paths differ (a data-dependent branch, an expert that got no tokens, unused parameters) still
post the same reductions; ``step`` leaves a parameter no rank had a gradient for as it was, with
its optimizer state. Stage 3 also gathers a unit when its forward starts, so there every rank of
the DP (and CP) group must run the same units' forwards, as with FSDP2 and ZeRO-3: a rank that
skips one leaves its peers' all-gather without a partner (gloo aborts on the size mismatch, or the
group's timeout ends the wait).
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..._compat import eager_under_compile
from ...profiling.ranges import span
from .accounting import Accounting, each_tensor
from .flat_unit import check_unit_params
from .frozen_copies import FrozenComputeCopies
from .frozen_units import FrozenRelease, frozen_units
from .gradless import hold_gradless, restore_gradless
from .param_groups import optimizer_and_units
from .reduction import GradientReduction
from .state_guards import check_apply, check_steppable, full_state_dict, guard_optimizer_step, guard_state_dicts
from .unit_plan import (check_context_parallel_tags, check_group_holds_replicas, check_sequence_parallel_tags,
                        shared_parameters, unit_modules)


class ShardedModule(GradientReduction, Accounting, nn.Module):
    # The hooks, the end-of-backward callback and step() post collectives, resize storage and keep
    # state: eager under torch.compile (as torch's FSDP2 disables dynamo on its hooks), so a compiled
    # train step that calls backward() and step() runs them as they are, not traced.
    def __init__(self, model, group, *, stage, optimizer, prefetch, param_dtype, reduce_dtype, units,
                 shard_frozen=False):
        super().__init__()
        # the tags say which gradients are partial over TP (SP) or CP: put back any that torch
        # dropped with the Parameter objects it replaced, in containers that are not our layers
        from ...layers.tags import retag
        retag(model)
        # (the model itself is named "": a ShardedModule handed to shard again was let through)
        if (inner := next((name for name, mod in model.named_modules() if isinstance(mod, ShardedModule)), None)) \
                is not None:
            raise ValueError(f"fsdp.shard: {type(model).__name__} already holds a ShardedModule at {inner or '<model>'!r}; "
                             "shard the whole model once, and pick its units with units= (FSDP2's per-block "
                             "fully_shard is units=TransformerBlock here)")
        if stage >= 2:
            check_sequence_parallel_tags(model, stage)
        check_context_parallel_tags(model)
        check_group_holds_replicas(model, group)
        self.module, self.group, self.stage, self.prefetch = model, group, stage, prefetch
        self.param_dtype = param_dtype
        self._reading_full_state = False
        self._step_open = False  # a forward built a graph whose gradients step() has not consumed yet
        self._sync = True
        self._keep_gathered = False  # inside no_sync(reshard_after_backward=False), stage 3
        self._backward_armed = False
        self._warned_create_graph = False
        self.peak_gathered_bytes = 0
        modules = unit_modules(model, units, frozen_too=stage == 3 and shard_frozen)
        # Stage 3 frees a unit's parameters after its forward, so one that two units use (a tied
        # embedding and LM head, or a unit and the root) would be freed under the other's use: it
        # goes to the root unit, which stays gathered, as FSDP2 puts such parameters in the common
        # parent's group. At every stage, so that the units (and checkpoints) do not depend on it.
        shared = shared_parameters(model, modules)
        seen, plan = set(shared), []
        # frozen parameters stay as they are: not sharded, not given to the optimizer (as in torch)
        for name, mod in modules:
            params = [p for p in mod.parameters() if id(p) not in seen and p.requires_grad]
            seen.update(map(id, params))
            if params:
                plan.append((name, mod, params))
        rest = [p for p in model.parameters() if (id(p) not in seen or id(p) in shared) and p.requires_grad]
        for name, _, params in plan + [("<root>", model, rest)] * bool(rest):
            check_unit_params(name, params)  # all before any unit re-points its parameters
        # the user's factory sees the model's own parameters (param groups by name, shape or identity
        # work as without fsdp); each unit module is then split into one flat unit per param group it
        # holds, gathered and prefetched together (param_groups.py)
        self.optimizer, trained_units, self.roots = optimizer_and_units(
            optimizer, model, plan, rest, group, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
            share_master=stage < 3)  # (stage 3 frees the buffers)
        self.units = [u for made in trained_units for u in made]
        self.root = self.roots[0] if self.roots else None  # (the first: with one param group, the only one)
        self.all_units = self.units + self.roots  # the trained ones (gradients, optimizer)
        # stage 3 with shard_frozen: each unit module's frozen parameters in flat units of their own,
        # gathered and freed with the module's (frozen_units.py)
        frozen = frozen_units(modules, shared, group, param_dtype=param_dtype) if stage == 3 and shard_frozen else {}
        self.frozen_units = [u for made in frozen.values() for u in made]
        if self.optimizer is None and not self.frozen_units:  # (before any unit takes its parameters over)
            raise ValueError(f"fsdp.shard: {type(model).__name__} has no trainable parameter, and none of its frozen "
                             "ones lies in a unit module (a module the root calls, or one units= names): nothing "
                             "would be sharded")
        self.saved_units = self.all_units + self.frozen_units  # what checkpoints hold, by index
        by_module = {id(units[0].module): units for units in trained_units}
        self._module_units = [by_module.get(id(mod), []) + frozen.get(i, []) for i, (_, mod) in enumerate(modules)]
        self._module_units = [units for units in self._module_units if units]
        for i, units in enumerate(self._module_units):
            for unit in units:
                unit.module_index = i
        self._frozen_release = FrozenRelease(self._module_units, self._free_frozen)
        self._open_calls: dict = {}  # module index -> its forward calls' _Call, innermost last
        # the one order every rank reduce-scatters gradients in during backward (see _reduce_in_order):
        # the units' reverse (the order a transformer's backward finishes them in), the root last
        self._reduce_order = self.units[::-1] + self.roots
        self._next_reduce = 0
        self._backward_done: set = set()  # units this backward finished here (their gradients are all in)
        for unit in self.saved_units:
            unit.attach()
        # frozen parameters in another dtype compute as param_dtype copies, their originals untouched
        in_units = {id(p) for u in self.frozen_units for p in u.params}
        self._frozen_copies = FrozenComputeCopies(model, param_dtype, in_units) if param_dtype is not None else None
        self._param_unit = {id(p): (u, i) for u in self.all_units for i, p in enumerate(u.params)}  # (unit, index in it)
        model.register_forward_pre_hook(self._root_pre_forward, with_kwargs=True)
        guard_state_dicts(self)
        self._in_step = False
        guard_optimizer_step(self)
        for units in self._module_units:
            units[0].module.register_forward_pre_hook(self._pre_forward(units), with_kwargs=True)
            units[0].module.register_forward_hook(self._post_forward(units))
        # a weak reference: torch keeps post-accumulate hooks alive from C++, so a bound method would
        # make param -> hook -> self -> model -> param a cycle gc cannot see, and a dropped wrapper
        # (model, buffers, optimizer state) would never be freed
        grad_ready = weakref.WeakMethod(self._grad_ready)
        for unit in self.all_units:
            for p in unit.params:
                p.register_post_accumulate_grad_hook(lambda param: (hook := grad_ready()) and hook(param))
        if stage == 3:
            for unit in self.units + self.frozen_units:
                unit.free()
        # the masters are slices of each rank's own values (ranks that drew different initial weights
        # train a mixture): stage 3 gathers them at every forward, stages 1/2 at the first training
        # one (not here: shard() itself stays free of collectives)
        self._masters_published = stage == 3
        self._track()

    def _apply(self, fn, recurse=True):  # (.to, .half, .cuda, ...)
        check_apply(self, fn)
        return super()._apply(fn, recurse)

    # -- forward ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        with span(f"ok/fsdp[zero{self.stage}]"):  # op window: prefetched gathers vs the units' compute
            return self.module(*args, **kwargs)

    @eager_under_compile
    def _root_pre_forward(self, module, args, kwargs):
        # a hook on the wrapped model, so methods that reach its forward (GPT.loss) work too
        # stages 1/2: the first training forward (a collective, on every rank of the group, as all
        # training forwards are) reads what the optimizer trains; a rank-local no_grad forward first
        # (an eval on rank 0) neither waits for the others nor is published
        if torch._C._current_autograd_node() is None:  # (a forward that raised left its calls open)
            self._open_calls.clear()
        for unit in self.all_units:  # parameters written in place since the last publish (stages 1/2, roots)
            unit.take_written()
        if not self._masters_published and torch.is_grad_enabled():
            self._masters_published = True
            for unit in self.all_units:
                sent = unit.bytes_gathered
                unit.publish()
                unit.bytes_gathered = sent  # (comm_stats count training's traffic)
        if self.stage == 3:
            for root in self.roots:
                root.gather()
            self._track()
        if self.param_dtype is not None:
            def cast(t):
                if torch.is_tensor(t) and t.is_floating_point() and t.dtype != self.param_dtype:
                    return t.to(self.param_dtype)
                return t
            return tree_map(cast, args), tree_map(cast, kwargs)
        return None

    def _gather_with_neighbours(self, units: list, direction: int) -> None:
        """Stage 3: a unit module's flat units (one per param group), then - asynchronously, to
        overlap its compute - those of the next ``prefetch`` unit modules in ``direction`` (0: none).
        All of the module's own first: collectives of a group run in order, so one of them behind
        the prefetch would wait for it."""
        for unit in units:
            unit.gather()
        i, mods = units[0].module_index, self._module_units
        for k in range(1, self.prefetch + 1) if direction else ():
            for nxt in mods[i + direction * k] if 0 <= i + direction * k < len(mods) else ():
                nxt.gather(async_op=True)
        self._track()

    def _pre_forward(self, units: list):
        """Hooks per unit module, over its flat units."""
        index = units[0].module_index

        def hook(module, args, kwargs):
            in_backward = torch._C._current_autograd_node() is not None
            if self._backward_armed and not in_backward:
                # the last backward raised before its end-of-backward callback ran (a forward
                # during backward, as checkpointing's recompute, has a current node): re-arm it
                self._backward_armed = False
                self._reset_backward()
            if self.stage == 3:
                # no prefetch for checkpointing's recompute (in backward): the modules after it are done,
                # nothing would free them before the end of backward, and whether it gathered depended
                # on this rank's unused parameters
                self._gather_with_neighbours(units, 0 if in_backward else +1)
            if self._frozen_release.has_frozen(index):  # when its backward is done with the frozen units
                call = None  # (in backward too: a reentrant checkpoint's recompute is what backward runs)
                if torch.is_grad_enabled():
                    call, args, kwargs = self._frozen_release.watch_inputs(index, args, kwargs)
                self._open_calls.setdefault(index, []).append(call)
                return args, kwargs
            return None
        return eager_under_compile(hook)

    def _post_forward(self, units: list):
        index = units[0].module_index

        def hook(module, args, output):
            calls = self._open_calls.get(index)
            call = calls.pop() if calls else None
            if torch.is_grad_enabled():
                def arm(t):
                    if t.requires_grad:
                        t.register_hook(self._pre_backward(units, call))
                        self._step_open = True
                each_tensor(output, arm)
            # not inside backward: there a forward is checkpointing's recompute, whose saved tensors the
            # backward about to run reads (torch's early stop ends it before this hook; without early
            # stop this freed them under it); its backward, or the end of backward, frees them
            if self.stage == 3 and not self._keep_gathered and torch._C._current_autograd_node() is None:
                for unit in units:
                    unit.free(keep_shapes=self._step_open)
            return output
        return eager_under_compile(hook)

    # -- backward -----------------------------------------------------------------------------
    @eager_under_compile
    def _arm_end_of_backward(self) -> None:
        """Once per backward: flush what is left at its end (reductions, which units stepped). From a
        unit output's gradient hook or, for a model whose only trainable parameters are the root's,
        from the first gradient to land (stages 2/3 had dropped those)."""
        if not self._backward_armed:
            self._backward_armed = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _pre_backward(self, units: list, call=None):
        def hook(grad):
            self._arm_end_of_backward()
            if self.stage == 3 and torch.is_grad_enabled() and not self._warned_create_graph:
                # (grad mode is on inside a backward only under create_graph)
                self._warned_create_graph = True
                warnings.warn("fsdp stage 3: a backward with create_graph=True (a gradient penalty, double "
                              "backward): its graph reads the units' parameters after they are freed again, which "
                              "nothing re-gathers, so a backward through it fails (setStorage ... size 0); use "
                              "stage 1 or 2 for that", stacklevel=2)
            if self.stage == 3:
                self._gather_with_neighbours(units, -1)
                self._frozen_release.backward_started(units[0].module_index, call)
            return grad
        return eager_under_compile(hook)

    @eager_under_compile
    def _free_frozen(self, index: int) -> None:
        if not self._keep_gathered:
            for unit in self._module_units[index]:
                if not unit.trained:
                    unit.free(keep_shapes=True)

    @eager_under_compile
    def _grad_ready(self, param) -> None:
        self._arm_end_of_backward()  # (post-accumulate hooks run inside backward only)
        unit, index = self._param_unit[id(param)]
        if self.stage == 1 or not self._sync:  # reduced later: summed in reduce_dtype (stash_grad)
            unit.stash_grad(index)
        unit.grads_ready += 1
        if unit.grads_ready == len(unit.params):
            self._unit_backward_done(unit)

    @eager_under_compile
    def _unit_backward_done(self, unit) -> None:
        unit.grads_ready = 0
        if self.stage >= 2 and self._sync:
            self._backward_done.add(unit)
            self._reduce_in_order()  # overlaps the backward of the units before it
        if self.stage == 3 and unit not in self.roots and not self._keep_gathered:
            unit.free(keep_shapes=True)
            self._frozen_release.trained_unit_done(unit.module_index)

    @eager_under_compile
    def _end_of_backward(self) -> None:
        self._backward_armed = False
        if self.stage >= 2 and self._sync:
            self._reduce_in_order(to_the_end=True)
            # every replica must agree on whether the optimizer steps a unit: not if no rank had a
            # gradient for it this step (all reduced zeros), as torch skips a parameter whose grad is None
            seen = self._agree_on_gradients([u.grad_seen for u in self.all_units])
            for unit, anywhere in zip(self.all_units, seen):
                unit.grad_anywhere = anywhere
        self._reset_backward()
        for unit in self.units + self.frozen_units:
            # zero-bubble W may still assign gradients. Not the root: nothing gathers it again
            # before a second backward through a graph built before this one (retain_graph, two
            # losses), which would read freed memory; step() frees it
            if self.stage == 3 and not self._keep_gathered:
                unit.free(keep_shapes=True)
        for unit in self.all_units:
            unit.finish_reduce()

    # -- optimizer ----------------------------------------------------------------------------
    @eager_under_compile
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop this step's gradients everywhere: the model's ``.grad``, reductions in flight and
        the master shards' (what ``step`` does after updating). For skipping a step, e.g. on a
        non-finite loss, or after a backward that raised. Call it on every rank alike.
        ``set_to_none`` as ``nn.Module.zero_grad`` for the model's ``.grad`` (the shards' are zeroed).
        Gradients summed apart in ``reduce_dtype`` (``fsdp.shard``'s docstring) are dropped here only:
        the wrapped model's own ``zero_grad`` does not see them."""
        self.module.zero_grad(set_to_none=set_to_none)
        failed = None  # a wait that raised (a peer gone): every unit is still cleared, then it is raised
        for unit in self.all_units:
            for work, _, _ in unit.pending_reduce:  # collectives already posted: let them finish
                try:
                    if work is not None:
                        work.wait()
                except Exception as exc:
                    failed = failed or exc
            unit.pending_reduce = []
            unit.master.grad = torch.zeros_like(unit.master)
            unit.clear_grad_flags()
            unit.drop_stashed()
        # stage 3: units kept gathered (no_sync(reshard_after_backward=False), a backward that
        # raised) go back to their shards; the next forward or backward gathers them again. Not
        # the root: a backward still to come reads it without gathering it
        for unit in self.units + self.frozen_units if self.stage == 3 else ():
            unit.free(keep_shapes=True)
        self._backward_armed = False
        self._reset_backward()
        if failed is not None:
            raise failed

    def clip_grad_norm_(self, max_norm, norm_type=2.0, *, dims=None, error_if_nonfinite=False,
                        foreach=None) -> torch.Tensor:
        """Clip by the whole model's gradient norm, as torch's ``clip_grad_norm_`` unsharded; returns
        it (the same on every rank). On every rank, between backward and ``step``. ``dims`` (a
        ParallelDims): also split over TP/PP/CP (the norm spans the world, each element once); None:
        data parallelism over this group. Several ShardedModules of a rank (interleaved chunks) clip
        together with ``fsdp.clip_grad_norm_(chunks, ...)``. ``error_if_nonfinite``, ``foreach``: torch's."""
        from .clip import clip_grad_norm_  # clip.py checks its modules are ShardedModules: imports this file

        return clip_grad_norm_([self], max_norm, norm_type, dims=dims, error_if_nonfinite=error_if_nonfinite,
                               foreach=foreach)

    @eager_under_compile
    def step(self) -> None:
        """Optimizer step on the local shards, zero the gradients, re-publish the parameters.
        Parameters without a gradient on any rank are left as they were, with their optimizer
        state (as torch skips them; a step counter shared by the unit still advances)."""
        check_steppable(self)
        for unit in self.saved_units:
            # a prefetch that a forward left in flight (it skipped the unit: an early exit) reads the
            # master that the optimizer is about to update in place (the master itself where it is
            # in param_dtype): done and dropped first, as step's end would drop it
            if unit.pending_gather is not None:
                unit.free()
        for unit in self.all_units:  # a write between backward and step: what the optimizer steps from
            unit.take_written()
        self._finish_gradients()
        held = hold_gradless(self.all_units, self._param_had_grad, self.optimizer)
        self._in_step = True
        try:
            self.optimizer.step()
        except Exception:
            # the masters may be part-updated (at stages 1/2 in place, in the parameters' own shard):
            # publish them before raising, so that every rank computes with one set of parameters, and
            # ranks whose step went through are not left waiting in their publish (the same calls:
            # stage 3 publishes nothing in step)
            if self.stage < 3:
                self.publish_masters()
            raise
        finally:
            self._in_step = False
        restore_gradless(held, self.optimizer)
        for unit in self.all_units:
            unit.master.grad = torch.zeros_like(unit.master)
            unit.clear_grad_flags()
            if self.stage < 3:
                unit.publish()
        self._masters_published = True
        self._step_open = False
        if self.stage == 3:  # now nothing can assign gradients: freed parameters become size-0
            for unit in self.saved_units:
                unit.free()

    def publish_masters(self) -> None:
        """The masters, gathered into the units' full parameters where those are kept (stages 1/2,
        and units gathered at stage 3): a collective, every rank in the same order."""
        for unit in self.saved_units:
            if unit.gathered:
                unit.publish()

    def full_state_dict(self) -> dict:
        """Unsharded tensors under the keys of ``model.state_dict()``, on every rank (a collective)."""
        return full_state_dict(self)
