"""4-D training of the GPT: DP x PP x CP x TP in one mesh.

Each rank builds its pipeline stage of the GPT (TP + SP inside, ring attention over CP), runs the
schedule's microbatches through ``PipelineRunner`` and takes a ZeRO step over DP
(``fsdp.shard``; stage 1 by default: gradients reduce-scattered and averaged once per step, after
the last microbatch). fsdp itself sums the partial gradients: sequence-parallel ones over TP, and, under
CP, every reduced shard over CP (the GPT tags its parameters with its CP group).
"""
from __future__ import annotations

import base64
import contextlib
import math
import numbers
import pickle
import time
import warnings

import torch
import torch.distributed as dist

from ..comm.process_world import check_pending_errors_together
from ..ops.cross_entropy import vocab_parallel_cross_entropy
from ..ops.sequence_shard import shard_sequence
from ..parallel import comm_device, concrete_device
from ..runtime import fsdp
from ..runtime import pipeline as pp
from .gpt import GPT, check_segment_ids, shard_dense_state_dict


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2)


def check_options(zero_stage, num_microbatches=None, max_grad_norm=None, grad_scaler=None, num_virtual=1,
                  lr_scheduler=None, reduce_per_microbatch=True, reduce_dtype=None) -> None:
    """The Trainer's own arguments, refused by name before anything is built (alike on every rank;
    the demo checks its options here before it starts any rank)."""
    if not isinstance(zero_stage, int) or isinstance(zero_stage, bool) or zero_stage not in (1, 2, 3):
        raise ValueError(f"zero_stage={zero_stage!r}: expected 1, 2 or 3")
    if num_microbatches is not None and (isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int)
                                         or num_microbatches < 1):  # (0 must not mean the default)
        raise ValueError(f"num_microbatches={num_microbatches!r}: expected an integer >= 1, or None for "
                         "2 x the pipeline size")
    if max_grad_norm is not None and (isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real)
                                      or not 0 < max_grad_norm < math.inf):
        raise ValueError(f"max_grad_norm={max_grad_norm!r}: expected a finite number > 0, or None (no clipping)")
    if grad_scaler is not None and not isinstance(grad_scaler, fsdp.GradScaler):
        # torch.amp.GradScaler steps an optimizer, and the sharded masters' gradients exist only in step()
        raise TypeError(f"grad_scaler={type(grad_scaler).__module__}.{type(grad_scaler).__name__}: expected an "
                        "overlapkernels.runtime.fsdp.GradScaler (the ZeRO shards are unscaled and the skip "
                        "agreed over every rank), or None")
    if isinstance(num_virtual, bool) or not isinstance(num_virtual, int) or num_virtual < 1:
        raise ValueError(f"num_virtual={num_virtual!r}: expected an integer >= 1 (chunks per pipeline rank)")
    if not isinstance(reduce_per_microbatch, bool):
        raise TypeError(f"reduce_per_microbatch={reduce_per_microbatch!r}: expected a bool")
    fsdp.check_precision_dtype("reduce_dtype", reduce_dtype)
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError(f"lr_scheduler={type(lr_scheduler).__name__}: expected a factory, callable(optimizer) -> "
                        "a torch.optim.lr_scheduler schedule (e.g. lambda opt: LambdaLR(opt, f)), or None")


def check_compile(compile, schedule, name: str) -> None:
    """Compiled blocks (``GPTConfig.compile``) with a pipeline ``schedule`` (``name``: as asked for):
    refused with a zero-bubble one, whose W would find nothing to run - a compiled block's backward
    computes its weight gradients at once (see ops/_opaque). The demo checks it here too."""
    if compile and any(a.op == "W" for acts in schedule.actions for a in acts):
        raise ValueError(f"compile={compile!r} with schedule={name!r}: a compiled block's backward computes its "
                         "weight gradients at once, so a zero-bubble W would have none to run; use 'gpipe', "
                         "'1f1b' or 'interleaved-1f1b' with compile")


def _schedule(factory, optimizer):
    """``factory(optimizer)``, refused by name unless the Trainer can step it (alike on every rank)."""
    schedule = factory(optimizer)
    if not all(callable(getattr(schedule, name, None)) for name in ("step", "state_dict", "load_state_dict")):
        raise TypeError(f"lr_scheduler returned {type(schedule).__name__}: expected a schedule with step(), "
                        "state_dict() and load_state_dict() (torch.optim.lr_scheduler's)")
    if isinstance(schedule, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TypeError("lr_scheduler returned a ReduceLROnPlateau, whose step() needs a metric the Trainer does "
                        "not have: step it yourself after trainer.step (trainer.lr_schedulers is empty without one)")
    return schedule


class Trainer:
    """The GPT trained over ``dims`` (DP x PP x CP x TP): this rank builds its pipeline stage
    (``dense_state_dict``: start from these dense weights, sharded for this rank), runs
    ``schedule`` ("gpipe", "1f1b" or "zb-h1" with one stage per rank; "interleaved-1f1b" with
    ``num_virtual`` > 1 chunks per rank, Megatron's virtual stages: chunk c of rank r is stage
    c x PP + r; "zb-v" with two chunks per rank in a V, stages r and 2 PP - 1 - r, so rank 0 holds
    the embedding and the head) over ``num_microbatches`` (default: twice the PP size), and steps ``optimizer`` (a
    factory of a stage's parameters, as ``fsdp.shard`` takes) with ZeRO over DP: ``zero_stage`` 1 (default), 2 or 3, with any of these schedules
    (DeepSpeed allows only ZeRO-1 with pipelines); 2 and 3 reduce-scatter each microbatch's
    gradients during its backward (ZB-H1 and ZB-V: after its W, with what its B left), 3 also gathers each
    unit's parameters around its forward and backward. ``step(tokens, targets)``: the global [B, S]
    batch on every rank (B divisible by dp x microbatches); returns the step's mean token loss on
    every rank. ``step(tokens, targets, segment_ids)``: rows packing documents, [B, S] ids like the
    tokens; every stage's attention stays within each document.

    ``max_grad_norm``: clip by the whole model's gradient norm (over DP, PP, CP and TP together,
    as one unsharded model would be; ``last_grad_norm`` holds it before clipping). ``grad_scaler``:
    an ``fsdp.GradScaler`` for float16 training - the loss is scaled, the gradients unscaled before
    clipping, and a step with an inf or NaN on any rank is skipped on every rank
    (``last_step_skipped``); the returned loss is the unscaled one either way.

    ``reduce_per_microbatch=False`` (ZeRO-2/3): gradients accumulate unsharded over the step's
    microbatches and are reduce-scattered once, at the step; ZeRO-3 also keeps each unit gathered
    from its first forward until the step (``ShardedModule.no_sync(reshard_after_backward=False)``
    around the whole pipeline: the two go together here). DP traffic drops from m reduce-scatters
    (and 2m all-gathers) per unit and step to one each, as torchtitan's pipelines keep FSDP2's
    parameters gathered. The price is ZeRO-1's: the stage's full gradients (and, ZeRO-3,
    parameters) held through the step, a last reduction that no backward hides, and the sum over
    microbatches made in the model's dtype unless ``reduce_dtype`` is wider (16-bit weights: a
    16-bit sum, as Megatron's default grad buffer; a scaled float16 sum also overflows sooner, so
    the ``grad_scaler`` may skip a step more) where per-microbatch reductions add up in the fp32
    masters. ZeRO-1 reduces once anyway.

    ``reduce_dtype``: fsdp's (``fsdp.shard``): with 16-bit weights, ``torch.float32`` reduces the
    gradients in fp32 and sums those that wait for a reduction (ZeRO-1, ``reduce_per_microbatch=False``)
    over the microbatches in fp32 too, ZB-H1's and ZB-V's W gradients included (None: in the weights' dtype, as
    Megatron's default grad buffer).

    ``lr_scheduler``: a factory of the optimizer's schedule (``lambda opt: LambdaLR(opt, warmup)``),
    stepped after every optimizer step taken - a step skipped for an overflow does not count, as
    in Megatron.

    A step that raises (a peer's timeout, an optimizer error) drops what it accumulated, so a
    caller that goes on trains the next step from its own gradients only.

    ``save(path)`` / ``load(path)``: the job's checkpoint (``fsdp.save``: every rank, same path, all
    of a rank's chunks; any dp size on load) with ``steps`` (training steps run, skipped ones
    included), the loss scaler's and the schedule's state.

    ``stages`` / ``chunks``: this rank's GPT stages and their ShardedModules, one per chunk;
    ``stage`` / ``sharded``: the one of a rank holding one chunk.
    """

    def __init__(self, config, dims, *, schedule: str = "1f1b", num_microbatches: int | None = None,
                 optimizer=_adamw, dtype=torch.float32, dense_state_dict: dict | None = None, device=None,
                 zero_stage: int = 1, max_grad_norm: float | None = None,
                 grad_scaler: fsdp.GradScaler | None = None, lr_scheduler=None, num_virtual: int = 1,
                 reduce_per_microbatch: bool = True, reduce_dtype: torch.dtype | None = None):
        check_options(zero_stage, num_microbatches, max_grad_norm, grad_scaler, num_virtual, lr_scheduler,
                      reduce_per_microbatch, reduce_dtype)
        self.config, self.dims = config, dims
        self.reduce_per_microbatch = reduce_per_microbatch
        # (a numpy or Fraction norm passes the check above; clipping itself takes int/float only)
        self.max_grad_norm = None if max_grad_norm is None else float(max_grad_norm)
        self.grad_scaler = grad_scaler
        self._grad_norm, self.last_step_skipped, self._losses = None, False, []
        self.steps = 0
        # NCCL moves CUDA tensors only: the stage lives on this rank's GPU there, on the CPU under gloo
        self.device = concrete_device(device) if device is not None else comm_device()
        m = 2 * dims.pp_size if num_microbatches is None else num_microbatches
        # before any stage is built: a schedule that cannot run fails alike on every rank
        self.schedule = pp.make_schedule(schedule, dims.pp_size, m, num_virtual=num_virtual)
        check_compile(config.compile, self.schedule, schedule)
        self.stages = self._build_stages(config, dims, dtype)
        for stage in self.stages if dense_state_dict is not None else ():
            stage.load_state_dict(shard_dense_state_dict(stage, dense_state_dict))
        self.chunks = [fsdp.shard(stage, dims.dp_group, stage=zero_stage, optimizer=optimizer, reduce_dtype=reduce_dtype)
                       for stage in self.stages]
        self.stage, self.sharded = (self.stages[0], self.chunks[0]) if len(self.stages) == 1 else (None, None)
        # one schedule per chunk's optimizer, stepped together (lr_scheduler: the first's)
        self.lr_schedulers = [] if lr_scheduler is None else [_schedule(lr_scheduler, c.optimizer) for c in self.chunks]
        self.runner = pp.PipelineRunner(self.chunks, dims.pp_group, schedule=self.schedule, loss_fn=self._loss)

    def _build_stages(self, config, dims, dtype) -> list:
        """This rank's GPT stage per chunk. Each GPT stage draws the whole model's random weights and
        keeps its own part, so its weights do not depend on the split; every chunk draws from the same
        starting state (the second one drew after the first's draws: weights unlike one process's for
        the same seed), and the random state then moves on as after one build."""
        sched = self.schedule  # (zb-v: two chunks per rank, num_virtual 1 or 2)
        devices = [self.device.index] if self.device.type == "cuda" else []
        stages = []
        for chunk in range(sched.num_virtual):
            last = chunk == sched.num_virtual - 1
            with contextlib.nullcontext() if last else torch.random.fork_rng(devices=devices):
                stages.append(GPT(config, dims, dtype=dtype, device=self.device,
                                  pipeline_stage=(sched.stage_of(dims.pp_rank, chunk), sched.num_stages)))
        return stages

    @property
    def lr_scheduler(self):
        """The learning-rate schedule (the first chunk's; every chunk's steps alike), or None."""
        return self.lr_schedulers[0] if self.lr_schedulers else None

    def _loss(self, logits, targets_local):
        """This microbatch's share of the step's global mean token loss. The runner divides by the
        number of microbatches and ZeRO averages over DP; both are undone here, so the summed
        gradient is exactly that of (sum of token losses) / (non-ignored tokens in the batch)."""
        per_token = vocab_parallel_cross_entropy(logits, targets_local.transpose(0, 1), self.dims.tp_group,
                                                 ignore_index=self.config.ignore_index)
        scale = self.schedule.num_microbatches * self.dims.dp_size / self._tokens
        loss = per_token.sum() * scale
        self._losses.append(loss.detach() / self.schedule.num_microbatches)  # as the runner sums them, unscaled
        return loss if self.grad_scaler is None else self.grad_scaler.scale(loss)

    def local_batch(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows (DP) and sequence part (CP) of a global [B, S] batch."""
        x = x.chunk(self.dims.dp_size, dim=0)[self.dims.dp_rank]
        if self.dims.cp_size > 1:
            x = shard_sequence(x, self.dims.cp_group, dim=1, layout=self.config.cp_layout)
        return x

    def check_batch(self, tokens: torch.Tensor, targets: torch.Tensor, segment_ids=None) -> None:
        """Every rank checks the global batch, so a bad one fails everywhere before any P2P (the
        runner alone could only check it on the first and last stages)."""
        if tokens.shape != targets.shape or tokens.dim() != 2:
            raise ValueError(f"tokens {tuple(tokens.shape)} and targets {tuple(targets.shape)} must both be [B, S]")
        check_segment_ids(segment_ids, tokens, same_device=False)  # (both go to the trainer's device)
        rows = self.dims.dp_size * self.schedule.num_microbatches
        if tokens.shape[0] % rows:
            raise ValueError(f"batch size {tokens.shape[0]} must be divisible by dp x microbatches = "
                             f"{self.dims.dp_size} x {self.schedule.num_microbatches}")
        self.stages[0].local_tokens(tokens)  # sequence split over CP (and TP under SP), max_seq_len
        self.stages[0].check_ids(tokens, targets)  # each stage's ranks see only part: checked whole here

    def step(self, tokens: torch.Tensor, targets: torch.Tensor, segment_ids: torch.Tensor | None = None) -> float:
        """One optimizer step on the global batch; returns its mean token loss on every rank."""
        self.check_batch(tokens, targets, segment_ids)
        tokens, targets = tokens.to(self.device), targets.to(self.device)
        stage_kwargs = None if segment_ids is None else {"segment_ids": self.local_batch(segment_ids.to(self.device))}
        t0 = time.perf_counter()
        first, last = any(stage.first for stage in self.stages), any(stage.last for stage in self.stages)
        self._tokens = max(1, int((targets != self.config.ignore_index).sum()))
        self._losses = []
        try:
            with contextlib.ExitStack() as accumulating:
                for chunk in self.chunks if not self.reduce_per_microbatch else ():
                    accumulating.enter_context(chunk.no_sync(reshard_after_backward=False))
                self.runner.step(self.local_batch(tokens) if first else None,
                                 self.local_batch(targets) if last else None, stage_kwargs=stage_kwargs)
            # a symm/fused call whose device wait timed out left garbage (raised a call late): not into the weights
            check_pending_errors_together(dist.group.WORLD, "Trainer.step", self.device)
            self._optimizer_step()
        except Exception as exc:  # (not Ctrl-C: its waits for reductions in flight could delay the exit)
            self._drop_gradients(exc)
            raise
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if self._losses:  # the last stage's
            value += torch.stack(self._losses).sum().double()
        # the last stage's shares, summed over CP and DP (each was scaled by dp), sent to every PP rank
        dist.all_reduce(value, group=self.dims.pp_group)
        if self.dims.cp_size > 1:
            dist.all_reduce(value, group=self.dims.cp_group)
        dist.all_reduce(value, group=self.dims.dp_group)
        self.last_step_s = time.perf_counter() - t0
        self.steps += 1
        return float(value) / self.dims.dp_size

    def save(self, path) -> None:
        """Checkpoint the weights, the optimizer's and the trainer's state (every rank, same path)."""
        scaler, schedule = self.grad_scaler, self.lr_scheduler
        state = {"steps": self.steps,
                 "grad_scaler": scaler.state_dict() if scaler is not None and scaler.is_enabled() else None,
                 # pickled: a schedule's state holds what JSON would change (MultiStepLR's Counter of int
                 # milestones came back with string keys, and the schedule never decayed)
                 "lr_scheduler": None if schedule is None else
                 base64.b64encode(pickle.dumps(schedule.state_dict())).decode("ascii")}
        fsdp.save(self.chunks, path, extra={"trainer": state})  # every chunk, in one checkpoint

    def load(self, path) -> None:
        """Resume from ``save``'s checkpoint (every rank, same path)."""
        state = fsdp.load(self.chunks, path).get("trainer")
        if state is None:  # fsdp.save's own: what it holds is loaded, the trainer's state stays as it is
            warnings.warn(f"Trainer.load: {path!r} holds no trainer state (written by fsdp.save, not Trainer.save): "
                          "weights and optimizer state loaded; steps, the loss scale and the lr schedule kept",
                          stacklevel=2)
            return
        self.steps = state["steps"]
        scaler = self.grad_scaler if self.grad_scaler is not None and self.grad_scaler.is_enabled() else None
        saved_scaler, saved_schedule = state.get("grad_scaler") or None, state.get("lr_scheduler")
        for what, mine, saved in (("loss scaler", scaler, saved_scaler), ("lr schedule", self.lr_scheduler,
                                                                         saved_schedule)):
            if (mine is None) != (saved is None):  # a silent restart of a warmup, or a lost scale
                warnings.warn(f"Trainer.load: {path!r} holds {'a' if saved is not None else 'no'} {what} state and "
                              f"this trainer has {'no' if mine is None else 'a'} {what}: "
                              + ("not loaded" if saved is not None else "it starts afresh"), stacklevel=2)
        if scaler is not None and saved_scaler is not None:
            scaler.load_state_dict(saved_scaler)
        for schedule in self.lr_schedulers if saved_schedule is not None else ():
            # (the job's own checkpoint, as torch.distributed.checkpoint's pickled metadata is)
            schedule.load_state_dict(pickle.loads(base64.b64decode(saved_schedule)))

    @property
    def last_grad_norm(self) -> float | None:
        """The last step's whole-model gradient norm before clipping (None without clipping); read
        on demand: on a GPU, a host sync."""
        return None if self._grad_norm is None else float(self._grad_norm)

    def _optimizer_step(self) -> None:
        """Unscale (if scaling), clip (if asked), then step - or skip on every rank alike. Every
        rank of the world takes part: the norm and the overflow flag span TP, PP, CP and DP."""
        scaler = self.grad_scaler
        if scaler is None:
            self._clip()
            for chunk in self.chunks:
                chunk.step()
            self.last_step_skipped = False
        else:
            try:
                scaler.unscale_(self.chunks, dims=self.dims)  # clipping needs the true norm
                self._clip()
                self.last_step_skipped = not scaler.step(self.chunks, dims=self.dims)
            except BaseException:
                scaler._abandon_step()  # else every later step would fail: "unscale_() has already been called"
                raise
            scaler.update()
        for schedule in self.lr_schedulers if not self.last_step_skipped else ():
            schedule.step()

    def _drop_gradients(self, exc: BaseException) -> None:
        """After a step that raised: what it accumulated (microbatches' gradients, reduced shards an
        optimizer error left unstepped) must not flow into the next step's update. Each rank alone
        (no collective: its peers may have failed elsewhere)."""
        for chunk in self.chunks:
            try:
                chunk.zero_grad()
            except Exception as cleanup:  # (a reduction posted to a failed peer): the step's own error comes first
                if hasattr(exc, "add_note"):  # (Python >= 3.11)
                    exc.add_note(f"Trainer.step: dropping the failed step's gradients also failed: {cleanup!r}")

    def _clip(self) -> None:
        if self.max_grad_norm is not None:
            self._grad_norm = fsdp.clip_grad_norm_(self.chunks, self.max_grad_norm, dims=self.dims)
