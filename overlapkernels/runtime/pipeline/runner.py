"""Executes a pipeline schedule: microbatches, activation/gradient P2P, gradient accumulation.

P2P follows ``p2p.comm_plan``: ``batch_isend_irecv`` batches posted between actions in an order
that can neither deadlock nor pair the wrong tensors under NCCL (no tags, FIFO per pair, a send
waits for its receiver); the plan of every rank is checked at construction, whose one collective
lets every rank learn that one refused its own arguments (``refuse_together``) before any P2P.
Messages also carry tags, so gloo pairs them by name. A receive is waited for when its action
needs it, sends at the end of the step, each with a timeout naming the stage, microbatch and peer. On NCCL a receive only makes the compute stream wait (a timed host wait would
stall the host until the transfer lands) and its timeout is checked at the step's end; shape
messages, which the host reads, are waited for at once, so a peer dead at a step's start is
named. One that dies mid-step can instead surface through NCCL's watchdog (the process group's
timeout) if something else syncs the host first. Only the first and last stages see the data: check batch shapes on every rank
before ``step`` (``models.train.Trainer`` does), or a middle stage learns of a bad batch only by its
timeout. Under a schedule with W actions (ZB-H1) the stage modules' linears defer their weight
gradients to W (``enable_zero_bubble``, applied here), and fsdp-sharded stages take what W adds
(``_held_until_w``). Posting, waiting for and naming the messages: ``messages.py``.
"""
from __future__ import annotations

import contextlib
import inspect
import itertools
import time
import typing

import torch
import torch.distributed as dist
from torch import nn

from ...comm.collectives import refuse_together
from ...parallel import comm_device, concrete_device, resolve_group, resolve_timeout, shared_peers, uses_nccl
from ...profiling.ranges import span
from .messages import MessageExchange
from .p2p import check_comm_plan, comm_plan
from .schedule import Schedule
from .simulate import validate
from .weight_grad import WeightGradStore, check_zero_bubble, deferring, enable_zero_bubble

def _stage_input(x: torch.Tensor) -> torch.Tensor:
    """An activation from the previous stage as a leaf whose gradient backward sends back; integer
    activations (token ids on their way to an embedding stage) take no gradient: zeros go back."""
    return x.requires_grad_() if x.is_floating_point() or x.is_complex() else x


def _stage_list(stage_module_or_modules) -> list:
    """One stage module, or a list / tuple / ``nn.ModuleList`` of this rank's virtual stages."""
    arg = stage_module_or_modules
    mods = list(arg) if isinstance(arg, (list, tuple, nn.ModuleList)) else [arg]
    for i, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(f"stage_module_or_modules[{i}]={type(mod).__name__}: expected an nn.Module or a callable")
    return mods


def _stage_device(modules, group) -> torch.device:
    for mod in modules:
        if isinstance(mod, nn.Module):
            for t in itertools.chain(mod.parameters(), mod.buffers()):
                return t.device
    # a stage with no parameters or buffers (an activation, a reshape): NCCL moves CUDA tensors only
    return comm_device(group)


def _check_sharded_over_other_stages(modules, group) -> None:
    """A stage that fsdp shards over a group holding other pipeline stages' ranks (fsdp.shard's
    default, the world) averages different stages' weights - or, at stages 2/3, hangs once their
    reduce-scatters fall at different points of the schedule: refused before any P2P."""
    from ..fsdp.sharded import ShardedModule

    for mod in modules:
        for sub in mod.modules() if isinstance(mod, nn.Module) else ():
            if isinstance(sub, ShardedModule) and (peers := shared_peers(sub.group, group)):
                raise ValueError(f"PipelineRunner: a stage is fsdp-sharded over a group that holds ranks {peers} of "
                                 "the pipeline group too (other stages: fsdp would average their weights); shard "
                                 "each stage over the data-parallel group (dims.dp_group), not the world")


class _Deferred(typing.NamedTuple):
    """What a B leaves for its W: the weight-gradient closures, and the fsdp wrappers it held."""
    store: WeightGradStore
    held: list


def _parameters(fn):
    """``fn``'s parameters by name, or None where its signature cannot be read."""
    try:
        return inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None


def _takes_any(params) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in params.values())


def _sharded_in(mod) -> list:
    """The fsdp ShardedModules in a stage module."""
    from ..fsdp.sharded import ShardedModule

    subs = mod.modules() if isinstance(mod, nn.Module) else ()
    return [sub for sub in subs if isinstance(sub, ShardedModule)]


class PipelineRunner(MessageExchange):
    """Runs ``schedule`` on this rank's stage module(s), one optimizer step's worth per ``step``.

    ``stage_module_or_modules``: this rank's stage, or with ``num_virtual`` > 1 a list (or
    ``nn.ModuleList``) of its virtual stages in order: chunk c is stage ``schedule.stage_of(rank, c)``
    (``c * num_ranks + rank``; under "zb-v" rank r's chunks are stages r and ``2 * num_ranks - 1 - r``).
    A stage maps one tensor to one tensor (the activation that crosses to the next stage: dense,
    any dtype, at most 8 dims; integer and bool ones send zeros back as their gradient, and so
    does a stage whose output does not depend on its input (``x.detach()``): the upstream
    parameters then get zero gradients where one process leaves None, so an optimizer with weight
    decay or momentum still moves them - freeze them with ``requires_grad_(False)``. Telling None
    apart would need a host read of a flag per microbatch on the receiving rank (a sync on NCCL).
    A received activation is a leaf that collects the gradient to send back: a stage must not
    change its input in place (the error says so).
    ``loss_fn(output, target)``: on the last stage, per microbatch; ``step`` divides it by the
    number of microbatches, so the gradients equal those of the whole batch's mean loss.
    ``step(inputs, targets)``: the first stage's rank passes ``inputs``, the last stage's
    ``targets`` (others None); both are split into microbatches along dim 0. ``stage_kwargs``:
    tensors every stage takes besides its input (packed documents' ``segment_ids``), given alike on
    every rank, split the same way and passed to each stage's forward by name (a name a stage's
    forward does not take, or a tensor on another device, is refused before any P2P on that rank; a
    tensor its forward then rejects fails the stage mid-step, as any stage error). Returns the mean
    microbatch loss on the last stage's rank, None elsewhere; gradients accumulate in the stage
    modules (zero them, and step the optimizer, yourself). ``timeout`` (s): a peer that does not
    answer raises ``PipelineTimeout`` naming the stage, microbatch and peer; seconds or a timedelta.
    A step that fails once it has exchanged messages leaves the runner refusing further steps (its
    messages may still be in flight under the tags the next step would reuse).
    Construction is collective over ``group`` (one small all-reduce): a rank whose own stage
    modules are refused raises its error, the others ``comm.collectives.RefusedElsewhere`` naming it
    (arguments every rank passes alike - the schedule, the loss - are refused before that).
    """

    def __init__(self, stage_module_or_modules, group=None, schedule=None, loss_fn=None, *, timeout: float = 300.0,
                 device=None):
        """``device``: where received tensors go; by default that of the stage's first parameter
        or buffer, else the current CUDA device under NCCL and the CPU otherwise."""
        self.group = resolve_group(group)
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        timeout, plan = self._check_shared(schedule, loss_fn, timeout)  # alike on every rank: no exchange
        self._splits_w = any(a.op == "W" for acts in schedule.actions for a in acts)
        error = None
        try:  # this rank's own stage modules (and device) may be refused on this rank only: every rank learns of it
            modules = self._check_stages(stage_module_or_modules, schedule)
            self.device = concrete_device(device) if device is not None else _stage_device(modules, self.group)
        except (ValueError, TypeError, RuntimeError) as exc:
            error = exc
        # an all-reduce of the whole group, so also what torch needs before a batch_isend_irecv
        # can be the group's first NCCL call (else NCCL makes communicators per pair and can hang);
        # on the group's own device (this rank's GPU under NCCL), not the stage's, which may be wrong
        refuse_together(error, self.group, "PipelineRunner", comm_device(self.group))
        self._nccl = uses_nccl(self.group)
        # gloo moves host memory only (handed a CUDA tensor it would read device addresses as host
        # ones): with CUDA stages (N ranks sharing one GPU, gloo for control) messages travel
        # through CPU copies, as comm.ring does
        self._staged = not self._nccl and self.device.type != "cpu"
        self.plan = plan[self.rank]
        if self._splits_w:
            for mod in modules:
                if isinstance(mod, nn.Module):
                    enable_zero_bubble(mod)
        self.modules = {schedule.stage_of(self.rank, chunk): mod for chunk, mod in enumerate(modules)}
        # W-split: the fsdp wrappers W hands its gradients to (see _held_until_w)
        self._sharded = {s: _sharded_in(mod) for s, mod in self.modules.items()} if self._splits_w else {}
        self._kwargs_checked: set = set()  # the sets of stage_kwargs names this rank's stages were found to take
        self.schedule, self.loss_fn, self.timeout = schedule, loss_fn, timeout
        self._posted, self._failed = False, None  # (a step that failed after posting: see step)
        self.last_stage = schedule.num_stages - 1

    def _check_shared(self, schedule, loss_fn, timeout) -> tuple:
        """Checks of what every rank passes alike (so every rank raises alike, before communicating)
        -> (the timeout in seconds, every rank's comm plan)."""
        if schedule is None or loss_fn is None:
            missing = " and ".join(name for name, v in (("schedule", schedule), ("loss_fn", loss_fn)) if v is None)
            raise ValueError(f"PipelineRunner needs schedule= (from make_schedule) and loss_fn= (a callable(output, "
                             f"target) -> loss); got None for {missing}")
        if not isinstance(schedule, Schedule):
            raise TypeError(f"schedule={schedule!r}: expected a Schedule (make_schedule(kind, num_ranks, "
                            "num_microbatches))")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn={type(loss_fn).__name__}: expected a callable(output, target) -> loss")
        if timeout is None:  # unlike torch's None (its default), a pipeline step must be able to give up
            raise TypeError("timeout=None: expected seconds (int or float) or a datetime.timedelta")
        timeout = resolve_timeout(timeout).total_seconds()
        if schedule.num_ranks != self.world:
            raise ValueError(f"schedule has {schedule.num_ranks} ranks but the pipeline group has {self.world}")
        validate(schedule)
        plan = comm_plan(schedule)
        check_comm_plan(schedule, plan)  # every rank checks every rank's plan: all fail alike, before any P2P
        return timeout, plan

    def _check_stages(self, stage_module_or_modules, schedule) -> list:
        """Checks of this rank's own stage modules, which may fail here only -> the modules."""
        modules = _stage_list(stage_module_or_modules)
        _check_sharded_over_other_stages(modules, self.group)
        if len(modules) != schedule.num_virtual:
            raise ValueError(f"{len(modules)} stage modules on this rank, the schedule has {schedule.num_virtual} "
                             "per rank")
        for mod in modules if self._splits_w else ():  # (enabled only once every rank agreed)
            if isinstance(mod, nn.Module):
                check_zero_bubble(mod)
        return modules

    # -- the step -----------------------------------------------------------------------------
    def step(self, inputs=None, targets=None, *, stage_kwargs=None):
        """Run one schedule; returns the mean microbatch loss on the last stage, None elsewhere.
        Gradients accumulate in the stage modules (equal to the full batch's)."""
        if self._failed is not None:
            raise RuntimeError(f"PipelineRunner: an earlier step failed after it had started exchanging messages "
                               f"({self._failed}); its messages may still be in flight, and this step's would pair "
                               "with them (same tags): build a new runner over new process groups, or restart the job")
        m = self.schedule.num_microbatches
        has_first, has_last = 0 in self.modules, self.last_stage in self.modules
        for name, t, needed in (("inputs", inputs, has_first), ("targets", targets, has_last)):
            if needed and t is None:
                raise ValueError(f"the {'first' if name == 'inputs' else 'last'} stage's rank must pass {name}")
            if t is not None and not torch.is_tensor(t):
                raise TypeError(f"{name}={type(t).__name__}: expected a tensor (microbatches split on dim 0)")
            if t is not None and (t.dim() == 0 or t.shape[0] % m):
                raise ValueError(f"{name}.shape={tuple(t.shape)}: dim 0 must be divisible by {m} microbatches")
        stage_kwargs = self._check_stage_kwargs(stage_kwargs, m)
        inputs_mb = inputs.chunk(m) if has_first else None
        targets_mb = targets.chunk(m) if has_last else None
        kwargs_chunks = {name: t.chunk(m) for name, t in stage_kwargs.items()}
        self._kwargs_mb = [{name: chunks[mb] for name, chunks in kwargs_chunks.items()} for mb in range(m)]
        self._sends, self._unconfirmed, self._inbox, self._outbox = [], [], {}, {}
        self._posted = False
        # Shapes cross each boundary once per step, not once per runner: a middle stage never sees
        # the batch, so only a message can tell it that this step's batch (a sequence length, a
        # last smaller batch) differs from the previous one; a cache would misread it. 80 bytes.
        self._shapes = {}
        state, stores, losses = {}, {}, []
        self.compute_s = {"F": 0.0, "B": 0.0, "W": 0.0, "BW": 0.0}  # time in module compute, per op kind
        self._events = []
        step_start = time.perf_counter()
        try:
            with span(f"ok/pipeline[{self.schedule.kind}]"):  # op window: P2P vs the stages' compute
                for k, a in enumerate(self.schedule.actions[self.rank]):
                    self._post_point(self.plan[k])
                    with span(f"ok/pipeline/{a}"):
                        self._run_action(a, inputs_mb, targets_mb, state, stores, losses)
                self._post_point(self.plan[-1])
                for work, msg in self._sends + self._unconfirmed:  # sends: done once their peers received
                    self._confirm(work, msg)
        except BaseException as exc:
            # receives this rank posted (and peers' sends) outlive the step under the tags the next
            # step reuses: a retry would compute with the failed step's messages, so there is none
            if self._posted:
                self._failed = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
            raise
        finally:
            # nothing of this step outlives it (the next step would otherwise start with its tensors held)
            self._sends, self._unconfirmed, self._inbox, self._outbox, self._kwargs_mb = [], [], {}, {}, []
        if self._events:  # CUDA: the step's kernels are done before its time is read
            self._events[-1][2].synchronize()
            for op, start, end in self._events:
                self.compute_s[op] += start.elapsed_time(end) / 1e3
        self.step_s = time.perf_counter() - step_start
        return torch.stack(losses).sum() if has_last else None

    def _check_stage_kwargs(self, stage_kwargs, m: int) -> dict:
        """-> the stage_kwargs as a dict ({} for None). Tensors splitting into ``m`` microbatches, on
        the stages' device, under names this rank's stages take (read from their forwards'
        signatures, once per set of names): refused here, before any P2P, not in a stage's forward
        mid-step. Refused on this rank only, as a bad ``inputs`` is: its peers stop at the runner's
        timeout, naming it (an agreement among the ranks, a collective, would hang where ranks pass
        different names; they must pass the same)."""
        if stage_kwargs is None:
            return {}
        if not isinstance(stage_kwargs, dict):
            raise TypeError(f"stage_kwargs={type(stage_kwargs).__name__}: expected a dict of name -> tensor")
        for name, t in stage_kwargs.items():
            if not torch.is_tensor(t) or t.dim() == 0 or t.shape[0] % m:
                raise ValueError(f"stage_kwargs[{name!r}]: expected a tensor whose dim 0 is divisible by {m} "
                                 f"microbatches, got {tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}")
            if t.device != self.device:
                raise ValueError(f"stage_kwargs[{name!r}] is on {t.device} but the stages run on {self.device}")
        names = frozenset(stage_kwargs)
        if not names or names in self._kwargs_checked:
            return stage_kwargs
        from ..fsdp.sharded import ShardedModule

        for s, module in self.modules.items():
            forward = getattr(module, "forward", module)
            params = _parameters(forward)
            if isinstance(module, ShardedModule) and params is not None and _takes_any(params):
                params = _parameters(module.module.forward)  # (fsdp.shard's wrapper hands every argument on)
            if params is None or _takes_any(params):  # no signature to read, or **kwargs: its forward will say
                continue
            missing = sorted(n for n in names if n not in params or params[n].kind is inspect.Parameter.POSITIONAL_ONLY)
            if missing:
                raise TypeError(f"stage {s}: its forward takes no keyword argument {missing} (stage_kwargs)")
        self._kwargs_checked.add(names)
        return stage_kwargs

    def _run_action(self, a, inputs_mb, targets_mb, state, stores, losses) -> None:
        """One F, B, BW or W: take what it needs, compute, leave what it made for the next batch."""
        m = self.schedule.num_microbatches
        s, mb = a.stage, a.microbatch
        if a.op == "F":
            if s == 0:
                x = inputs_mb[mb]
            elif self.schedule.rank_of(s - 1) == self.rank:
                x = _stage_input(state[(s - 1, mb)]["out"].detach())
            else:
                x = _stage_input(self._take("activation", s - 1, mb))
            with self._timed("F"):
                out = self._forward(s, mb, x)
                if s == self.last_stage:
                    out = self.loss_fn(out, targets_mb[mb]) / m
                    losses.append(out.detach())
            if s != self.last_stage and not torch.is_tensor(out):
                raise TypeError(f"stage {s} microbatch {mb}: the stage returned {type(out).__name__}; a pipeline stage "
                                "passes one tensor to the next (concatenate, or pack extra outputs into it)")
            if s != self.last_stage and self.schedule.rank_of(s + 1) != self.rank:
                self._send_later("activation", s, mb, out.detach())
            state[(s, mb)] = {"x": x, "out": out}
        elif a.op in ("B", "BW"):
            st = state.pop((s, mb))
            if s == self.last_stage:
                grad = None
            elif self.schedule.rank_of(s + 1) == self.rank:
                grad = state.pop(("grad", s, mb))
            else:
                grad = self._take("gradient", s, mb)
            if a.op == "B":
                stores[(s, mb)] = _Deferred(WeightGradStore(), self._held_until_w(s))
            if st["out"].requires_grad:  # not so for a first stage without parameters
                with contextlib.ExitStack() as backward:
                    if a.op == "B":
                        backward.enter_context(deferring(stores[(s, mb)].store))
                        for sharded in stores[(s, mb)].held:
                            backward.enter_context(sharded.no_sync())
                    backward.enter_context(self._timed(a.op))
                    torch.autograd.backward(st["out"], grad)
            if s > 0:
                # an output that does not depend on the input sends a zero gradient, not none
                grad_x = st["x"].grad if st["x"].grad is not None else torch.zeros_like(st["x"])
                if self.schedule.rank_of(s - 1) == self.rank:
                    state[("grad", s - 1, mb)] = grad_x
                else:
                    self._send_later("gradient", s - 1, mb, grad_x)
        else:  # W
            store, held = stores.pop((s, mb))
            with self._timed("W"):
                store.run()
            for sharded in self._sharded.get(s, ()):
                if sharded in held:  # B's gradients and W's, one reduction (async: overlaps what follows)
                    sharded.reduce_grads()
                else:  # reduced later: summed with the rest in reduce_dtype, not in .grad
                    sharded.accumulate_grads()

    def _held_until_w(self, s: int) -> list:
        """The ShardedModules of stage ``s`` whose B runs in ``no_sync``: a W-split schedule's W adds
        weight gradients after B's backward, which at ZeRO-2/3 would reduce them only at the next
        backward's end or the step (m + 1 reductions per unit and step); held, each is reduced
        after W, with what B left (and what earlier Bs whose W comes later left: at most m). Not
        those in the caller's own no_sync. Found when the runner is built: a stage wrapped in
        ``fsdp.shard`` after that is reduced as without a runner (W's gradients a backward late)."""
        return [sharded for sharded in self._sharded.get(s, ()) if sharded.stage >= 2 and sharded.requires_gradient_sync]

    def _forward(self, s: int, mb: int, x):
        try:
            return self.modules[s](x, **self._kwargs_mb[mb])
        except RuntimeError as exc:
            # a received activation is a leaf (its .grad is what backward sends upstream), and autograd
            # refuses in-place ops on those; say so, not just autograd's words (one process would run it)
            if s > 0 and x.is_leaf and x.requires_grad and "leaf Variable that requires grad" in str(exc):
                raise RuntimeError(f"stage {s} microbatch {mb}: the stage modifies its input in place (e.g. "
                                   "ReLU(inplace=True) or an in-place add as its first op); its input is the "
                                   f"activation received from stage {s - 1}, a leaf that collects the gradient "
                                   "sent back: make that first op out of place") from exc
            raise

    @contextlib.contextmanager
    def _timed(self, op: str):
        """Adds the enclosed compute to ``compute_s[op]``: host time on CPU; on CUDA a pair of
        events read at the step's end (host time there would mostly be kernel launches)."""
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            stream = torch.cuda.current_stream(self.device)  # the stage's, whatever device is current
            start.record(stream)
            yield
            end.record(stream)
            self._events.append((op, start, end))
        else:
            t = time.perf_counter()
            yield
            self.compute_s[op] += time.perf_counter() - t
