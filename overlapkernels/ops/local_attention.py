"""Attention over a sequence this process holds whole (no context parallelism): ring attention's
kernels and autograd on a ring of one, no process group involved.

The layers take it for packed documents without CP. On CUDA the Triton flash kernels mask by segment
id and bound each tile's loop to the tiles its documents can meet, in O(S) memory. SDPA would need a
dense [B, 1, S, S] mask (B x S^2 bytes a layer), which also moves it off its flash kernel onto one
that computes every tile, the causal half and other documents' included. Our kernels also beat
SDPA's flash backend on an H200 (benchmarks/results/h200_2026-11-30.md).
"""
from __future__ import annotations

import torch

from ..profiling.ranges import span
from ._autocast import autocast_off, backward_without_autocast
from ._autograd import first_order_only
from ._opaque import opaque_under_compile
from .ring_attention import RingAttention, _backward, _from_bhsd, _to_bhsd, attention_fake, attention_unflatten, checked_inputs


class LocalAttention(RingAttention):
    """``RingAttention`` on a ring of one (``group=None``): its table of shapes holds, nothing travels."""

    @staticmethod
    @first_order_only("local_attention", "its backward runs the flash kernels' backward, which has none of its own")
    @backward_without_autocast
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


# it drives Triton kernels and their span tables, as ring_attention does: opaque to torch.compile
@opaque_under_compile(fake=attention_fake, unflatten=attention_unflatten, casts=("q", "k", "v"))
def local_attention(q, k, v, *, causal=False, softmax_scale=None, qkv_format="bshd", return_lse=False,
                    segment_ids=None):
    """``softmax(scale q k^T + mask) v`` over the whole sequence in this process.

    q [B, S, H, D], k/v [B, S, H_kv, D] (``"sbhd"``: sequence first; H a multiple of H_kv). ``segment_ids``:
    an integer id per token [B, S] (batch first in either format); a query then sees only keys with its own
    id (and, if ``causal``, at or before its position). Returns out laid out like q, in q's dtype (inside
    ``torch.autocast``: its dtype, as SDPA); with ``return_lse`` also the log-sum-exp [B, H, S] in fp32 (-inf
    for rows that see no key), differentiable, as ``ring_attention``'s. The Triton kernels on CUDA, the
    torch reference elsewhere and for float64 (``ring_attention``'s choice)."""
    q, k, v, segments, scale, backend = checked_inputs(q, k, v, causal, softmax_scale, "contiguous", qkv_format,
                                                       return_lse, segment_ids)
    with span("ok/attention"), autocast_off(q.device):
        out, lse = LocalAttention.apply(_to_bhsd(q, qkv_format), _to_bhsd(k, qkv_format), _to_bhsd(v, qkv_format),
                                        segments, None, causal, scale, "contiguous", backend)
    # a copy laid out like q (callers .view() it), never the tensor saved for backward
    out = _from_bhsd(out, qkv_format).clone(memory_format=torch.contiguous_format)
    return (out, lse) if return_lse else out
