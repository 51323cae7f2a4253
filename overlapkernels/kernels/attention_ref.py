"""Attention of one query block against one key/value block, in pure torch (fp32 math).

The reference backend of ring attention (the default on CPU) and the yardstick of the Triton
kernels. Blocks are contiguous position ranges: queries at q_start.., keys at k_start..; with
``causal`` a query sees keys at positions <= its own; with segment ids (``q_segments`` [B, Lq],
``k_segments`` [B, Lk], packed documents) only keys of its own segment. GQA: q [B, H, Lq, D], k/v [B, H_kv, Lk, D],
query head h reads kv head h // (H / H_kv) (grouped by reshaping, never by copying heads).
Rows that see no key get out = 0 and lse = -inf, never NaN (a NaN in q, k or v still propagates,
as in SDPA). Math runs in fp32, or fp64 for fp64 inputs (so CPU tests can compare tightly).
"""
from __future__ import annotations

import torch


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _acc(x: torch.Tensor) -> torch.Tensor:
    return x.to(acc_dtype(x.dtype))


def _grouped(q: torch.Tensor, h_kv: int) -> torch.Tensor:
    b, h, lq, d = q.shape
    return q.reshape(b, h_kv, h // h_kv, lq, d)


def _scores(q, k, scale, q_start, k_start, causal, q_segments=None, k_segments=None):
    """fp32 scores [B, H_kv, G, Lq, Lk] with masked entries at -inf."""
    qg = _grouped(_acc(q), k.shape[1])
    s = torch.matmul(qg, _acc(k).unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        q_pos = torch.arange(q.shape[2], device=q.device) + q_start
        k_pos = torch.arange(k.shape[2], device=q.device) + k_start
        s = s.masked_fill(q_pos[:, None] < k_pos[None, :], float("-inf"))
    if q_segments is not None:  # [B, 1, 1, Lq, Lk]: another segment's keys are hidden
        s = s.masked_fill((q_segments[:, :, None] != k_segments[:, None, :])[:, None, None], float("-inf"))
    return s


def _probs(s, lse):
    """exp(s - lse) with fully masked rows (lse = -inf) as 0 instead of NaN. Only -inf means
    "saw nothing": a NaN (or +inf) lse from NaN/inf inputs gives NaN, as SDPA does."""
    empty = lse == float("-inf")
    safe = torch.where(empty, torch.zeros_like(lse), lse)
    return torch.exp(s - safe[..., None]).masked_fill(empty[..., None], 0.0)


def block_forward(q, k, v, scale: float, *, q_start: int = 0, k_start: int = 0, causal: bool = False,
                  q_segments=None, k_segments=None):
    """-> out [B, H, Lq, D], lse [B, H, Lq] in the accumulation dtype."""
    b, h, lq, d = q.shape
    s = _scores(q, k, scale, q_start, k_start, causal, q_segments, k_segments)
    lse = torch.logsumexp(s, dim=-1)  # -inf for rows with no visible key
    out = torch.matmul(_probs(s, lse), _acc(v).unsqueeze(2))
    return out.reshape(b, h, lq, v.shape[-1]), lse.reshape(b, h, lq)


def block_backward(q, k, v, dout, lse, delta, scale: float, *, q_start: int = 0, k_start: int = 0,
                   causal: bool = False, q_segments=None, k_segments=None):
    """Gradients of one block given the *final* lse and delta = rowsum(dout * out) (fp32):
    -> dq [B, H, Lq, D], dk, dv [B, H_kv, Lk, D], in the accumulation dtype."""
    b, h, lq, d = q.shape
    h_kv = k.shape[1]
    s = _scores(q, k, scale, q_start, k_start, causal, q_segments, k_segments)
    p = _probs(s, _grouped(lse.unsqueeze(-1), h_kv).squeeze(-1))
    do = _grouped(_acc(dout), h_kv)
    dv = torch.matmul(p.transpose(-1, -2), do).sum(dim=2)
    dp = torch.matmul(do, _acc(v).unsqueeze(2).transpose(-1, -2))
    ds = p * (dp - _grouped(delta.unsqueeze(-1), h_kv))
    dq = torch.matmul(ds, _acc(k).unsqueeze(2)) * scale
    dk = torch.matmul(ds.transpose(-1, -2), _grouped(_acc(q), h_kv)).sum(dim=2) * scale
    return dq.reshape(b, h, lq, d), dk, dv


def merge(out, lse, block_out, block_lse):
    """Fold one block's (out, lse) into the running ones (fp32 or fp64), overflow-safe:
    out = o1 - sigmoid(l2 - l1) (o1 - o2), lse = l1 - logsigmoid(l1 - l2). A side whose lse is
    -inf (nothing seen yet / nothing visible) contributes nothing; a NaN on either side (a NaN or
    inf in q or k) propagates, as in SDPA, so a diverged run is not hidden behind finite output."""
    empty, block_empty = lse == float("-inf"), block_lse == float("-inf")
    both = ~empty & ~block_empty
    l1 = torch.where(both, lse, torch.zeros_like(lse))
    l2 = torch.where(both, block_lse, torch.zeros_like(block_lse))
    merged_out = out - torch.sigmoid(l2 - l1)[..., None] * (out - block_out)
    merged_lse = l1 - torch.nn.functional.logsigmoid(l1 - l2)
    out = torch.where(both[..., None], merged_out, torch.where(empty[..., None], block_out, out))
    lse = torch.where(both, merged_lse, torch.where(empty, block_lse, lse))
    return out, lse
