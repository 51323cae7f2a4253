"""Segment ids (packed documents) for the flash kernels: the launch arguments' checks, and for each tile
of one side the first and last tile of the other side whose ids can meet it (``_span`` in
flash_attn.py bounds the kernels' loops with them), made on the ids' device by two small kernels
per call: no host sync."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ids import integer_ids
from .tile_gemm import launch_device

# at most this many (row tile, column tile) pairs compared at once (bytes of a bool tensor)
_PAIRS_AT_ONCE = 1 << 24
# column tiles the span kernel compares per loop step
_SPAN_CHUNK = 1024


def segment_args(q, k, q_segments, k_segments) -> tuple:
    """(SEGMENTS, q ids, k ids, their batch strides) of a launch: both int64 (compared in one dtype,
    as torch compares them: int8 -1 is not uint8 255), with a unit position stride; without ids, q
    twice (pointers nothing reads)."""
    if q_segments is None and k_segments is None:
        return False, q, q, 0, 0
    for name, ids, t in (("q_segments", q_segments, q), ("k_segments", k_segments, k)):
        if not integer_ids(ids) or tuple(ids.shape) != (t.shape[0], t.shape[2]):
            raise ValueError(f"flash attention (Triton): {name} must be integer ids [B, L] = "
                             f"{[t.shape[0], t.shape[2]]} (both or neither given), got "
                             f"{(ids.dtype, tuple(ids.shape)) if isinstance(ids, torch.Tensor) else ids}")
        if ids.device != q.device:
            raise ValueError(f"flash attention (Triton): {name} is on {ids.device} but q is on {q.device}")
    q_segments, k_segments = (ids.to(torch.int64) for ids in (q_segments, k_segments))
    q_segments, k_segments = (ids if ids.stride(-1) == 1 else ids.contiguous() for ids in (q_segments, k_segments))
    return True, q_segments, k_segments, q_segments.stride(0), k_segments.stride(0)


@triton.jit
def _tile_range(row, t, L, BLOCK: tl.constexpr):
    """(min, max) of tile ``t`` of the ids at ``row`` (positions past L read as the tile's first: no new id)."""
    offs = t * BLOCK + tl.arange(0, BLOCK)
    ids = tl.where(offs < L, tl.load(row + offs, mask=offs < L, other=0), tl.load(row + t * BLOCK))
    return tl.min(ids, 0), tl.max(ids, 0)


@triton.jit
def _tile_range_kernel(ids_ptr, out_ptr, L, ids_b, out_b, BLOCK: tl.constexpr):
    """[min, max] of one tile of one row's ids."""
    t, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    lo, hi = _tile_range(ids_ptr + b * ids_b, t, L, BLOCK)
    tl.store(out_ptr + b * out_b + 2 * t, lo)
    tl.store(out_ptr + b * out_b + 2 * t + 1, hi)


@triton.jit
def _tile_span_kernel(ids_ptr, ranges_ptr, out_ptr, L, col_tiles, ids_b, ranges_b, out_b, BLOCK: tl.constexpr,
                      CHUNK: tl.constexpr):
    """One row tile's [first, last] column tile whose [min, max] (``ranges``) meets its own."""
    t, b = tl.program_id(0), tl.program_id(1).to(tl.int64)
    lo, hi = _tile_range(ids_ptr + b * ids_b, t, L, BLOCK)
    first, last = col_tiles + 0, col_tiles * 0 - 1  # (tensors: loop-carried)
    for c0 in range(0, col_tiles, CHUNK):
        c = c0 + tl.arange(0, CHUNK)
        inside = c < col_tiles
        cmin = tl.load(ranges_ptr + b * ranges_b + 2 * c, mask=inside, other=0)
        cmax = tl.load(ranges_ptr + b * ranges_b + 2 * c + 1, mask=inside, other=0)
        meets = inside & (cmin <= hi) & (cmax >= lo)
        first = tl.minimum(first, tl.min(tl.where(meets, c, col_tiles), 0))
        last = tl.maximum(last, tl.max(tl.where(meets, c, -1), 0))
    tl.store(out_ptr + b * out_b + 2 * t, first)
    tl.store(out_ptr + b * out_b + 2 * t + 1, last)


def tile_spans(row_ids: torch.Tensor, col_ids: torch.Tensor, block_rows: int, block_cols: int) -> torch.Tensor:
    """int32 [B, row tiles, 2]: for each row tile, the first and last column tile whose id range
    meets its own ([tiles, -1] where none does). Ranges that do not meet share no id, so the tiles
    outside [first, last] hold nothing the row tile may see; with ids in order (packing) the tiles
    inside all meet it. Two launches (the column tiles' ranges, then the spans), where the same in
    torch ops (``tile_spans_reference``) took about twenty small kernels per call."""
    b, rows = row_ids.shape
    if col_ids.shape[0] != b:
        raise ValueError(f"tile_spans: row_ids {tuple(row_ids.shape)} and col_ids {tuple(col_ids.shape)} differ in batch")
    # the kernels read positions at unit stride (rows at any stride, expanded ones too)
    row_ids, col_ids = (t if t.shape[1] <= 1 or t.stride(1) == 1 else t.contiguous() for t in (row_ids, col_ids))
    row_tiles, col_tiles = triton.cdiv(rows, block_rows), triton.cdiv(col_ids.shape[1], block_cols)
    out = torch.empty(b, row_tiles, 2, dtype=torch.int32, device=row_ids.device)
    if not (b and row_tiles):
        return out
    ranges = torch.empty(b, col_tiles, 2, dtype=torch.int64, device=row_ids.device)
    with launch_device(row_ids.device):
        if col_tiles:
            _tile_range_kernel[(col_tiles, b)](col_ids, ranges, col_ids.shape[1], col_ids.stride(0), ranges.stride(0),
                                               BLOCK=block_cols)
        _tile_span_kernel[(row_tiles, b)](row_ids, ranges, out, rows, col_tiles, row_ids.stride(0), ranges.stride(0),
                                          out.stride(0), BLOCK=block_rows,
                                          CHUNK=min(_SPAN_CHUNK, triton.next_power_of_2(max(col_tiles, 1))))
    return out


def tile_ranges(ids: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each tile's smallest and largest id, [B, tiles] each (the last tile padded with its row's
    last id, which adds no id). For ``tile_spans_reference``."""
    b, length = ids.shape
    tiles = -(-length // block)
    if tiles * block > length:
        ids = torch.cat([ids, ids[:, -1:].expand(b, tiles * block - length)], dim=1)
    ids = ids.reshape(b, tiles, block)
    return ids.amin(-1), ids.amax(-1)


def tile_spans_reference(row_ids: torch.Tensor, col_ids: torch.Tensor, block_rows: int,
                         block_cols: int) -> torch.Tensor:
    """``tile_spans`` in torch ops, by comparing every pair of tiles (the tests' yardstick)."""
    rmin, rmax = tile_ranges(row_ids, block_rows)
    cmin, cmax = tile_ranges(col_ids, block_cols)
    b, col_tiles = cmin.shape
    if col_tiles == 0:  # an empty other side: nothing to walk
        return torch.tensor([0, -1], dtype=torch.int32, device=row_ids.device).expand(b, rmin.shape[1], 2).contiguous()
    at_once = max(1, _PAIRS_AT_ONCE // max(1, b * col_tiles))
    spans = []
    for r0 in range(0, rmin.shape[1], at_once):
        lo, hi = rmin[:, r0:r0 + at_once, None], rmax[:, r0:r0 + at_once, None]
        meets = (cmin[:, None, :] <= hi) & (cmax[:, None, :] >= lo)  # [B, rows, cols]
        found = meets.any(-1)
        first = torch.where(found, meets.int().argmax(-1), col_tiles)
        last = torch.where(found, col_tiles - 1 - meets.flip(-1).int().argmax(-1), -1)
        spans.append(torch.stack([first, last], dim=-1))
    if not spans:
        return torch.zeros(b, 0, 2, dtype=torch.int32, device=row_ids.device)
    return torch.cat(spans, dim=1).to(torch.int32).contiguous()
