"""Context parallelism by all-to-all (DeepSpeed-Ulysses): trade the sequence split for a head split,
attend over the whole sequence, trade back.

Each rank holds a part of the sequence with every head. One all-to-all (q, k and v in one message)
gives each rank the whole sequence for H/P of the query heads and their key/value heads; the
attention is local (``local_attention``'s kernels, segment ids and all); a second all-to-all (out and
the lse) brings the output back to the sequence split. Backward is the same trades in reverse, around
the attention's backward: every move is a permutation, so gradients are exact.

The heads of a rank attend in ``head_chunks`` groups (2 by default where they split): group c + 1's
trade and group c - 1's trade back travel (async all-to-alls: NCCL's stream, gloo's threads) while
group c attends, so only the first trade and the last trade back are exposed, as with the ring's
first and last hops. Each group is a problem of its own: a query head's key/value head is in it.

Beside ``ring_attention``: two trades of activations per call (each moving (P-1)/P of q, k, v or
out, in ``head_chunks`` all-to-alls) instead of P-1 hops of K/V, and no per-step merge; but the heads must split over the group
(H and H_kv divisible by P, or P divisible by H_kv: those key/value heads are then copied, one per
rank that needs it) and the whole sequence's scores live on one rank per head. With GQA and a long
sequence the ring moves less; with many heads and a moderate sequence the all-to-alls are fewer and
larger messages.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..comm.collectives import all_gather, all_to_all
from ..parallel import resolve_group, shared_peers, uses_nccl
from ..profiling.ranges import span
from ._autocast import autocast_off, backward_without_autocast
from ._autograd import first_order_only
from ._opaque import opaque_under_compile
from ._validate import same_call_on_every_rank
from .ring_attention import (SEQ_DIM, _backend, _from_bhsd, _to_bhsd, attention_fake, attention_unflatten, checked_cp_inputs,
                             ring_backward, ring_forward)
from .sequence_shard import _LAYOUT_TAG, check_layout, check_layout_tag, reorder_parts, tag_layout


_ALIGN = 16  # bytes: each part's columns start aligned for any dtype's view (and 16-byte vector loads)


class _Trade:
    """One all-to-all in flight: ``blocks`` ([P, ...] each, any shapes and dtypes; block j of each
    goes to rank j) sent as one message of bytes; ``wait()`` -> what each rank sent, shaped alike
    (views of the received message), then ``finish`` of that list. Each block is copied once, into
    its columns of the message (padded to 16 bytes, so that every part can be viewed in its dtype);
    the finishes' reshapes make the one copy on the receiving side. gloo moves host memory only, so
    CUDA tensors travel through CPU copies there (N ranks sharing one GPU), and synchronously, as
    comm.ring's do."""

    def __init__(self, group, blocks: list, finish):
        world, self.finish = dist.get_world_size(group), finish
        # shapes and dtypes only: the blocks themselves (copies of chunks, dq/dk/dv) are not kept alive
        # while the message travels - send holds their bytes
        self.metas = [(t.shape, t.dtype) for t in blocks]
        nbytes = [t.numel() // world * t.element_size() for t in blocks]  # per rank
        self.spans, off = [], 0
        for n in nbytes:
            self.spans.append((off, n))
            off += -(-n // _ALIGN) * _ALIGN
        send = torch.empty(world, off, dtype=torch.uint8, device=blocks[0].device)
        for t, view in zip(blocks, self._views(send)):
            view.copy_(t)
        self.device = send.device
        if send.is_cuda and not uses_nccl(group):
            self.got, self.work = all_to_all(send.cpu(), group)[0].to(self.device), None
        else:
            self.got, self.work = all_to_all(send, group, async_op=True)
        self.send = send  # (kept until the wait: the collective reads it meanwhile)

    def _views(self, message: torch.Tensor) -> list:
        """Each part's columns of ``message`` [P, bytes], viewed in its dtype and shape (an empty part:
        a tensor of its own, as an empty message's strides allow no dtype view)."""
        return [message[:, off:off + n].view(dtype).view(shape) if n else message.new_empty(shape, dtype=dtype)
                for (off, n), (shape, dtype) in zip(self.spans, self.metas)]

    def wait(self) -> list:
        if self.work is not None:
            self.work.wait()
        out = self._views(self.got)
        self.send = self.got = None
        return self.finish(out)


def seq_to_heads(parts: list, group, layout: str) -> _Trade:
    """Starts the trade of [B, H_i, S_local, D_i] each for [B, H_i/P, S, D_i] each: this rank's H_i/P
    heads (head group r) over the whole sequence, in its order. One all-to-all for all of ``parts``."""
    world = dist.get_world_size(group)

    def finish(got):  # block i received: rank i's sequence part
        out = []
        for t in got:
            p, b, h, s_local, d = t.shape
            out.append(reorder_parts(t.permute(1, 2, 0, 3, 4).reshape(b, h, p * s_local, d), 2, layout, world,
                                to_sequence=True))
        return out

    # block j of each part (its head group j) goes to rank j
    return _Trade(group, [t.reshape(t.shape[0], world, t.shape[1] // world, *t.shape[2:]).transpose(0, 1)
                          for t in parts], finish)


def heads_to_seq(parts: list, group, layout: str) -> _Trade:
    """Starts the inverse of ``seq_to_heads``: [B, H_i/P, S, D_i] each -> [B, H_i, S_local, D_i] each."""
    world = dist.get_world_size(group)
    blocks = []
    for t in parts:  # block j: sequence part j (in the ranks' order) of this rank's head group
        b, h, s, d = t.shape
        ranked = reorder_parts(t, 2, layout, world, to_sequence=False)
        blocks.append(ranked.reshape(b, h, world, s // world, d).permute(2, 0, 1, 3, 4))
    # block i received: head group i of this rank's sequence part
    return _Trade(group, blocks, lambda got: [t.transpose(0, 1).reshape(t.shape[1], world * t.shape[2], *t.shape[3:])
                                              for t in got])


def _head_chunk(t: torch.Tensor, world: int, chunks: int, c: int) -> torch.Tensor:
    """Chunk ``c`` of ``chunks`` of every rank's head group of [B, H, ...]: heads j H/P + c H/(P chunks)
    + i for every rank j, a problem of its own (a query head's key/value head falls in its chunk)."""
    b, h = t.shape[:2]
    return t.reshape(b, world, chunks, h // (world * chunks), *t.shape[2:])[:, :, c].reshape(b, h // chunks,
                                                                                          *t.shape[2:])


def _merge_head_chunks(parts: list, world: int) -> torch.Tensor:
    """The inverse of ``_head_chunk`` over all chunks: [B, H/chunks, ...] each -> [B, H, ...]."""
    b, h = parts[0].shape[:2]
    rest = parts[0].shape[2:]
    return torch.stack([t.reshape(b, world, h // world, *rest) for t in parts], dim=2).reshape(b, h * len(parts),
                                                                                              *rest)


class _Ulysses(torch.autograd.Function):
    """Trades, attention and trades back, over ``chunks`` groups of heads in a pipeline: chunk c+1's
    q/k/v trade and chunk c-1's output trade travel while chunk c attends (forward), and likewise for
    the gradients (backward); with one chunk every trade is exposed. Every trade is a permutation.

    | tensor  | shape per rank              | forward                              | backward                        |
    |---------|-----------------------------|--------------------------------------|---------------------------------|
    | q, k, v | [B, H(kv), S_local, D]      | traded for [B, H(kv)/P, S, D]        | their gradients traded back     |
    | out     | [B, H/P, S, D] -> local     | traded back with the lse             | dout, dlse traded for the heads |
    """

    @staticmethod
    def forward(ctx, q, k, v, segments, group, causal, scale, layout, backend, chunks, ring_group, ring_layout):
        world = dist.get_world_size(group)
        ids = _whole_ids(segments, group, layout) if segments is not None else None

        def trade(c):
            return seq_to_heads([_head_chunk(t, world, chunks, c) for t in (q, k, v)], group, layout)

        saved, backs, nxt = [], [], trade(0)
        for c in range(chunks):
            cur, nxt = nxt, trade(c + 1) if c + 1 < chunks else None  # c + 1's trade travels while c attends
            with span(f"ok/ulysses_attention/chunk{c}/comm"):
                qh, kh, vh = cur.wait()
            with span(f"ok/ulysses_attention/chunk{c}/compute"):
                out, lse = ring_forward(qh, kh, vh, ring_group, causal, scale, ring_layout, backend, ids)
                out = out.to(q.dtype)
            saved += [qh, kh, vh, out, lse]  # (the lse in the accumulation dtype: fp64 inputs' backward needs it)
            # the lse [B, H/P, S] travels in fp32 (the API's, as ring_attention's) as a head dim of size 1
            backs.append(heads_to_seq([out, lse.to(torch.float32).unsqueeze(-1)], group, layout))
        with span("ok/ulysses_attention/comm"):
            results = [b.wait() for b in backs]
        ctx.save_for_backward(ids, *saved)
        ctx.args, ctx.device = (group, causal, scale, layout, backend, chunks, ring_group, ring_layout), q.device
        ctx.set_materialize_grads(False)
        return (_merge_head_chunks([r[0] for r in results], world),
                _merge_head_chunks([r[1] for r in results], world).squeeze(-1))

    @staticmethod
    @first_order_only("ulysses_attention")
    @backward_without_autocast
    def backward(ctx, dout, dlse):
        group, causal, scale, layout, backend, chunks, ring_group, ring_layout = ctx.args
        world = dist.get_world_size(group)
        ids, *saved = ctx.saved_tensors
        out0 = saved[3]  # chunk 0's output [B, H/(P chunks), S, D]: the local output's shape follows
        b, h_chunk, s, d = out0.shape
        h, s_local = h_chunk * chunks * world, s // world
        if dout is None:
            dout = torch.zeros(b, h, s_local, d, dtype=out0.dtype, device=out0.device)
        if dlse is None:
            dlse = torch.zeros(b, h, s_local, dtype=torch.float32, device=dout.device)

        def trade(c):
            return seq_to_heads([_head_chunk(dout, world, chunks, c), _head_chunk(dlse.unsqueeze(-1), world, chunks, c)],
                                group, layout)

        backs, nxt = [], trade(0)
        for c in range(chunks):
            cur, nxt = nxt, trade(c + 1) if c + 1 < chunks else None
            with span(f"ok/ulysses_attention/backward/chunk{c}/comm"):
                dout_h, dlse_h = cur.wait()
            qh, kh, vh, out, lse = saved[5 * c:5 * c + 5]
            with span(f"ok/ulysses_attention/backward/chunk{c}/compute"):
                dq, dk, dv = ring_backward(qh, kh, vh, ids, out, lse, dout_h.contiguous(), dlse_h.squeeze(-1),
                                           ring_group, causal, scale, ring_layout, backend)
            backs.append(heads_to_seq([dq.to(qh.dtype), dk.to(kh.dtype), dv.to(vh.dtype)], group, layout))
        with span("ok/ulysses_attention/backward/comm"):
            grads = [bk.wait() for bk in backs]
        dq, dk, dv = (_merge_head_chunks([g[i] for g in grads], world) for i in range(3))
        return dq, dk, dv, None, None, None, None, None, None, None, None, None


def _whole_ids(segments: torch.Tensor, group, layout: str) -> torch.Tensor:
    """Every rank's [B, S_local] ids -> the whole sequence's [B, S], in its order."""
    world = dist.get_world_size(group)
    ids = segments.transpose(0, 1).contiguous()  # [S_local, B]: all_gather stacks dim 0 in rank order
    if ids.is_cuda and not uses_nccl(group):
        gathered = all_gather(ids.cpu(), group)[0].to(ids.device)
    else:
        gathered = all_gather(ids, group)[0]
    return reorder_parts(gathered, 0, layout, world, to_sequence=True).transpose(0, 1).contiguous()


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


def _check_usp_tags(q, k, v, segment_ids, qkv_format, group, ring_group, ring_layout) -> None:
    """USP's inputs: a ring part (``layout``) cut contiguously within ``group``, as their tags say where
    ``shard_sequence`` made them (a wrong ring layout, or a zigzag cut within the group, attended
    wrongly without an error)."""
    seq_dim = SEQ_DIM.get(qkv_format) if isinstance(qkv_format, str) else None  # None: checked_inputs names it
    for name, t, dim in (("q", q, seq_dim), ("k", k, seq_dim), ("v", v, seq_dim), ("segment_ids", segment_ids, 1)):
        tags = getattr(t, _LAYOUT_TAG, {})
        inner = tags.get((dim, id(group)))
        if inner is not None and inner != "contiguous" and dist.get_world_size(group) > 1:
            raise ValueError(f"ulysses_attention: {name} was cut within group with layout={inner!r}; with ring_group "
                             "shard over the ring first (with layout) and then within group with layout='contiguous'")
        check_layout_tag(t, name, dim, ring_group, ring_layout, "ulysses_attention (ring_group)")


def _check_chunks(head_chunks, heads: int, kv_heads: int) -> int:
    """-> the number of head groups; ``heads`` / ``kv_heads``: per rank after the trade."""
    if head_chunks is None:
        return 2 if heads % 2 == 0 and kv_heads % 2 == 0 else 1
    if isinstance(head_chunks, bool) or not isinstance(head_chunks, int) or head_chunks < 1 or heads % head_chunks \
            or kv_heads % head_chunks:
        raise ValueError(f"head_chunks={head_chunks!r}: expected an integer >= 1 dividing the {heads} query and "
                         f"{kv_heads} key/value heads each rank attends with, or None")
    return head_chunks


@opaque_under_compile(fake=attention_fake, unflatten=attention_unflatten, casts=("q", "k", "v"))  # see _opaque
def ulysses_attention(q, k, v, group=None, *, causal=False, softmax_scale=None, layout="contiguous",
                      qkv_format="bshd", return_lse=False, segment_ids=None, head_chunks=None, ring_group=None):
    """Attention of this rank's queries over the whole sequence spread across ``group``, by
    all-to-all (DeepSpeed-Ulysses). Arguments and results as ``ring_attention``'s: q [B, S_local, H, D],
    k/v [B, S_local, H_kv, D] (``"sbhd"``: sequence first) laid out as ``shard_sequence(...,
    layout=layout)`` lays them out; ``segment_ids`` [B, S_local] sharded as q; returns out like q (and
    with ``return_lse`` the fp32 log-sum-exp [B, H, S_local]). Also needs H divisible by the group
    size, and H_kv divisible by it or dividing it (fewer key/value heads than ranks are copied).
    ``head_chunks``: the heads of each rank attend in this many groups, each group's all-to-alls
    travelling while its neighbours attend (1: every all-to-all exposed); it must divide the query and
    the key/value heads per rank. None: 2 where they split in two, else 1.

    ``ring_group``: context parallelism over ``group`` x ``ring_group`` (USP: all-to-alls within
    ``group``, say a node's GPUs, and a ring across ``ring_group``, say the nodes). The sequence is
    then sharded over the ring first, with ``layout``, and each ring part contiguously over ``group``:
    ``shard_sequence(shard_sequence(x, ring_group, layout=layout), group, layout="contiguous")``;
    after the trade each rank holds its ring part for H/P heads and attends as ``ring_attention``
    over ``ring_group``, segment ids and all. The two groups are orthogonal (they share this rank
    only) and aligned: every rank of ``ring_group`` has the same rank in a ``group`` of the same
    size (it holds the same heads), as the two dims of a DeviceMesh are; checked under
    TORCH_DISTRIBUTED_DEBUG=DETAIL (and overlapping groups always)."""
    group = resolve_group(group)
    world = dist.get_world_size(group)
    ring_group = None if ring_group is None else resolve_group(ring_group, "ring_group")
    # the trade's own layout: the sequence's, or within a ring part (USP) contiguous
    trade_layout, ring_layout = ("contiguous", check_layout(layout)) if ring_group is not None else (layout, "contiguous")
    device = getattr(q, "device", None)
    # USP: the ranks of the ring compare their calls too (they exchange K/V blocks of the same heads)
    ring_check = (same_call_on_every_rank(ring_group, "ulysses_attention (ring_group)", device)
                  if ring_group is not None else contextlib.nullcontext())
    with same_call_on_every_rank(group, "ulysses_attention", device) as call, ring_check as ring_call:
        if ring_group is not None:
            if shared := shared_peers(group, ring_group):
                raise ValueError(f"ulysses_attention: group and ring_group share ranks {shared} besides this one: "
                                 "expected orthogonal groups (say a node's ranks and one rank per node)")
            _check_usp_tags(q, k, v, segment_ids, qkv_format, group, ring_group, ring_layout)  # the ring's layout
        q, k, v, segments, scale, backend = checked_cp_inputs(call, "ulysses_attention", group, q, k, v, causal,
                                                              softmax_scale, trade_layout, qkv_format, return_lse,
                                                              segment_ids)
        if ring_layout == "zigzag" and q.shape[SEQ_DIM[qkv_format]] * world % 2:
            raise ValueError(f"ulysses_attention: a ring part of {q.shape[SEQ_DIM[qkv_format]] * world} positions "
                             f"(q's local {q.shape[SEQ_DIM[qkv_format]]} x the group's {world}) is odd: layout='zigzag' "
                             "over ring_group needs two equal halves")
        call.args["ring"] = None if ring_group is None else (dist.get_world_size(ring_group), ring_layout)
        copies = check_heads(q.shape[2], k.shape[2], world, f"q ({qkv_format} dim 2)")
        chunks = _check_chunks(head_chunks, q.shape[2] // world, k.shape[2] * copies // world)
        call.args["head_chunks"] = chunks
        if ring_call is not None:  # and the ring's ranks hold the same heads: the same rank in their groups
            ring_call.args = dict(call.args, group=f"rank {dist.get_rank(group)} of {world}")
        if backend == "triton":  # the kernels' limits for what they will see: H/P heads of the whole sequence
            (b, h, s, d), h_kv = _to_bhsd(q, qkv_format).shape, k.shape[2] * copies
            _backend(backend).check_inputs((b, h // world, s * world, d), (b, h_kv // world, s * world, d), q.dtype,
                                           q.device)
    with span("ok/ulysses_attention"), autocast_off(q.device):
        q, k, v = (_to_bhsd(t, qkv_format) for t in (q, k, v))
        if copies > 1:  # rank r's query heads all use key/value head r // copies
            k, v = k.repeat_interleave(copies, dim=1), v.repeat_interleave(copies, dim=1)
        out, lse = _Ulysses.apply(q, k, v, segments, group, causal, scale, trade_layout, backend, chunks, ring_group,
                                  ring_layout)
    # copies laid out like q (callers .view() it) and never the tensors saved for backward, as ring_attention's
    out = _from_bhsd(out, qkv_format).clone(memory_format=torch.contiguous_format)
    if ring_group is not None:  # a part of the ring's part, as the inputs were
        tag_layout(out, SEQ_DIM[qkv_format], ring_group, ring_layout)
    out = tag_layout(out, SEQ_DIM[qkv_format], group, trade_layout, inherit=out)
    return (out, lse.clone()) if return_lse else out

