"""Executes a pipeline schedule: microbatches, activation/gradient P2P, gradient accumulation.

Sends are asynchronous and awaited at the end of the step; receives wait with a timeout and name
the stage, microbatch and peer when nothing comes. Every message has a tag of its own (kind,
stage, microbatch), so gloo can never pair the wrong buffers; NCCL pairs in posting order, which
these schedules keep consistent per direction. Activation shapes cross each stage boundary once
per step (a few bytes) and are cached for its microbatches, so a new batch shape is never misread.
Only the first and last stages see the data: check batch shapes on every rank before ``step``
(``models.train.Trainer`` does), or a middle stage learns of a bad batch only by its timeout.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ...parallel import resolve_group
from ...profiling.ranges import span
from .simulate import validate
from .weight_grad import WeightGradStore, deferring

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_META_LEN = 10


class PipelineTimeout(RuntimeError):
    """A peer did not send in time; names the stage, microbatch and peer rank."""


class PipelineRunner:
    def __init__(self, stage_module_or_modules, group=None, schedule=None, loss_fn=None, *, timeout: float = 300.0):
        if schedule is None or loss_fn is None:
            raise ValueError("PipelineRunner needs schedule= and loss_fn=")
        self.group = resolve_group(group)
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if schedule.num_ranks != self.world:
            raise ValueError(f"schedule has {schedule.num_ranks} ranks but the pipeline group has {self.world}")
        validate(schedule)
        modules = stage_module_or_modules if isinstance(stage_module_or_modules, (list, tuple)) else \
            [stage_module_or_modules]
        if len(modules) != schedule.num_virtual:
            raise ValueError(f"{len(modules)} stage modules on this rank, the schedule has {schedule.num_virtual} "
                             "per rank")
        self.modules = {chunk * self.world + self.rank: mod for chunk, mod in enumerate(modules)}
        self.schedule, self.loss_fn, self.timeout = schedule, loss_fn, timeout
        self.last_stage = schedule.num_stages - 1
        self._shapes: dict = {}  # stage boundary -> (shape, dtype) of the activation crossing it (per step)

    # -- point to point -----------------------------------------------------------------------
    def _tag(self, kind: int, stage: int, mb: int) -> int:
        return (kind * self.schedule.num_stages + stage) * self.schedule.num_microbatches + mb + 1

    def _peer(self, stage: int) -> int:
        return dist.get_global_rank(self.group, self.schedule.rank_of(stage))

    def _wait(self, work, what: str, stage: int, mb: int, peer_stage: int) -> None:
        try:
            ok, cause = work.wait(timedelta(seconds=self.timeout)), None
        except RuntimeError as exc:  # gloo: timed out, or the peer's connection closed
            ok, cause = False, exc
        if ok is False:
            why = str(cause).splitlines()[0][:160] if cause else "no answer"
            raise PipelineTimeout(f"stage {stage} microbatch {mb}: no {what} from rank "
                                  f"{self.schedule.rank_of(peer_stage)} (stage {peer_stage}) within "
                                  f"{self.timeout:g} s ({why})") from cause

    def _send(self, tensor, to_stage, kind, stage, mb):
        what = ("activation shape", "activation", "gradient")[kind]
        try:
            with span(f"ok/pipeline/{stage}.{mb}/send/comm"):
                work = dist.isend(tensor.contiguous(), self._peer(to_stage), self.group, self._tag(kind, stage, mb))
        except RuntimeError as exc:  # gloo: the peer's connection is gone
            raise PipelineTimeout(f"stage {stage} microbatch {mb}: cannot send {what} to rank "
                                  f"{self.schedule.rank_of(to_stage)} (stage {to_stage}) "
                                  f"({str(exc).splitlines()[0][:160]})") from exc
        self._pending.append((work, what, stage, mb, to_stage))

    def _recv(self, shape, dtype, from_stage, kind, stage, mb, what):
        buf = torch.empty(shape, dtype=dtype, device=self.device)
        with span(f"ok/pipeline/{stage}.{mb}/recv/comm"):
            work = dist.irecv(buf, self._peer(from_stage), self.group, self._tag(kind, stage, mb))
            self._wait(work, what, stage, mb, from_stage)
        return buf

    def _send_activation(self, out, stage, mb):
        if stage not in self._shapes:  # first time across this boundary: shape and dtype first
            meta = torch.zeros(_META_LEN, dtype=torch.int64)
            meta[0], meta[1] = out.dim(), _DTYPES.index(out.dtype)
            meta[2:2 + out.dim()] = torch.tensor(out.shape)
            self._send(meta.to(self.device), stage + 1, 0, stage, mb)
            self._shapes[stage] = (tuple(out.shape), out.dtype)
        self._send(out.detach(), stage + 1, 1, stage, mb)

    def _recv_activation(self, stage, mb):
        boundary = stage - 1
        if boundary not in self._shapes:
            meta = self._recv((_META_LEN,), torch.int64, boundary, 0, boundary, mb, "activation shape")
            nd = int(meta[0])
            self._shapes[boundary] = (tuple(int(v) for v in meta[2:2 + nd]), _DTYPES[int(meta[1])])
        shape, dtype = self._shapes[boundary]
        return self._recv(shape, dtype, boundary, 1, boundary, mb, "activation")

    # -- the step -----------------------------------------------------------------------------
    def step(self, inputs=None, targets=None):
        """Run one schedule; returns the mean microbatch loss on the last stage, None elsewhere.
        Gradients accumulate in the stage modules (equal to the full batch's)."""
        m = self.schedule.num_microbatches
        has_first, has_last = 0 in self.modules, self.last_stage in self.modules
        if has_first and inputs is None:
            raise ValueError("the first stage's rank must pass inputs")
        if has_last and targets is None:
            raise ValueError("the last stage's rank must pass targets")
        for name, t in (("inputs", inputs), ("targets", targets)):
            if t is not None and t.shape[0] % m:
                raise ValueError(f"{name}.shape[0]={t.shape[0]} is not divisible by {m} microbatches")
        self.device = next(iter(self.modules.values())).parameters().__next__().device
        inputs_mb = inputs.chunk(m) if has_first else None
        targets_mb = targets.chunk(m) if has_last else None
        self._pending, state, stores, losses = [], {}, {}, []
        self._shapes = {}  # one shape message per boundary per step: a new batch shape is always seen
        self.compute_s = {"F": 0.0, "B": 0.0, "W": 0.0, "BW": 0.0}  # time in module compute, per op kind
        step_start = time.perf_counter()
        with span(f"ok/pipeline[{self.schedule.kind}]"):  # op window: P2P vs the stages' compute
            for a in self.schedule.actions[self.rank]:
                with span(f"ok/pipeline/{a}"):
                    self._run_action(a, inputs_mb, targets_mb, state, stores, losses)
            for work, what, stage, mb, to_stage in self._pending:  # sends: done once their peers received
                with span(f"ok/pipeline/{stage}.{mb}/send/comm"):
                    self._wait(work, f"receipt of the {what}", stage, mb, to_stage)
        self.step_s = time.perf_counter() - step_start
        return torch.stack(losses).sum() if has_last else None

    def _run_action(self, a, inputs_mb, targets_mb, state, stores, losses) -> None:
        """One F, B, BW or W: receive what it needs, compute, send what it made."""
        m = self.schedule.num_microbatches
        s, mb = a.stage, a.microbatch
        if a.op == "F":
            if s == 0:
                x = inputs_mb[mb]
            elif self.schedule.rank_of(s - 1) == self.rank:
                x = state[(s - 1, mb)]["out"].detach().requires_grad_()
            else:
                x = self._recv_activation(s, mb).requires_grad_()
            t_op = time.perf_counter()
            out = self.modules[s](x)
            if s == self.last_stage:
                loss = self.loss_fn(out, targets_mb[mb]) / m
                losses.append(loss.detach())
                out = loss
            elif self.schedule.rank_of(s + 1) != self.rank:
                self._send_activation(out, s, mb)
            state[(s, mb)] = {"x": x, "out": out}
            self.compute_s["F"] += time.perf_counter() - t_op
        elif a.op in ("B", "BW"):
            st = state[(s, mb)]
            if s == self.last_stage:
                grad = None
            elif self.schedule.rank_of(s + 1) == self.rank:
                grad = state.pop(("grad", s, mb))
            else:
                shape, dtype = self._shapes[s]
                grad = self._recv(shape, dtype, s + 1, 2, s, mb, "gradient")
            t_op = time.perf_counter()
            if a.op == "B":
                stores[(s, mb)] = WeightGradStore()
                with deferring(stores[(s, mb)]):
                    torch.autograd.backward(st["out"], grad)
            else:
                torch.autograd.backward(st["out"], grad)
            if s > 0:
                if self.schedule.rank_of(s - 1) == self.rank:
                    state[("grad", s - 1, mb)] = st["x"].grad
                else:
                    self._send(st["x"].grad, s - 1, 2, s - 1, mb)
            del state[(s, mb)]
            self.compute_s[a.op] += time.perf_counter() - t_op
        else:  # W
            t_op = time.perf_counter()
            stores.pop((s, mb)).run()
            self.compute_s["W"] += time.perf_counter() - t_op
