"""Context parallelism by all-to-all (DeepSpeed-Ulysses): trade the sequence split for a head split,
attend over the whole sequence, trade back.

Each rank holds a part of the sequence with every head. One all-to-all (q, k and v in one message)
gives each rank the whole sequence for H/P of the query heads and their key/value heads; the
attention is local (``local_attention``'s kernels and autograd, segment ids and all); a second
all-to-all brings the output back to the sequence split. Backward is the same trades in reverse,
around the attention's backward: every move is a permutation, so gradients are exact.

Beside ``ring_attention``: two all-to-alls of activations per call (each moving (P-1)/P of q, k, v
or out) instead of P-1 hops of K/V, and no per-step merge; but the heads must split over the group
(H and H_kv divisible by P, or P divisible by H_kv: those key/value heads are then copied, one per
rank that needs it) and the whole sequence's scores live on one rank per head. With GQA and a long
sequence the ring moves less; with many heads and a moderate sequence the all-to-alls are fewer and
larger messages.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .._compat import eager_under_compile
from ..comm.collectives import all_gather, all_to_all
from ..parallel import resolve_group, uses_nccl
from ..profiling.ranges import span
from ._autocast import autocast_off
from ._autograd import first_order_only
from ._validate import same_call_on_every_rank
from .local_attention import LocalAttention
from .ring_attention import SEQ_DIM, _backend, _from_bhsd, _to_bhsd, checked_cp_inputs
from .sequence_shard import _chunk_order, _split_count, tag_layout


def _reorder(x: torch.Tensor, dim: int, layout: str, world: int, to_natural: bool) -> torch.Tensor:
    """Along ``dim``: the ranks' parts in rank order (what an all-to-all or all-gather lines up) to
    the sequence's own order, or back. Contiguous: the same order."""
    if layout == "contiguous" or world == 1:
        return x
    order = _chunk_order(layout, world)  # global chunk held at each rank-order position
    chunks = x.chunk(_split_count(layout, world), dim=dim)
    if to_natural:
        where = {c: pos for pos, c in enumerate(order)}
        return torch.cat([chunks[where[c]] for c in range(len(order))], dim=dim)
    return torch.cat([chunks[c] for c in order], dim=dim)


def _exchange_over(group, blocks: list) -> list:
    """All-to-all of ``blocks`` ([P, ...] each, any shapes and dtypes: block j of each goes to rank j)
    as one message of bytes -> what each rank sent, shaped alike. gloo moves host memory only, so
    CUDA tensors travel through CPU copies there (N ranks sharing one GPU), as comm.ring does."""
    world = dist.get_world_size(group)
    flat = [t.contiguous().reshape(world, -1).view(torch.uint8) for t in blocks]
    send = torch.cat(flat, dim=1)
    staged = send.is_cuda and not uses_nccl(group)
    got = all_to_all(send.cpu() if staged else send, group)[0]
    got = got.to(send.device) if staged else got
    out = []
    for part, t in zip(got.split([f.shape[1] for f in flat], dim=1), blocks):
        res = torch.empty(t.shape, dtype=t.dtype, device=got.device)  # fresh, aligned, whatever part's offset
        if res.numel():
            res.view(world, -1).view(torch.uint8).copy_(part)
        out.append(res)
    return out


def seq_to_heads(parts: list, group, layout: str) -> list:
    """[B, H_i, S_local, D_i] each -> [B, H_i/P, S, D_i] each: this rank's H_i/P heads (head group
    r) over the whole sequence, in its order. One all-to-all for all of ``parts``."""
    world = dist.get_world_size(group)
    # block j of each part (its head group j) goes to rank j; block i received: rank i's sequence part
    blocks = [t.reshape(t.shape[0], world, t.shape[1] // world, *t.shape[2:]).transpose(0, 1) for t in parts]
    got = _exchange_over(group, blocks)
    out = []
    for t in got:
        p, b, h, s_local, d = t.shape
        whole = t.permute(1, 2, 0, 3, 4).reshape(b, h, p * s_local, d)
        out.append(_reorder(whole, 2, layout, world, to_natural=True))
    return out


def heads_to_seq(parts: list, group, layout: str) -> list:
    """The inverse of ``seq_to_heads``: [B, H_i/P, S, D_i] each -> [B, H_i, S_local, D_i] each."""
    world = dist.get_world_size(group)
    blocks = []
    for t in parts:  # block j: sequence part j (in the ranks' order) of this rank's head group
        b, h, s, d = t.shape
        ranked = _reorder(t, 2, layout, world, to_natural=False)
        blocks.append(ranked.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4))
    got = _exchange_over(group, blocks)  # block i: head group i of this rank's sequence part
    return [t.transpose(0, 1).reshape(t.shape[1], world * t.shape[2], *t.shape[3:]) for t in got]


class _Trade(torch.autograd.Function):
    """``seq_to_heads`` (q, k, v) or ``heads_to_seq`` (out, lse) forward, the other on the gradients
    backward: a permutation's gradient is its inverse (a gradient autograd leaves None arrives as
    zeros: the lse's when only out is used)."""

    @staticmethod
    def forward(ctx, to_heads: bool, group, layout, *parts):
        ctx.args = to_heads, group, layout
        return tuple((seq_to_heads if to_heads else heads_to_seq)(list(parts), group, layout))

    @staticmethod
    @first_order_only("ulysses_attention")
    def backward(ctx, *grads):
        to_heads, group, layout = ctx.args
        return (None, None, None, *(heads_to_seq if to_heads else seq_to_heads)(list(grads), group, layout))


def _whole_ids(segments: torch.Tensor, group, layout: str) -> torch.Tensor:
    """Every rank's [B, S_local] ids -> the whole sequence's [B, S], in its order."""
    world = dist.get_world_size(group)
    ids = segments.transpose(0, 1).contiguous()  # [S_local, B]: all_gather stacks dim 0 in rank order
    if ids.is_cuda and not uses_nccl(group):
        gathered = all_gather(ids.cpu(), group)[0].to(ids.device)
    else:
        gathered = all_gather(ids, group)[0]
    return _reorder(gathered, 0, layout, world, to_natural=True).transpose(0, 1).contiguous()


def check_heads(heads: int, kv_heads: int, world: int, what: str = "q") -> int:
    """Whether H query and H_kv key/value heads split over ``world`` ranks -> how many copies of each
    key/value head travel (1, or P / H_kv when P > H_kv); a ValueError naming ``what`` otherwise."""
    if heads % world:
        raise ValueError(f"ulysses_attention: {what} has {heads} heads, not divisible by the group size {world}: "
                         "each rank attends with H/P of them (ring_attention has no such limit)")
    if kv_heads % world == 0:
        return 1
    if world % kv_heads:
        raise ValueError(f"ulysses_attention: k/v have {kv_heads} heads and the group {world} ranks: expected one to "
                         "divide the other (each rank needs the key/value heads of its query heads)")
    return world // kv_heads


@eager_under_compile  # takes a ProcessGroup: see _compat
def ulysses_attention(q, k, v, group=None, *, causal=False, softmax_scale=None, layout="contiguous",
                      qkv_format="bshd", return_lse=False, segment_ids=None):
    """Attention of this rank's queries over the whole sequence spread across ``group``, by
    all-to-all (DeepSpeed-Ulysses). Arguments and results as ``ring_attention``'s: q [B, S_local, H, D],
    k/v [B, S_local, H_kv, D] (``"sbhd"``: sequence first) laid out as ``shard_sequence(...,
    layout=layout)`` lays them out; ``segment_ids`` [B, S_local] sharded as q; returns out like q (and
    with ``return_lse`` the fp32 log-sum-exp [B, H, S_local]). Also needs H divisible by the group
    size, and H_kv divisible by it or dividing it (fewer key/value heads than ranks are copied)."""
    group = resolve_group(group)
    world = dist.get_world_size(group)
    with same_call_on_every_rank(group, "ulysses_attention", getattr(q, "device", None)) as call:
        q, k, v, segments, scale, backend = checked_cp_inputs(call, "ulysses_attention", group, q, k, v, causal,
                                                              softmax_scale, layout, qkv_format, return_lse,
                                                              segment_ids)
        copies = check_heads(q.shape[2], k.shape[2], world, f"q ({qkv_format} dim 2)")
        if backend == "triton":  # the kernels' limits for what they will see: H/P heads of the whole sequence
            (b, h, s, d), h_kv = _to_bhsd(q, qkv_format).shape, k.shape[2] * copies
            _backend(backend).check_inputs((b, h // world, s * world, d), (b, h_kv // world, s * world, d), q.dtype,
                                           q.device)
    with span("ok/ulysses_attention"), autocast_off(q.device):
        q, k, v = (_to_bhsd(t, qkv_format) for t in (q, k, v))
        if copies > 1:  # rank r's query heads all use key/value head r // copies
            k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        qh, kh, vh = _Trade.apply(True, group, layout, q, k, v)
        whole_ids = _whole_ids(segments, group, layout) if segments is not None else None
        out, lse = LocalAttention.apply(qh, kh, vh, whole_ids, None, causal, scale, "contiguous", backend)
        # the lse [B, H/P, S] travels as a head dim of size 1 beside out's D
        out, lse = _Trade.apply(False, group, layout, out, lse.unsqueeze(-1))
    out = tag_layout(_from_bhsd(out, qkv_format).clone(memory_format=torch.contiguous_format), SEQ_DIM[qkv_format],
                     group, layout)
    return (out, lse.squeeze(-1).clone()) if return_lse else out

