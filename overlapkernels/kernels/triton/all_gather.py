"""All-gather through peer memory: three Triton launches per call, no host sync between them.

The smallest real use of the symmetric-buffer protocol that the fused ops build on, and the proof
that the thread world runs peer-memory kernels. For call ``epoch`` (1, 2, ...) rank r:

1. publish: waits until every peer has finished reading r's chunk of call ``epoch - 1``
   (consumed counters in r's pad), then copies its shard into chunk r of its own buffer;
2. signal: sets ``ready[r] = epoch`` in every peer's pad (release) — a launch of its own, so on
   a GPU stream every block of step 1 has finished first;
3. pull: block b of step s reads chunk (r + s) % W from that rank's buffer once its ready flag
   reaches ``epoch`` (acquire), stores it into the output and counts itself in the owner's
   consumed counter. Step 0 is the local chunk, so a slow peer delays only its own chunk.

Signal pad (int32 [2W]): ready[0:W] indexed by publishing rank, consumed[W:2W] by reader.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .signals import (ERR_CONSUMED_TIMEOUT, ERR_READY_TIMEOUT, peer_ptr, raise_if_timed_out, record_error, set_flag,
                      signal_ptr, wait_geq)

DEFAULT_MAX_SPINS = 1 << 26


@triton.jit
def _ag_publish_kernel(shard_ptr, buf_table_ptr, sig_table_ptr, err_ptr, chunk_numel, consumed_target, max_spins,
                       RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    my_sig = signal_ptr(sig_table_ptr, RANK)
    for reader in tl.static_range(WORLD):
        if reader != RANK:
            seen = wait_geq(my_sig + WORLD + reader, consumed_target, max_spins)
            if seen < consumed_target:
                record_error(err_ptr, ERR_CONSUMED_TIMEOUT, RANK, RANK, reader)
    tl.debug_barrier()
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk_numel
    my_buf = peer_ptr(buf_table_ptr, RANK, shard_ptr)
    tl.store(my_buf + RANK * chunk_numel + offs, tl.load(shard_ptr + offs, mask=mask), mask=mask)


@triton.jit
def _ag_signal_kernel(sig_table_ptr, epoch, RANK: tl.constexpr, WORLD: tl.constexpr):
    for peer in tl.static_range(WORLD):
        set_flag(signal_ptr(sig_table_ptr, peer) + RANK, epoch)


@triton.jit
def _ag_pull_kernel(buf_table_ptr, sig_table_ptr, out_ptr, err_ptr, chunk_numel, epoch, max_spins,
                    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    src = (RANK + tl.program_id(1)) % WORLD
    if src != RANK:
        seen = wait_geq(signal_ptr(sig_table_ptr, RANK) + src, epoch, max_spins)
        if seen < epoch:
            record_error(err_ptr, ERR_READY_TIMEOUT, RANK, src, src)
    tl.debug_barrier()  # every thread's loads below come after the acquire above
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < chunk_numel
    chunk = peer_ptr(buf_table_ptr, src, out_ptr) + src * chunk_numel
    tl.store(out_ptr + src * chunk_numel + offs, tl.load(chunk + offs, mask=mask), mask=mask)
    tl.debug_barrier()  # all threads' loads are done before the release below
    if src != RANK:  # release: our loads of src's chunk are done before src may overwrite it
        tl.atomic_add(signal_ptr(sig_table_ptr, src) + WORLD + RANK, 1, sem="release", scope="sys")


class PeerAllGather:
    """Reusable all-gather of ``chunk_numel``-element shards over symmetric buffers.

    ``buf`` holds W chunks of ``dtype``; ``signals`` is int32 [2W], zero-initialised. Both come
    from a world's collective ``alloc_symmetric``; one instance per rank, called by all ranks in
    the same order.
    """

    def __init__(self, buf, signals, chunk_numel: int, *, block: int = 256, max_spins: int = DEFAULT_MAX_SPINS):
        world = buf.world_size
        if buf.local.numel() != world * chunk_numel:
            raise ValueError(f"buf has {buf.local.numel()} elements; expected world_size*chunk_numel = "
                             f"{world}*{chunk_numel}")
        if signals.local.dtype != torch.int32 or signals.local.numel() < 2 * world:
            raise ValueError(f"signals must be int32 with >= {2 * world} elements, got "
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
        shard_flat = shard.contiguous().view(-1)
        out = torch.empty(self.world_size * self.chunk_numel, dtype=shard.dtype, device=shard.device)
        err = torch.zeros(4, dtype=torch.int32, device=shard.device)
        consumed_target = (self.epoch - 1) * self.num_blocks
        common = dict(RANK=self.rank, WORLD=self.world_size)
        sig_ptrs = self.signals.peer_ptrs
        _ag_publish_kernel[(self.num_blocks,)](shard_flat, self.buf.peer_ptrs, sig_ptrs, err, self.chunk_numel,
                                               consumed_target, self.max_spins, BLOCK=self.block, **common)
        _ag_signal_kernel[(1,)](sig_ptrs, self.epoch, **common)
        _ag_pull_kernel[(self.num_blocks, self.world_size)](self.buf.peer_ptrs, sig_ptrs, out, err, self.chunk_numel,
                                                            self.epoch, self.max_spins, BLOCK=self.block, **common)
        raise_if_timed_out(err, "ok/all_gather", self.epoch)
        return out.view(self.world_size * shard.shape[0], *shard.shape[1:]) if shard.dim() else out
