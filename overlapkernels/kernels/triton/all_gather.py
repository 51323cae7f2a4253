"""All-gather through peer memory with Triton kernels, no host sync between the steps.

The smallest real use of the symmetric-buffer protocol that the fused ops build on, and the proof
that the thread world runs peer-memory kernels. For call ``epoch`` (1, 2, ...) rank r:

1. waits (one-program kernels) until every peer has finished reading r's chunk of call
   ``epoch - 1`` (consumed counters in r's pad), then copies its shard into chunk r of its own
   buffer (``_ag_publish_kernel``);
2. sets ``ready[r] = epoch`` in every peer's pad (release) - a launch of its own, so on a GPU
   stream every block of step 1 has finished first;
3. for each peer chunk, in ring order r+1, r+2, ...: waits until its ready flag reaches ``epoch``
   (acquire), then ``_ag_pull_kernel`` copies it through the peer-pointer table into the output
   and counts one read in the owner's consumed counter.

Waits are one-program kernels and the copy kernels never spin, so a rank never fills the GPU with
spinning blocks that could starve a peer sharing it. Signal pad (int64 [2W]): ready[0:W] by
publishing rank, consumed[W:2W] by reader.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import new_error_record
from .signals import (ERR_CONSUMED_TIMEOUT, ERR_READY_TIMEOUT, FLAG_DTYPE, FLAG_KERNEL_LAUNCH, peer_ptr, polls,
                      raise_if_timed_out, set_flag, signal_ptr, wait_flag)

DEFAULT_MAX_SPINS = 1 << 26


@triton.jit
def _ag_publish_kernel(shard_ptr, buf_table_ptr, chunk_numel, RANK: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk_numel
    my_buf = peer_ptr(buf_table_ptr, RANK, shard_ptr)
    # 64-bit chunk base: chunk_numel arrives as i32, and RANK x it passes 2^31 long before it does
    # (tl.cast, not .to: an argument equal to 1 is specialised into a plain int)
    base = RANK * tl.cast(chunk_numel, tl.int64)
    tl.store(my_buf + base + offs, tl.load(shard_ptr + offs, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["epoch", "rank"])
def _ag_signal_kernel(sig_table_ptr, epoch: tl.int64, rank, WORLD: tl.constexpr):
    for peer in tl.static_range(WORLD):
        set_flag(signal_ptr(sig_table_ptr, peer) + rank, epoch)


def signal_published(sig_peer_ptrs: torch.Tensor, epoch: int, rank: int, world: int) -> None:
    """Stream-ordered: set flag ``rank`` of every rank's signal pad (this one's included) to ``epoch``
    (release): this rank's block of call ``epoch`` is in its symmetric buffer. One flag kernel."""
    _ag_signal_kernel[(1,)](sig_peer_ptrs, epoch, rank, WORLD=world, **FLAG_KERNEL_LAUNCH)


@triton.jit
def _ag_pull_kernel(buf_table_ptr, sig_table_ptr, out_ptr, chunk_numel, src, num_blocks,
                    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk_numel
    base = tl.cast(src, tl.int64) * chunk_numel  # 64-bit, as in the publish kernel (tl.cast: src may be a 1)
    chunk = peer_ptr(buf_table_ptr, src, out_ptr) + base
    tl.store(out_ptr + base + offs, tl.load(chunk + offs, mask=mask), mask=mask)
    tl.debug_barrier()  # all threads' loads are done before the release below
    # release: src may overwrite its chunk once every block of every reader has counted itself
    tl.atomic_add(signal_ptr(sig_table_ptr, src) + WORLD + RANK, 1, sem="release", scope="sys")


class PeerAllGather:
    """Reusable all-gather of ``chunk_numel``-element shards over symmetric buffers.

    ``buf`` holds W chunks of ``dtype``; ``signals`` is int64 [2W], zero-initialised. Both come
    from a world's collective ``alloc_symmetric``; one instance per rank, called by all ranks in
    the same order.
    """

    def __init__(self, buf, signals, chunk_numel: int, *, block: int = 256, max_spins: int = DEFAULT_MAX_SPINS):
        world = buf.world_size
        if chunk_numel + block >= 2 ** 31:  # offsets within a chunk are 32-bit (the chunk bases are 64-bit)
            raise ValueError(f"chunk_numel={chunk_numel}: expected fewer than 2^31 - block ({block}) elements a chunk")
        if buf.local.numel() != world * chunk_numel:
            raise ValueError(f"buf has {buf.local.numel()} elements; expected world_size*chunk_numel = "
                             f"{world}*{chunk_numel}")
        if signals.local.dtype != FLAG_DTYPE or signals.local.numel() < 2 * world:
            raise ValueError(f"signals must be {FLAG_DTYPE} with >= {2 * world} elements, got "
                             f"{signals.local.dtype} x {signals.local.numel()}")
        self.buf, self.signals = buf, signals
        self.rank, self.world_size, self.chunk_numel = buf.rank, world, chunk_numel
        self.block, self.max_spins = block, max_spins
        self.epoch = 0
        self.num_blocks = triton.cdiv(chunk_numel, block)

    def __call__(self, shard: torch.Tensor) -> torch.Tensor:
        """Returns ``torch.cat(all shards, dim=0)``; ``shard`` must have ``chunk_numel`` elements."""
        if shard.numel() != self.chunk_numel or shard.dtype != self.buf.local.dtype:
            raise ValueError(f"shard: expected {self.chunk_numel} elements of {self.buf.local.dtype}, got "
                             f"{shard.numel()} of {shard.dtype}")
        self.epoch += 1
        r, w, pads = self.rank, self.world_size, self.signals
        shard_flat = shard.contiguous().view(-1)
        out = torch.empty(w * self.chunk_numel, dtype=shard.dtype, device=shard.device)
        err = new_error_record(shard.device)
        for reader in range(w):  # each reader's blocks counted one read each in call epoch - 1
            if reader != r:
                wait_flag(pads.local[w + reader:w + reader + 1], (self.epoch - 1) * self.num_blocks, err,
                          polls(self.max_spins), code=ERR_CONSUMED_TIMEOUT, rank=r, chunk=r, peer=reader)
        _ag_publish_kernel[(self.num_blocks,)](shard_flat, self.buf.peer_ptrs, self.chunk_numel, RANK=r,
                                               BLOCK=self.block)
        signal_published(pads.peer_ptrs, self.epoch, r, w)
        for step in range(w):
            src = (r + step) % w
            if src != r:
                wait_flag(pads.local[src:src + 1], self.epoch, err, polls(self.max_spins), code=ERR_READY_TIMEOUT,
                          rank=r, chunk=src, peer=src)
            self.pull(out, src)
        raise_if_timed_out(err, "ok/all_gather", self.epoch)
        return out.view(w * shard.shape[0], *shard.shape[1:]) if shard.dim() else out

    def pull(self, out: torch.Tensor, src: int) -> None:
        """Copy chunk ``src`` from its owner's buffer into ``out`` and count the read (no wait)."""
        _ag_pull_kernel[(self.num_blocks,)](self.buf.peer_ptrs, self.signals.peer_ptrs, out, self.chunk_numel, src,
                                            self.num_blocks, RANK=self.rank, WORLD=self.world_size, BLOCK=self.block)
