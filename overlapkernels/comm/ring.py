"""Ring point-to-point steps for the decomposed (chunked) overlap methods.

Each step posts one send and one receive as a single ``batch_isend_irecv`` and returns every
``Work`` of the batch: waiting on all of them matters (dropping all but one hangs gloo, torch
issue #132644). On CUDA the NCCL kernels run on NCCL's own stream; ``wait`` makes the caller's
current stream wait for them, so compute and communication overlap without host syncs.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .._compat import group_timeout
from ..parallel import uses_nccl


class _TimedWork:
    """A gloo send or receive waited for with the group's timeout. gloo bounds a P2P wait only by
    the timeout its group was created with (30 min for DeviceMesh's groups), not by one set later,
    which is how ``init_parallel(timeout=)`` bounds the mesh's collectives: without this a ring
    step whose peer died waited half an hour where a collective failed in seconds."""

    def __init__(self, work, timeout: timedelta):
        self.work, self.timeout = work, timeout

    def wait(self):
        return self.work.wait(self.timeout)


class _StagedWork:
    """gloo moves only host memory: CUDA tensors go through CPU copies, and the receiving copy
    back to the device happens in ``wait`` (used when N ranks share one GPU with gloo control)."""

    def __init__(self, works, copies):
        self.works, self.copies = works, copies

    def wait(self):
        for work in self.works:
            work.wait()
        for dst, staged in self.copies:
            dst.copy_(staged)
        return True


@dataclass(frozen=True)
class Ring:
    group: dist.ProcessGroup
    rank: int          # rank within the group
    world_size: int
    host_only: bool = False  # the backend can move only CPU tensors (gloo)
    timeout: timedelta | None = None  # gloo: each wait's bound (see _TimedWork); NCCL: its watchdog's

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> "Ring":
        host_only = not uses_nccl(group)
        return cls(group, dist.get_rank(group), dist.get_world_size(group), host_only,
                   group_timeout(group) if host_only else None)

    @classmethod
    def alone(cls) -> "Ring":
        """A ring of one in any process, with or without torch.distributed: loops over it never
        exchange (attention over a sequence held whole). Not ``of(None)``: None is the world group."""
        return cls(None, 0, 1)

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank % self.world_size)

    def exchange(self, send, to: int, recv, frm: int, *, tag: int = 0) -> list:
        """Start sending ``send`` (a tensor or a list) to group rank ``to`` and receiving ``recv``
        from ``frm``. Concurrent exchanges between the same ranks need distinct tags (gloo matches
        messages by tag)."""
        # the backends move dense buffers (gloo refuses strided ones after the peer's half is posted):
        # strided sends go as contiguous copies, strided receives land in one and are copied in wait
        sends = [t.contiguous() for t in ([send] if isinstance(send, torch.Tensor) else send)]
        recvs = [recv] if isinstance(recv, torch.Tensor) else list(recv)
        if self.host_only and any(t.device.type != "cpu" for t in sends + recvs):
            sends = [t.cpu() for t in sends]
            staged = [torch.empty(t.shape, dtype=t.dtype) for t in recvs]
        else:
            staged = [t if t.is_contiguous() else torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in recvs]
        copies = [(t, s) for t, s in zip(recvs, staged) if s is not t]
        recvs = staged
        ops = [dist.P2POp(dist.isend, t, self.global_rank(to), self.group, tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(frm), self.group, tag) for t in recvs]
        works = dist.batch_isend_irecv(ops)
        if self.timeout is not None:
            works = [_TimedWork(work, self.timeout) for work in works]
        return [_StagedWork(works, copies)] if copies else works


def wait_all(works) -> None:
    for work in works or ():
        work.wait()


@contextlib.contextmanager
def settled_on_error(*pending):
    """Run a step's compute with exchanges posted (``pending``: lists of works, or None): if it
    raises, those are waited for before the error propagates. An exchange posted and never waited
    for leaves gloo's pair unusable (torch issue #132644): every later collective of the group hung,
    on every rank, after a rank-local error (an out-of-memory, a kernel's limit) in a ring step.
    A peer that goes on to its next step still waits for this rank there, until the group's timeout."""
    try:
        yield
    except BaseException:
        for works in pending:
            for work in works or ():
                with contextlib.suppress(Exception):  # the original error is the one to raise
                    work.wait()
        raise
