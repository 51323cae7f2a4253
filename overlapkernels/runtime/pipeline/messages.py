"""PipelineRunner's messages: activations, gradients and the shapes announcing them, posted as the
comm plan says (``p2p.comm_plan``), waited for with the runner's timeout, named when they fail.

Tensors travel as their bytes (``_bytes``); a shape message carries the activation's dims, dtype
(an index into ``_DTYPES``) and sizes, once per boundary and step.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from ...profiling.ranges import span
from .p2p import announcing_microbatch

# A shape message names the activation's dtype by its index here: every dtype this torch has, in
# one order on every rank (ranks of a job run one torch). Tensors travel as their bytes (``_bytes``),
# so no backend's dtype table matters (NCCL has no complex type of its own, older ones no float8).
_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
_META_LEN = 10  # [dims, dtype index, size 0, ..., size 7]
_MAX_DIMS = _META_LEN - 2
_KINDS = ("shape", "activation", "gradient")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as uint8 (a view: a receive fills the typed tensor)."""
    return t.reshape(-1).view(torch.uint8)


class PipelineTimeout(RuntimeError):
    """A peer did not send in time; names the stage, microbatch and peer rank."""


class MessageExchange:
    """Mixed into PipelineRunner: its ``group``, ``schedule``, ``timeout``, ``device``, ``_nccl``,
    ``_staged`` and the step's ``_sends``, ``_unconfirmed``, ``_inbox``, ``_outbox``, ``_shapes``
    are what it posts from and into."""

    def _tag(self, msg) -> int:
        return (_KINDS.index(msg.what) * self.schedule.num_stages + msg.boundary) * \
            self.schedule.num_microbatches + msg.microbatch + 1

    def _fail(self, msg, why: str, cause=None) -> PipelineTimeout:
        """Names this rank's stage, the microbatch, the peer rank and its stage."""
        here, there = (msg.boundary, msg.boundary + 1) if (msg.what == "gradient") != msg.send else \
            (msg.boundary + 1, msg.boundary)
        return PipelineTimeout(f"stage {here} microbatch {msg.microbatch}: {why} rank {msg.peer} (stage {there}) "
                               f"({str(cause).splitlines()[0][:160] if cause else 'no answer'})")

    def _wait(self, work, msg) -> None:
        """Before an action uses a received tensor. NCCL: the compute stream waits for the transfer
        and the host runs on (a timed wait would hold the host until the transfer lands: WorkNCCL
        polls every 1 ms, so the host could not queue work ahead); the timeout is applied once, at
        the step's end (``_confirm``). gloo: a timed host wait here."""
        if self._nccl:
            work.wait()
            self._unconfirmed.append((work, msg))
            return
        self._confirm(work, msg)

    def _confirm(self, work, msg) -> None:
        """A host wait with the runner's timeout; a miss names the stage, microbatch and peer."""
        try:
            with span(f"ok/pipeline/{msg.what}{msg.boundary}.{msg.microbatch}/comm"):
                ok, cause = work.wait(timedelta(seconds=self.timeout)), None
        except RuntimeError as exc:  # gloo: timed out, or the peer's connection closed
            ok, cause = False, exc
        if ok is False:
            why = f"no receipt of the {msg.what} by" if msg.send else f"no {msg.what} from"
            raise self._fail(msg, f"{why}", cause) from cause

    def _post(self, batch, tensors) -> list:
        """The one place P2P leaves this rank: one ``batch_isend_irecv`` per batch of the plan."""
        ops = [dist.P2POp(dist.isend if msg.send else dist.irecv, _bytes(t), dist.get_global_rank(self.group, msg.peer),
                          self.group, self._tag(msg)) for msg, t in zip(batch, tensors)]
        self._posted = True
        try:
            with span("ok/pipeline/post/comm"):
                return dist.batch_isend_irecv(ops)
        except RuntimeError as exc:  # gloo: the peer's connection is gone
            raise self._fail(batch[0], "cannot exchange with", exc) from exc

    def _reap(self, pending: list) -> list:
        """The works of ``pending`` not yet completed; completed ones are confirmed (an error they hold
        raises here) and dropped. A gloo send's work holds the tensor it sends (on CPU the stage's own
        output), an NCCL receive's its buffer: kept to the step's end, a step would hold every
        microbatch's boundary activation, where 1F1B needs at most one per stage in flight."""
        still = []
        for work, msg in pending:
            if work.is_completed():
                self._confirm(work, msg)
            else:
                still.append((work, msg))
        return still

    def _post_point(self, batches) -> None:
        self._sends, self._unconfirmed = self._reap(self._sends), self._reap(self._unconfirmed)
        for batch in batches:
            tensors = [self._outgoing(msg) if msg.send else self._buffer(msg) for msg in batch]
            works = self._post(batch, tensors)
            # gloo: a request per operation; NCCL: one for the whole (coalesced) batch
            per_op = works if len(works) == len(batch) else works[-1:] * len(batch)
            for msg, t, work in zip(batch, tensors, per_op):
                if msg.send:
                    self._sends.append((work, msg))
                else:
                    self._inbox[msg.label] = (t, work, msg)

    def _take(self, what, boundary, mb, *, host: bool = False):
        """A received tensor; ``host``: the host reads it, so wait with the timeout even on NCCL."""
        buf, work, msg = self._inbox.pop((what, boundary, mb))
        (self._confirm if host else self._wait)(work, msg)
        return buf.to(self.device) if self._staged and not host else buf

    def _outgoing(self, msg):
        if msg.what == "shape":  # the activation it describes was made by the same action
            out = self._outbox[("activation", msg.boundary, msg.microbatch)]
            meta = torch.zeros(_META_LEN, dtype=torch.int64)
            meta[0], meta[1] = out.dim(), _DTYPES.index(out.dtype)
            meta[2:2 + out.dim()] = torch.tensor(out.shape)
            return meta.to(self._wire)
        return self._outbox.pop(msg.label).to(self._wire).contiguous()

    @property
    def _wire(self) -> torch.device:
        """Where tensors are when the backend moves them."""
        return torch.device("cpu") if self._staged else self.device

    def _buffer(self, msg):
        if msg.what == "shape":
            return torch.empty(_META_LEN, dtype=torch.int64, device=self._wire)
        if msg.boundary not in self._shapes:  # the shape came one batch earlier: read it now
            # host: an upstream peer that died is named here, at the step's first boundary, not by
            # the NCCL watchdog
            meta = self._take("shape", msg.boundary, announcing_microbatch(self.schedule, msg.boundary), host=True).cpu()
            nd = int(meta[0])
            self._shapes[msg.boundary] = (tuple(int(v) for v in meta[2:2 + nd]), _DTYPES[int(meta[1])])
        shape, dtype = self._shapes[msg.boundary]
        return torch.empty(shape, dtype=dtype, device=self._wire)

    def _send_later(self, what, boundary, mb, tensor) -> None:
        if what == "activation":  # every microbatch of a step must match the shape announced once
            if tensor.dim() > _MAX_DIMS or tensor.layout != torch.strided:
                raise ValueError(f"stage {boundary} microbatch {mb}: output {tuple(tensor.shape)} {tensor.dtype} "
                                 f"{tensor.layout}: a stage passes a dense tensor of at most {_MAX_DIMS} dims")
            seen = self._shapes.setdefault(boundary, (tuple(tensor.shape), tensor.dtype))
            if seen != (tuple(tensor.shape), tensor.dtype):
                raise ValueError(f"stage {boundary} microbatch {mb}: output {tuple(tensor.shape)} {tensor.dtype} "
                                 f"differs from this step's first microbatch ({seen[0]} {seen[1]})")
        self._outbox[(what, boundary, mb)] = tensor
