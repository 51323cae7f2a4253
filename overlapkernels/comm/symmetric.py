"""A symmetric tensor: one buffer per rank, same shape everywhere, addressable by every peer.

Kernels never see a world: they get ``peer_ptrs`` (int64 [world], the address of each rank's
buffer, on this rank's device) and index it with a peer's rank. The thread world fills it with
CPU addresses; the process world (torch symmetric memory / CUDA IPC) with peer-mapped ones.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

ALIGN_BYTES = 16  # every rank's buffer starts at a multiple of this


@dataclass(frozen=True)
class SymmetricTensor:
    rank: int
    world_size: int
    local: torch.Tensor        # this rank's buffer
    peer_ptrs: torch.Tensor    # int64 [world_size]: data_ptr of every rank's buffer
    peers: tuple               # every rank's buffer as a tensor, where this process can see it
    handle: object = None      # keeps the peer mappings alive (torch symmetric memory)

    def __post_init__(self):
        # the kernels vectorise peer accesses on this promise (signals.peer_ptr): a misaligned
        # buffer would fault on the GPU, so it is refused here, where the world hands it out
        misaligned = [r for r, p in enumerate(self.peers) if p.data_ptr() % ALIGN_BYTES]
        if misaligned:
            raise ValueError(f"symmetric buffers of ranks {misaligned} start at addresses not divisible by "
                             f"{ALIGN_BYTES}: {[hex(self.peers[r].data_ptr()) for r in misaligned]}")

    def peer(self, rank: int) -> torch.Tensor:
        return self.peers[rank]

    def prefix(self, shape) -> SymmetricTensor:
        """The first prod(shape) elements of every rank's (flat) buffer, viewed as ``shape``: the
        same addresses, so peer_ptrs hold as they are. A smaller call reuses a larger buffer."""
        numel = math.prod(shape)
        if numel > self.local.numel():
            raise ValueError(f"prefix of {numel} elements asked of a symmetric buffer of {self.local.numel()}")
        return replace(self, local=self.local.view(-1)[:numel].view(shape),
                       peers=tuple(p.view(-1)[:numel].view(shape) for p in self.peers))
