"""Fused GEMM + reduce-scatter: a persistent Triton GEMM whose epilogue stores each tile of the
partial product straight into the owner's symmetric buffer and counts it in the owner's pad.

Rank r's partial of chunk d lands in rank d's ``slots[r]``; rank d's ``pads[r]`` counts the tiles
of it that have landed (release after a CTA barrier, so every thread's stores are visible). Tiles
start at chunk r + 1 and end with r's own chunk, so remote stores go out first. The owner waits
for all W counts and sums its slots in fixed rank order (bitwise reproducible). With a TMA config
the A and B tiles come through tensor descriptors (both are this rank's, written by earlier kernels:
no flag orders them, so no proxy fence is needed).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .signals import peer_ptr, signal_ptr
from .tile_gemm import GemmConfig, check_gemm_operands, dot_precision, num_programs, tile_dot, tile_dot_tma, tma_operands


@triton.jit(do_not_specialize=["rank"])
def _gemm_rs_kernel(a_ptr, b_ptr, slots_table_ptr, pads_table_ptr, rows_per_chunk, N, K,
                    stride_am, stride_ak, stride_bk, stride_bn, rank, a_desc, b_desc, WORLD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    EVEN_K: tl.constexpr, TMA: tl.constexpr, B_K_MAJOR: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_chunk = tl.cdiv(rows_per_chunk, BLOCK_M) * tiles_n
    for tile in range(tl.program_id(0), WORLD * per_chunk, tl.num_programs(0)):
        owner = (rank + 1 + tile // per_chunk) % WORLD
        t = tile % per_chunk
        rows_in = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows_in < rows_per_chunk
        cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if TMA:  # rows past the chunk's end read the next chunk's: their outputs are masked
            acc = tile_dot_tma(a_desc, b_desc, owner * rows_per_chunk + (t // tiles_n) * BLOCK_M,
                               (t % tiles_n) * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, B_K_MAJOR)
        else:  # chunk bases as scalar int64 offsets (W*m*K may pass 2**31 elements), int32 within a chunk
            acc = tile_dot(a_ptr + owner.to(tl.int64) * rows_per_chunk * stride_am, b_ptr, rows_in, row_mask, cols,
                           col_mask, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K,
                           DOT_PRECISION, EVEN_K)
        # owner's slots: [W, m, N] (peer_ptr carries the 16-byte alignment that vectorises these stores)
        slot = peer_ptr(slots_table_ptr, owner, a_ptr) + rank.to(tl.int64) * rows_per_chunk * N
        tl.store(slot + rows_in[:, None] * N + cols[None, :], acc.to(a_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & col_mask[None, :])
        tl.debug_barrier()  # all threads' stores are issued before the release below
        tl.atomic_add(signal_ptr(pads_table_ptr, owner) + rank, 1, sem="release", scope="sys")


def gemm_rs(a: torch.Tensor, b: torch.Tensor, slots, pads, *, rank: int, world_size: int, config: GemmConfig,
            ranks_per_device: int = 1) -> int:
    """Scatter ``a @ b``'s chunks into the owners' ``slots`` (symmetric [W, m, N]) and count them in
    the owners' ``pads`` (symmetric int64, counts at [0, W)). ``config`` must be the same on every
    rank. Returns the tiles per chunk: the count each owner waits for from each rank."""
    check_gemm_operands(a, b, slots.local, world_size)
    rows_per_chunk, n, k = a.shape[0] // world_size, b.shape[1], b.shape[0]
    tma, a_desc, b_desc, b_k_major = tma_operands(a, b, config)
    _gemm_rs_kernel[(num_programs(a.device, world_size * config.tiles(rows_per_chunk, n), ranks_per_device,
                                      config.programs_per_sm),)](
        a, b, slots.peer_ptrs, pads.peer_ptrs, rows_per_chunk, n, k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), rank, a_desc, b_desc,
        WORLD=world_size, DOT_PRECISION=dot_precision(a.dtype), TMA=tma, B_K_MAJOR=b_k_major, **config.meta(k))
    return config.tiles(rows_per_chunk, n)
