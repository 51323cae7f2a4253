"""Ring point-to-point steps for the decomposed (chunked) overlap methods.

Each step posts one send and one receive as a single ``batch_isend_irecv`` and returns every
``Work`` of the batch: waiting on all of them matters (dropping all but one hangs gloo, torch
issue #132644). On CUDA the NCCL kernels run on NCCL's own stream; ``wait`` makes the caller's
current stream wait for them, so compute and communication overlap without host syncs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ring:
    group: dist.ProcessGroup
    rank: int          # rank within the group
    world_size: int

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> "Ring":
        return cls(group, dist.get_rank(group), dist.get_world_size(group))

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank % self.world_size)

    def exchange(self, send, to: int, recv, frm: int, *, tag: int = 0) -> list:
        """Start sending ``send`` (a tensor or a list) to group rank ``to`` and receiving ``recv``
        from ``frm``. Concurrent exchanges between the same ranks need distinct tags (gloo matches
        messages by tag)."""
        sends = [send] if isinstance(send, torch.Tensor) else list(send)
        recvs = [recv] if isinstance(recv, torch.Tensor) else list(recv)
        ops = [dist.P2POp(dist.isend, t, self.global_rank(to), self.group, tag) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(frm), self.group, tag) for t in recvs]
        return dist.batch_isend_irecv(ops)


def wait_all(works) -> None:
    for work in works or ():
        work.wait()
