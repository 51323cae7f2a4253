"""The process world: a CUDA process group on one NVLink node as a peer-memory world.

Symmetric buffers come from torch's symmetric memory (peer-mapped allocations, exchanged by
``rendezvous``), so the peer-pointer tables the kernels get are NVLink addresses of the other
GPUs. The copy engine is a CUDA side stream. Control (barriers) goes through the process group.

Not yet run on a multi-GPU node by this project: the algorithms are proven in the thread world
(CPU and one GPU); this class only supplies buffers, a stream and a barrier to them.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .side_stream import CudaSideStream
from .symmetric import SymmetricTensor


def symmetric_memory_unavailable_reason(device: torch.device) -> str | None:
    """None when torch's symmetric memory can serve ``device``; else why not."""
    if device.type != "cuda":
        return f"tensors are on {device}, peer memory needs CUDA"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401
    except ImportError as exc:  # pragma: no cover - present in every torch this package supports
        return f"this torch has no symmetric memory ({exc})"
    return None


class ProcessPeerWorld:
    """``rank``/``world_size`` of ``group``, symmetric allocation, workspaces, a copy stream."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, *, timeout: float = 60.0):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        # several ranks on one GPU (tests): torch allows it with this switch; split the SMs then
        self.ranks_per_device = self.world_size if os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1" \
            else 1
        self.timeout = timeout
        self._workspaces: dict = {}
        self._side = None
        from ..kernels.triton.signals import DeferredErrorCheck

        self._errors = DeferredErrorCheck()

    def check_errors(self, err: torch.Tensor, op: str, epoch: int) -> None:
        """Raise a wait's timeout a call late rather than sync the host on every call."""
        self._errors.submit(err, op, epoch)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def alloc_symmetric(self, shape, dtype: torch.dtype, *, fill=0) -> SymmetricTensor:
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(self.group.group_name)  # needed by older torch, idempotent
        local = symm_mem.empty(tuple(shape), dtype=dtype, device=self.device)
        local.fill_(fill)
        handle = symm_mem.rendezvous(local, self.group.group_name)
        # nobody may write into a peer's buffer before that peer's fill has landed
        torch.cuda.current_stream(self.device).synchronize()
        self.barrier()
        peers = tuple(handle.get_buffer(r, tuple(shape), dtype) for r in range(self.world_size))
        ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=self.device)
        return SymmetricTensor(self.rank, self.world_size, local, ptrs, peers, handle)

    def workspace(self, key, factory):
        if key not in self._workspaces:
            self._workspaces[key] = factory(self)
        return self._workspaces[key]

    def side_stream(self) -> CudaSideStream:
        if self._side is None:
            self._side = CudaSideStream(self.device)
        return self._side


# Workspaces hold symmetric buffers that are expensive to set up (a collective rendezvous), so
# each (group, device) keeps one world for the life of the process, like torch's own
# symmetric-memory workspace cache.
_worlds: dict = {}


def process_peer_world(group: dist.ProcessGroup, device: torch.device) -> ProcessPeerWorld:
    key = (group.group_name, device)
    if key not in _worlds:
        _worlds[key] = ProcessPeerWorld(group, device)
    return _worlds[key]
