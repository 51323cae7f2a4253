"""Fused all-gather + GEMM: a persistent Triton GEMM whose tiles wait for their A chunk.

The gathered A [W*m, K] is filled chunk by chunk by a copy engine (a side stream; a side thread
in the thread world) that sets ``arrived[c] = epoch`` once chunk c is in place. Tiles are ordered
by ring step, starting at the local chunk, which needs no wait, so the GEMM starts at once and
each later tile waits (acquire) only for its own chunk. With a TMA config, A and B tiles come
through tensor descriptors, after a proxy fence that orders them behind the acquire; with
``tma_store`` the output tiles leave through one (per chunk: see tile_gemm.tma_output).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..errors import check_error_record
from ..interpreter import interpreted
from .signals import ERR_READY_TIMEOUT, GEMM_CLOCK_LANES, WaitBudget, fence_proxy_async, wait_or_record
from .tile_gemm import (GemmConfig, check_gemm_operands, dot_precision, gemm_config, num_programs, tile_dot,
                        tile_dot_tma, tma_operands, tma_output)


@triton.jit(do_not_specialize=["epoch", "budget", "rank"])
def _ag_gemm_kernel(a_ptr, b_ptr, c_ptr, arrived_ptr, err_ptr, rows_per_chunk, N, K, epoch: tl.int64,
                    budget: tl.int64, stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, rank,
                    a_desc, b_desc, c_desc, WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr, EVEN_K: tl.constexpr, TIMED: tl.constexpr,
                    TMA: tl.constexpr, B_K_MAJOR: tl.constexpr, PROXY_FENCE: tl.constexpr, TMA_STORE: tl.constexpr):
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_chunk = tl.cdiv(rows_per_chunk, BLOCK_M) * tiles_n
    for tile in range(tl.program_id(0), WORLD * per_chunk, tl.num_programs(0)):
        chunk = (rank + tile // per_chunk) % WORLD
        t = tile % per_chunk
        if chunk != rank:
            wait_or_record(arrived_ptr + chunk, epoch, err_ptr, budget, ERR_READY_TIMEOUT, rank, chunk, chunk, TIMED,
                           GEMM_CLOCK_LANES)
        tl.debug_barrier()  # every thread's A loads come after the acquire
        if PROXY_FENCE:  # and TMA's too, which the acquire alone does not order
            fence_proxy_async()
        rows_in = (t // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows_in < rows_per_chunk
        # the chunk's first row as a scalar int64 offset (W*m*K may pass 2**31 elements); offsets
        # within a chunk stay int32, which keeps the per-thread address registers small
        chunk_row0 = chunk.to(tl.int64) * rows_per_chunk
        cols = (t % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        if TMA:  # rows past the chunk's end read the next chunk's (whatever is there): their outputs are masked
            acc = tile_dot_tma(a_desc, b_desc, chunk * rows_per_chunk + (t // tiles_n) * BLOCK_M,
                               (t % tiles_n) * BLOCK_N, K, BLOCK_M, BLOCK_N, BLOCK_K, B_K_MAJOR)
        else:
            acc = tile_dot(a_ptr + chunk_row0 * stride_am, b_ptr, rows_in, row_mask, cols, col_mask, K, stride_am,
                           stride_ak, stride_bk, stride_bn, BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION, EVEN_K)
        if TMA_STORE:  # out as [W, m, N]: the copy engine clips rows past the chunk's end
            c_desc.store([chunk, (t // tiles_n) * BLOCK_M, (t % tiles_n) * BLOCK_N],
                         acc.to(c_ptr.dtype.element_ty).reshape(1, BLOCK_M, BLOCK_N))
        else:
            tl.store(c_ptr + chunk_row0 * stride_cm + rows_in[:, None] * stride_cm + cols[None, :] * stride_cn,
                     acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def ag_gemm(a_full: torch.Tensor, b: torch.Tensor, out: torch.Tensor, arrived: torch.Tensor, err: torch.Tensor, *,
            rank: int, world_size: int, epoch: int, budget: WaitBudget, config: GemmConfig | None = None,
            ranks_per_device: int = 1) -> torch.Tensor:
    """``out = a_full @ b``, tile by tile as chunks of ``a_full`` arrive (``arrived[c] >= epoch``).
    ``config``: tile shape and launch options (default: ``gemm_config`` for this device and shape)."""
    check_gemm_operands(a_full, b, out, world_size)
    check_error_record(err)
    rows_per_chunk = a_full.shape[0] // world_size
    n, k = b.shape[1], b.shape[0]
    config = config or gemm_config(a_full.device, a_full.dtype, rows_per_chunk, n, k)
    tiles = world_size * config.tiles(rows_per_chunk, n)
    tma, a_desc, b_desc, b_k_major = tma_operands(a_full, b, config)
    tma_store, c_desc = tma_output(out, world_size, config)
    _ag_gemm_kernel[(num_programs(a_full.device, tiles, ranks_per_device, config.programs_per_sm),)](
        a_full, b, out, arrived, err, rows_per_chunk, n, k, epoch, budget.amount,
        a_full.stride(0), a_full.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1), rank,
        a_desc, b_desc, c_desc, WORLD=world_size, DOT_PRECISION=dot_precision(a_full.dtype), TIMED=budget.timed,
        TMA=tma, B_K_MAJOR=b_k_major, PROXY_FENCE=tma and not interpreted(a_full.device), TMA_STORE=tma_store,
        **config.meta(k))
    return out
