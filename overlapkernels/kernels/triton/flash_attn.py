"""Flash attention in Triton: forward with log-sum-exp, backward (dQ; dK/dV), for ring blocks.

Same contract as ``kernels.attention_ref``: q [B, H, Lq, D], k/v [B, H_kv, Lk, D] (last dim
contiguous), queries at positions q_start.., keys at k_start..; ``causal`` masks keys after the
query; segment ids (``q_segments`` [B, Lq], ``k_segments`` [B, Lk]) mask keys of other segments,
and each loop walks only the tiles between the first and the last whose ids can meet its own
(flash_segments.py). Query head h reads kv head h // (H / H_kv). Outputs are fp32 (the ring merges in fp32);
rows that see no key give out = 0 and lse = -inf, never NaN (NaN inputs still give NaN, as in
SDPA). Backward takes the *final* lse and
delta = rowsum(dO * O), as ring attention recomputes every block against the merged result.
Softmax runs in base 2 (exp2 with log2(e) folded into the scale), the usual flash trick.
The grid is (tiles, heads, batch): heads and batch on axes of their own, each under CUDA's 65535,
where B*H on one axis passed it (B=512, H=128). Each program's (batch, head) base offset is 64-bit
(its program ids cast to int64): B*H*S*D reaches 2^31 elements at long context (B=1, H=128,
S=131072, D=128). Offsets within one head stay 32-bit: S*D for the contiguous [B, H, S, D] blocks
ring attention passes; a strided view whose sequence stride is H*D needs S*H*D < 2^31 (_check refuses more).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..interpreter import bf16_message, bf16_miscomputed
from .flash_configs import flash_configs
from .flash_segments import segment_args, tile_spans
from .tile_gemm import dot_precision, launch_device

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
GRID_AXIS_MAX = 65535  # CUDA's limit on a grid's y and z


@triton.jit
def _visible(offs_m, offs_n, Lq, Lk, q_start, k_start, seg_q, seg_k, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr):
    valid = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
    if CAUSAL:
        valid = valid & ((q_start + offs_m)[:, None] >= (k_start + offs_n)[None, :])
    if SEGMENTS:
        valid = valid & (seg_q[:, None] == seg_k[None, :])
    return valid


@triton.jit
def _span(lo, hi, span_ptr, tile, BLOCK: tl.constexpr, SEGMENTS: tl.constexpr):
    """The other side's positions [lo, hi) this program walks, cut (with segment ids) to the tiles
    from the first to the last whose id range meets this tile's (``span_ptr``: [first, last] per
    tile, made per call by ``flash_segments.tile_spans``). A bound, not a branch per tile: the loop keeps its
    software pipelining. Tiles between two that meet are walked, masked (ids out of order)."""
    if SEGMENTS:
        lo = tl.maximum(lo, tl.load(span_ptr + 2 * tile) * BLOCK)
        hi = tl.minimum(hi, (tl.load(span_ptr + 2 * tile + 1) + 1) * BLOCK)
    return lo, hi


@triton.jit
def _key_end(pid_m, Lk, q_start, k_start, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """Keys past this query block's last position are hidden from all its rows (causal)."""
    hi = Lk
    if CAUSAL:
        hi = tl.minimum(Lk, tl.maximum(q_start + (pid_m + 1) * BLOCK_M - k_start, 0))
    return hi


@triton.jit
def _unmasked_key_end(row0, Lk, q_start, k_start, CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """Keys [0, end) come in whole BLOCK_N tiles that every row from ``row0`` on may see: those
    tiles skip the mask (the usual flash split into unmasked and diagonal tiles). With segment ids
    every tile is masked."""
    end = Lk
    if CAUSAL:  # key k is visible to every row iff k_start + k <= q_start + row0
        end = tl.minimum(Lk, tl.maximum(q_start + row0 - k_start + 1, 0))
    if SEGMENTS:
        end = 0
    return end // BLOCK_N * BLOCK_N


@triton.jit
def _fwd_step(acc, m_i, l_i, q, k_ptr, v_ptr, kv_base, n0, offs_m, offs_d, d_mask, Lq, Lk, q_start, k_start, sk_s,
              scale_log2, seg_q, sgk_ptr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, SEGMENTS: tl.constexpr,
              BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax. Unmasked tiles need no -inf guards: every score is finite."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k, v = _load_kv_tile(k_ptr, v_ptr, kv_base, offs_n, offs_d, d_mask, Lk, sk_s)
    seg_k = offs_n
    if SEGMENTS:
        seg_k = tl.load(sgk_ptr + offs_n, mask=offs_n < Lk, other=0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if MASKED:
        s = tl.where(_visible(offs_m, offs_n, Lq, Lk, q_start, k_start, seg_q, seg_k, CAUSAL, SEGMENTS), s,
                     float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = m_new
    if MASKED:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing visible yet
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _load_kv_tile(k_ptr, v_ptr, kv_base, offs_n, offs_d, d_mask, Lk, sk_s):
    kv_mask = (offs_n[:, None] < Lk) & d_mask[None, :]
    offs = offs_n[:, None] * sk_s + offs_d[None, :]  # within one (batch, head): 32-bit
    return (tl.load(k_ptr + kv_base + offs, mask=kv_mask, other=0.0),
            tl.load(v_ptr + kv_base + offs, mask=kv_mask, other=0.0))


@triton.jit
def _flash_fwd_kernel(q_ptr, k_ptr, v_ptr, out_ptr, lse_ptr, sgq_ptr, sgk_ptr, span_ptr,
                      sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, so_b, so_h, so_s, sl_b, sl_h, sgq_b, sgk_b, span_b,
                      GROUP, Lq, Lk, D, q_start, k_start, scale_log2,
                      CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m, h, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)  # (docstring)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < D
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_m[:, None] * sq_s + offs_d[None, :],
                mask=(offs_m[:, None] < Lq) & d_mask[None, :], other=0.0)
    seg_q = offs_m  # (without ids: a placeholder nothing reads)
    if SEGMENTS:
        seg_q = tl.load(sgq_ptr + b * sgq_b + offs_m, mask=offs_m < Lq, other=0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    kv_base = b * sk_b + hk * sk_h
    sgk_row = sgk_ptr + b * sgk_b
    mid = _unmasked_key_end(pid_m * BLOCK_M, Lk, q_start, k_start, CAUSAL, SEGMENTS, BLOCK_N)
    for n0 in range(0, mid, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_ptr, v_ptr, kv_base, n0, offs_m, offs_d, d_mask, Lq, Lk, q_start,
                                  k_start, sk_s, scale_log2, seg_q, sgk_row, CAUSAL, False, SEGMENTS, BLOCK_N,
                                  DOT_PRECISION)
    lo, hi = _span(mid, _key_end(pid_m, Lk, q_start, k_start, CAUSAL, BLOCK_M), span_ptr + b * span_b, pid_m, BLOCK_N,
                   SEGMENTS)
    for n0 in range(lo, hi, BLOCK_N):
        acc, m_i, l_i = _fwd_step(acc, m_i, l_i, q, k_ptr, v_ptr, kv_base, n0, offs_m, offs_d, d_mask, Lq, Lk, q_start,
                                  k_start, sk_s, scale_log2, seg_q, sgk_row, CAUSAL, True, SEGMENTS, BLOCK_N,
                                  DOT_PRECISION)
    # a row that saw no key sums exactly 0; a NaN sum (NaN or inf inputs) is not "nothing seen": it
    # propagates to out and lse, as in SDPA
    seen = l_i != 0
    out = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
    lse = tl.where(seen, (m_i + tl.log2(tl.where(seen, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(out_ptr + b * so_b + h * so_h + offs_m[:, None] * so_s + offs_d[None, :], out,
             mask=(offs_m[:, None] < Lq) & d_mask[None, :])
    tl.store(lse_ptr + b * sl_b + h * sl_h + offs_m, lse, mask=offs_m < Lq)


@triton.jit
def _probs(q, k, lse, offs_m, offs_n, Lq, Lk, q_start, k_start, scale_log2, seg_q, seg_k, CAUSAL: tl.constexpr,
           SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr, MASKED: tl.constexpr = True):
    """P = exp(scale q k^T - lse) of one tile, 0 where masked or where the row saw nothing. An
    unmasked tile is one every row sees, so each row's lse is finite (rows past Lq load lse = +inf:
    P = 0 there)."""
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    lse2 = lse * 1.4426950408889634
    if MASKED:
        keep = _visible(offs_m, offs_n, Lq, Lk, q_start, k_start, seg_q, seg_k, CAUSAL, SEGMENTS) \
            & (lse2 != float("-inf"))[:, None]
        p = tl.where(keep, tl.exp2(s - tl.where(keep, lse2[:, None], 0.0)), 0.0)
    else:
        p = tl.exp2(s - lse2[:, None])
    return p


@triton.jit
def _probs_t(k, q_t, lse, offs_m, offs_n, Lq, Lk, q_start, k_start, scale_log2, seg_q, seg_k, CAUSAL: tl.constexpr,
             SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """P^T [BLOCK_N, BLOCK_M] of one tile, computed as k @ q^T: ``_probs`` transposed, with the same
    zeros (masked, rows that saw nothing, rows past Lq: their lse loads as -inf)."""
    s_t = tl.dot(k, q_t, input_precision=DOT_PRECISION) * scale_log2
    lse2 = lse * 1.4426950408889634
    keep = (offs_n[:, None] < Lk) & (offs_m[None, :] < Lq) & (lse2 != float("-inf"))[None, :]
    if CAUSAL:
        keep = keep & ((q_start + offs_m)[None, :] >= (k_start + offs_n)[:, None])
    if SEGMENTS:
        keep = keep & (seg_k[:, None] == seg_q[None, :])
    return tl.where(keep, tl.exp2(s_t - tl.where(keep, lse2[None, :], 0.0)), 0.0)


@triton.jit
def _flash_bwd_dkdv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr, sgq_ptr, sgk_ptr, span_ptr,
                           sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sl_b, sl_h, sdk_b, sdk_h, sdk_s, sgq_b, sgk_b, span_b,
                           GROUP, Lq, Lk, D, q_start, k_start, scale, scale_log2,
                           CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """A program owns BLOCK_N keys and walks the queries. It works on transposed tiles (S^T = K Q^T,
    Q loaded as [D, BLOCK_M]), so every operand of a dot is a loaded tile or an accumulator in its
    natural layout, never the transpose of another dot's result (the form of Triton's own
    fused-attention tutorial). The earlier form, S = Q K^T then dots on tl.trans(P) and tl.trans(dS),
    passed the interpreter but computed dK/dV wrongly on an H200 (triton 3.6) with 16x64 tiles at
    D=256, 16x128 at D=128 and (likely) 32x128 at D=64, while 32x64 and 64x64 were right
    (benchmarks/results/h200_2026-11-30.md)."""
    pid_n, hk, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)  # (docstring)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < D
    kv_mask = (offs_n[:, None] < Lk) & d_mask[None, :]
    k, v = _load_kv_tile(k_ptr, v_ptr, b * sk_b + hk * sk_h, offs_n, offs_d, d_mask, Lk, sk_s)
    seg_k = offs_n  # (without ids: a placeholder nothing reads)
    if SEGMENTS:
        seg_k = tl.load(sgk_ptr + b * sgk_b + offs_n, mask=offs_n < Lk, other=0)
    dk = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    dv = tl.zeros((BLOCK_N, HEAD_DIM), tl.float32)
    lo = 0
    if CAUSAL:  # queries before this block's first key see none of it
        lo = tl.maximum(k_start + pid_n * BLOCK_N - q_start, 0) // BLOCK_M * BLOCK_M
    lo, hi = _span(lo, Lq, span_ptr + b * span_b, pid_n, BLOCK_M, SEGMENTS)
    for g in range(0, GROUP):  # every query head that reads this kv head (GQA)
        h = hk * GROUP + g
        q_base = b * sq_b + h * sq_h
        for m0 in range(lo, hi, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            q_t = tl.load(q_ptr + q_base + offs_m[None, :] * sq_s + offs_d[:, None],
                          mask=(offs_m[None, :] < Lq) & d_mask[:, None], other=0.0)
            do = tl.load(do_ptr + q_base + offs_m[:, None] * sq_s + offs_d[None, :],
                         mask=(offs_m[:, None] < Lq) & d_mask[None, :], other=0.0)
            lse = tl.load(lse_ptr + b * sl_b + h * sl_h + offs_m, mask=offs_m < Lq, other=float("-inf"))
            delta = tl.load(delta_ptr + b * sl_b + h * sl_h + offs_m, mask=offs_m < Lq, other=0.0)
            seg_q = offs_m
            if SEGMENTS:
                seg_q = tl.load(sgq_ptr + b * sgq_b + offs_m, mask=offs_m < Lq, other=0)
            p_t = _probs_t(k, q_t, lse, offs_m, offs_n, Lq, Lk, q_start, k_start, scale_log2, seg_q, seg_k, CAUSAL,
                           SEGMENTS, DOT_PRECISION)
            dv += tl.dot(p_t.to(do.dtype), do, input_precision=DOT_PRECISION)
            dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
            ds_t = p_t * (dp_t - delta[None, :])
            dk += tl.dot(ds_t.to(q_t.dtype), tl.trans(q_t), input_precision=DOT_PRECISION)
    out_base = b * sdk_b + hk * sdk_h
    out_off = offs_n[:, None] * sdk_s + offs_d[None, :]
    tl.store(dk_ptr + out_base + out_off, dk * scale, mask=kv_mask)
    tl.store(dv_ptr + out_base + out_off, dv, mask=kv_mask)


@triton.jit
def _dq_step(dq, q, do, lse, delta, k_ptr, v_ptr, kv_base, n0, offs_m, offs_d, d_mask, Lq, Lk, q_start, k_start, sk_s,
             scale_log2, seg_q, sgk_ptr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, SEGMENTS: tl.constexpr,
             BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k, v = _load_kv_tile(k_ptr, v_ptr, kv_base, offs_n, offs_d, d_mask, Lk, sk_s)
    seg_k = offs_n
    if SEGMENTS:
        seg_k = tl.load(sgk_ptr + offs_n, mask=offs_n < Lk, other=0)
    p = _probs(q, k, lse, offs_m, offs_n, Lq, Lk, q_start, k_start, scale_log2, seg_q, seg_k, CAUSAL, SEGMENTS,
               DOT_PRECISION, MASKED)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k, input_precision=DOT_PRECISION)


@triton.jit
def _flash_bwd_dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, sgq_ptr, sgk_ptr, span_ptr,
                         sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sl_b, sl_h, sdq_b, sdq_h, sdq_s, sgq_b, sgk_b, span_b,
                         GROUP, Lq, Lk, D, q_start, k_start, scale, scale_log2,
                         CAUSAL: tl.constexpr, SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         HEAD_DIM: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_m, h, b = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2).to(tl.int64)  # (docstring)
    hk = h // GROUP
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < D
    q_mask = (offs_m[:, None] < Lq) & d_mask[None, :]
    q_base = b * sq_b + h * sq_h
    q_off = offs_m[:, None] * sq_s + offs_d[None, :]
    q = tl.load(q_ptr + q_base + q_off, mask=q_mask, other=0.0)
    do = tl.load(do_ptr + q_base + q_off, mask=q_mask, other=0.0)
    lse = tl.load(lse_ptr + b * sl_b + h * sl_h + offs_m, mask=offs_m < Lq, other=float("inf"))
    delta = tl.load(delta_ptr + b * sl_b + h * sl_h + offs_m, mask=offs_m < Lq, other=0.0)
    seg_q = offs_m  # (without ids: a placeholder nothing reads)
    if SEGMENTS:
        seg_q = tl.load(sgq_ptr + b * sgq_b + offs_m, mask=offs_m < Lq, other=0)
    dq = tl.zeros((BLOCK_M, HEAD_DIM), tl.float32)
    kv_base = b * sk_b + hk * sk_h
    sgk_row = sgk_ptr + b * sgk_b
    mid = _unmasked_key_end(pid_m * BLOCK_M, Lk, q_start, k_start, CAUSAL, SEGMENTS, BLOCK_N)
    for n0 in range(0, mid, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_ptr, v_ptr, kv_base, n0, offs_m, offs_d, d_mask, Lq, Lk, q_start, k_start,
                      sk_s, scale_log2, seg_q, sgk_row, CAUSAL, False, SEGMENTS, BLOCK_N, DOT_PRECISION)
    lo, hi = _span(mid, _key_end(pid_m, Lk, q_start, k_start, CAUSAL, BLOCK_M), span_ptr + b * span_b, pid_m, BLOCK_N,
                   SEGMENTS)
    for n0 in range(lo, hi, BLOCK_N):
        dq = _dq_step(dq, q, do, lse, delta, k_ptr, v_ptr, kv_base, n0, offs_m, offs_d, d_mask, Lq, Lk, q_start, k_start,
                      sk_s, scale_log2, seg_q, sgk_row, CAUSAL, True, SEGMENTS, BLOCK_N, DOT_PRECISION)
    tl.store(dq_ptr + b * sdq_b + h * sdq_h + offs_m[:, None] * sdq_s + offs_d[None, :], dq * scale, mask=q_mask)


def _check(q, k, v):
    _check_dtype(q.dtype, q.device)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"flash attention (Triton): {name} needs a contiguous last dim, got strides {t.stride()}")
        _check_sizes(name, tuple(t.shape), t.stride())


def check_inputs(q_shape, kv_shape, dtype, device) -> None:
    """The kernels' limits for contiguous [B, H, S, D] q and k/v of these shapes: what ``_check``
    refuses inside a ring's first step, checked before the ring starts exchanging (refused there,
    the step's posted exchange was never waited for and every rank of the group hung)."""
    _check_dtype(dtype, device)
    for name, shape in (("q", tuple(q_shape)), ("k", tuple(kv_shape)), ("v", tuple(kv_shape))):
        strides = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        _check_sizes(name, shape, strides)


def _check_dtype(dtype, device) -> None:
    if dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"flash attention (Triton): dtype {dtype} not supported; expected float32, float16 or "
                         "bfloat16 (the torch backend takes float64)")
    if bf16_miscomputed(dtype, device):
        raise ValueError(bf16_message("flash attention (Triton)"))


def _check_sizes(name: str, shape: tuple, strides: tuple) -> None:
    # the grid's axes 1 and 2 (heads, batch) stop at 65535; offsets within one head are 32-bit
    if max(shape[0], shape[1]) > GRID_AXIS_MAX:
        raise ValueError(f"flash attention (Triton): {name}.shape={shape}: batch and heads must each be "
                         f"<= {GRID_AXIS_MAX} (CUDA's grid limit); split the batch or the heads")
    if shape[2] and (shape[2] - 1) * strides[2] + shape[3] > 2 ** 31:  # (its last offset: 2^31 - 1)
        raise ValueError(f"flash attention (Triton): {name} of shape {shape}, strides {strides}: one "
                         "head spans 2^31 elements or more (32-bit offsets within a head); pass contiguous "
                         "[B, H, S, D] blocks")


def _same_layout(k, v):
    """The kernels read v with k's strides: give both the same (the ring passes them alike; a caller
    may not, and a v laid out otherwise would be read wrongly, silently)."""
    return (k, v) if k.stride() == v.stride() else (k.contiguous(), v.contiguous())


def _head_dim(q) -> int:
    return max(16, triton.next_power_of_2(q.shape[-1]))


def block_forward(q, k, v, scale: float, *, q_start: int = 0, k_start: int = 0, causal: bool = False,
                  q_segments=None, k_segments=None):
    """-> out [B, H, Lq, D] fp32, lse [B, H, Lq] fp32. ``q_segments`` [B, Lq] / ``k_segments`` [B, Lk]:
    integer segment ids; a query sees only keys of its own segment."""
    _check(q, k, v)
    k, v = _same_layout(k, v)
    segments, sgq, sgk, sgq_b, sgk_b = segment_args(q, k, q_segments, k_segments)
    b, h, lq, d = q.shape
    out = torch.empty(b, h, lq, d, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, h, lq, dtype=torch.float32, device=q.device)
    head_dim = _head_dim(q)
    cfg = flash_configs(q.device, q.dtype, head_dim).fwd
    spans = tile_spans(sgq, sgk, cfg.block_m, cfg.block_n) if segments else q
    grid = (triton.cdiv(lq, cfg.block_m), h, b)  # query tiles fastest: a head's K/V stay in L2
    with launch_device(q.device):
        _flash_fwd_kernel[grid](q, k, v, out, lse, sgq, sgk, spans, q.stride(0), q.stride(1), q.stride(2),
                                k.stride(0), k.stride(1), k.stride(2), out.stride(0), out.stride(1), out.stride(2),
                                lse.stride(0), lse.stride(1), sgq_b, sgk_b, spans.stride(0) if segments else 0,
                                h // k.shape[1], lq, k.shape[2], d, q_start, k_start,
                                scale * LOG2E, CAUSAL=causal, SEGMENTS=segments, HEAD_DIM=head_dim,
                                DOT_PRECISION=dot_precision(q.dtype), **cfg.meta())
    return out, lse


def block_backward(q, k, v, dout, lse, delta, scale: float, *, q_start: int = 0, k_start: int = 0,
                   causal: bool = False, q_segments=None, k_segments=None):
    """-> dq [B, H, Lq, D], dk, dv [B, H_kv, Lk, D], fp32."""
    _check(q, k, v)
    k, v = _same_layout(k, v)
    segments, sgq, sgk, sgq_b, sgk_b = segment_args(q, k, q_segments, k_segments)
    b, h, lq, d = q.shape
    h_kv, lk = k.shape[1], k.shape[2]
    dout = dout.to(q.dtype)
    if dout.stride() != q.stride():  # the kernels read dout with q's strides: give both the same
        # (empty_like(q) is no help: for a q sliced out of a larger tensor it is dense, not q's layout)
        q, dout = q.contiguous(), dout.contiguous()
    lse, delta = lse.float().contiguous(), delta.float().contiguous()
    dq = torch.empty(b, h, lq, d, dtype=torch.float32, device=q.device)
    dk = torch.empty(b, h_kv, lk, d, dtype=torch.float32, device=q.device)
    dv = torch.empty_like(dk)
    head_dim = _head_dim(q)
    cfgs = flash_configs(q.device, q.dtype, head_dim)
    fixed = dict(CAUSAL=causal, SEGMENTS=segments, HEAD_DIM=head_dim, DOT_PRECISION=dot_precision(q.dtype))
    common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), lse.stride(0),
              lse.stride(1))
    # per key tile the query tiles its ids may meet (dK/dV), per query tile the key tiles (dQ)
    kq = tile_spans(sgk, sgq, cfgs.dkdv.block_n, cfgs.dkdv.block_m) if segments else q
    qk = tile_spans(sgq, sgk, cfgs.dq.block_m, cfgs.dq.block_n) if segments else q
    with launch_device(q.device):
        _flash_bwd_dkdv_kernel[(triton.cdiv(lk, cfgs.dkdv.block_n), h_kv, b)](
            q, k, v, dout, lse, delta, dk, dv, sgq, sgk, kq, *common, dk.stride(0), dk.stride(1), dk.stride(2), sgq_b,
            sgk_b, kq.stride(0) if segments else 0, h // h_kv, lq, lk, d, q_start, k_start, scale, scale * LOG2E,
            **fixed, **cfgs.dkdv.meta())
        _flash_bwd_dq_kernel[(triton.cdiv(lq, cfgs.dq.block_m), h, b)](
            q, k, v, dout, lse, delta, dq, sgq, sgk, qk, *common, dq.stride(0), dq.stride(1), dq.stride(2), sgq_b,
            sgk_b, qk.stride(0) if segments else 0, h // h_kv, lq, lk, d, q_start, k_start, scale, scale * LOG2E,
            **fixed, **cfgs.dq.meta())
    return dq, dk, dv
