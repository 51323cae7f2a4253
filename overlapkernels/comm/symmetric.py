"""A symmetric tensor: one buffer per rank, same shape everywhere, addressable by every peer.

Kernels never see a world: they get ``peer_ptrs`` (int64 [world], the address of each rank's
buffer, on this rank's device) and index it with a peer's rank. The thread world fills it with
CPU addresses; the process world (torch symmetric memory / CUDA IPC) with peer-mapped ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SymmetricTensor:
    rank: int
    world_size: int
    local: torch.Tensor        # this rank's buffer
    peer_ptrs: torch.Tensor    # int64 [world_size]: data_ptr of every rank's buffer
    peers: tuple               # every rank's buffer as a tensor, where this process can see it
    handle: object = None      # keeps the peer mappings alive (torch symmetric memory)

    def peer(self, rank: int) -> torch.Tensor:
        return self.peers[rank]
