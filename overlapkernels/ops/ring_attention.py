"""Ring attention for context parallelism: local queries, key/value blocks passed around a ring.

Step s of P: attend the local queries to the block of rank (r - s) % P while the next block
travels (batch_isend_irecv, double buffered), and fold the result into running (out, lse) with
the overflow-safe sigmoid merge. Causal blocks are cut into contiguous position segments (two per
rank under zigzag): hidden segment pairs are skipped, partly visible ones masked by position.
Only the H_kv key/value heads travel (GQA is never expanded on the wire). With segment ids
(packed documents) each block's ids travel with it, and a query sees only keys of its own segment.

Backward recomputes each block with the final (out, lse) and delta = rowsum(dO * O). dQ adds up
locally; each block's dK/dV partial sum travels with the block and, after a last hop, reaches
its owner, summed in ring order (fixed, so results never depend on timing).
"""
from __future__ import annotations

import math
import numbers

import torch

from ..comm.ring import Ring, settled_on_error, wait_all
from ..kernels import attention_ref
from ..kernels.ids import integer_ids
from ..parallel import resolve_group
from ..profiling.ranges import span
from ._autocast import autocast_dtype, autocast_off, backward_without_autocast, cast_operands
from ._autograd import first_order_only
from ._opaque import opaque_under_compile
from ._validate import check_float_dtype, check_tensor, same_call_on_every_rank
from .sequence_shard import check_layout, check_layout_tag, segments, tag_layout

FORMATS = ("bshd", "sbhd")
SEQ_DIM = {"bshd": 1, "sbhd": 0}
KV_TAG, GRAD_TAG = 0, 1  # two exchanges may be in flight between the same ranks


def _backend(name: str):
    if name == "triton":
        from ..kernels.triton import flash_attn

        return flash_attn
    return attention_ref


def default_backend(q: torch.Tensor) -> str:
    """The Triton flash kernels on CUDA in 16-bit and fp32; the torch reference on CPU (where Triton
    only interprets) and for float64, which the kernels do not take and SDPA does (numerics checks)."""
    return "triton" if q.is_cuda and q.dtype != torch.float64 else "torch"


def _visibility(q_start, q_len, k_start, k_len, causal) -> str:
    """How much of a key segment a query segment sees: 'none', 'full' or 'partial'."""
    if not causal or k_start + k_len - 1 <= q_start:
        return "full"
    if k_start > q_start + q_len - 1:
        return "none"
    return "partial"


def _block_pairs(layout, world, rank, src, length, causal):
    """(query segment, key segment, causal-mask needed) for the block of rank ``src``."""
    for q_off, q_start, q_len in segments(layout, world, rank, length):
        for k_off, k_start, k_len in segments(layout, world, src, length):
            vis = _visibility(q_start, q_len, k_start, k_len, causal)
            if vis != "none":
                yield (q_off, q_start, q_len), (k_off, k_start, k_len), vis == "partial"


def _kv_for_step(k_cur, v_cur, k_own, v_own, step):
    """The K/V block to use at ``step``: the one that just arrived (tests swap this to plant the
    stale-KV bug - using step 0's block - and check that they catch it)."""
    return k_cur, v_cur


def _empty_result(q):
    acc = attention_ref.acc_dtype(q.dtype)
    return (torch.zeros(q.shape, dtype=acc, device=q.device),
            torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device))


def _segment_slices(q_segments, k_segments, qo, ql, ko, kl) -> dict:
    """The segment-id keywords of one (query segment, key segment) pair's kernel call."""
    if q_segments is None:
        return {}
    return dict(q_segments=q_segments[:, qo:qo + ql], k_segments=k_segments[:, ko:ko + kl])


def _attend_block(out, lse, q, kb, vb, kern, scale, layout, world, rank, src, causal, q_segments=None,
                  k_segments=None):
    """Fold the attention of the local queries to rank ``src``'s K/V block into (out, lse)."""
    for (qo, qs, ql), (ko, ks, kl), masked in _block_pairs(layout, world, rank, src, q.shape[2], causal):
        o, l = kern.block_forward(q[:, :, qo:qo + ql], kb[:, :, ko:ko + kl], vb[:, :, ko:ko + kl], scale,
                                  q_start=qs, k_start=ks, causal=masked,
                                  **_segment_slices(q_segments, k_segments, qo, ql, ko, kl))
        out[:, :, qo:qo + ql], lse[:, :, qo:qo + ql] = attention_ref.merge(
            out[:, :, qo:qo + ql], lse[:, :, qo:qo + ql], o.to(out.dtype), l.to(lse.dtype))


def _travelling(k, v, segments) -> tuple:
    """What travels the ring with each block: K and V, and its segment ids when there are any."""
    return (k, v) if segments is None else (k, v, segments)


def _ids_of(block) -> torch.Tensor | None:
    """A travelling block's segment ids (None without)."""
    return block[2] if len(block) == 3 else None


def _ring(group) -> Ring:
    """``group=None``: a ring of one, for ``local_attention`` (attention over a sequence held whole)."""
    return Ring.alone() if group is None else Ring.of(group)


def _op_name(group) -> str:
    """The op's name in profiles (NVTX ranges, `profile report`)."""
    return "ok/attention" if group is None else "ok/ring_attention"


def ring_forward(q, k, v, group, causal, scale, layout, backend, segments=None):
    """q [B, H, S, D], k/v [B, H_kv, S, D] contiguous, segments [B, S] or None -> out, lse in the
    accumulation dtype."""
    ring, name, kern = _ring(group), _op_name(group), _backend(backend)
    r, world = ring.rank, ring.world_size
    out, lse = _empty_result(q)
    own = _travelling(k, v, segments)
    # never overwrite the caller's k/v; a ring of one (local_attention, ulysses_attention) receives nothing
    bufs = [tuple(torch.empty_like(t) for t in own) for _ in range(2)] if world > 1 else None
    cur = own
    for step in range(world):
        pending = None
        if step + 1 < world:
            nxt = bufs[step % 2]
            pending = ring.exchange(list(cur), r + 1, list(nxt), r - 1, tag=KV_TAG)
        with span(f"{name}/step{step}/compute"), settled_on_error(pending):
            kb, vb = _kv_for_step(cur[0], cur[1], k, v, step)
            _attend_block(out, lse, q, kb, vb, kern, scale, layout, world, r, (r - step) % world, causal, segments,
                          _ids_of(cur))
        if pending:
            with span(f"{name}/step{step}/comm"):
                wait_all(pending)
            cur = nxt
    return out, lse


def allgather_kv_forward(q, k, v, group, causal, scale, layout, backend, *, communicate=True, segments=None,
                         source_segments=None):
    """The unoverlapped baseline: all-gather K and V (and segment ids), then attend to every block.
    With ``communicate=False`` it attends to the local block P times: the same compute, no traffic
    (T_compute of the overlap efficiency); with segment ids, ``source_segments[src]`` are rank src's
    ids (what the ring would bring), so the masks and skipped tiles are the ring's too."""
    ring, kern = Ring.of(group), _backend(backend)
    r, world = ring.rank, ring.world_size
    own = _travelling(k, v, segments)
    if communicate:
        from ..comm.collectives import all_gather

        gathered = [all_gather(t.unsqueeze(0), group)[0] for t in own]
    out, lse = _empty_result(q)
    for src in range(world):
        block = [t[src] for t in gathered] if communicate else own[:2] + (
            (source_segments[src],) if segments is not None else ())
        _attend_block(out, lse, q, block[0], block[1], kern, scale, layout, world, r, src, causal, segments,
                      _ids_of(block))
    return out, lse


def ring_backward(q, k, v, segments, out, lse, dout, dlse, group, causal, scale, layout, backend):
    ring, name, kern = _ring(group), _op_name(group), _backend(backend)
    r, world, length = ring.rank, ring.world_size, q.shape[2]
    acc = attention_ref.acc_dtype(q.dtype)
    delta = (dout.to(acc) * out.to(acc)).sum(-1)
    if dlse is not None:  # d lse_i / d s_ij = p_ij: folds into delta
        delta = delta - dlse.to(acc)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    own = _travelling(k, v, segments)
    # the travelling blocks' and partial sums' buffers; a ring of one needs neither (2 K/V and 2 fp32 K/V)
    kv_bufs = [tuple(torch.empty_like(t) for t in own) for _ in range(2)] if world > 1 else None
    grad_bufs = [(torch.empty(k.shape, dtype=acc, device=k.device), torch.empty(v.shape, dtype=acc, device=v.device))
                 for _ in range(2)] if world > 1 else None
    cur = own
    grad_inflight = None  # (pending works, the tensors they send)
    for step in range(world):
        kv_pending = None
        comm = f"{name}/backward/step{step}/comm"
        if step + 1 < world:
            nxt = kv_bufs[step % 2]
            with span(comm):
                kv_pending = ring.exchange(list(cur), r + 1, list(nxt), r - 1, tag=KV_TAG)
        with span(f"{name}/backward/step{step}/compute"), \
                settled_on_error(kv_pending, grad_inflight[0] if grad_inflight else None):
            kb, vb = _kv_for_step(cur[0], cur[1], k, v, step)
            dk = torch.zeros(k.shape, dtype=acc, device=k.device)
            dv = torch.zeros(v.shape, dtype=acc, device=v.device)
            for (qo, qs, ql), (ko, ks, kl), masked in _block_pairs(layout, world, r, (r - step) % world, length,
                                                                   causal):
                dq_b, dk_b, dv_b = kern.block_backward(q[:, :, qo:qo + ql], kb[:, :, ko:ko + kl],
                                                       vb[:, :, ko:ko + kl], dout[:, :, qo:qo + ql],
                                                       lse[:, :, qo:qo + ql], delta[:, :, qo:qo + ql], scale,
                                                       q_start=qs, k_start=ks, causal=masked,
                                                       **_segment_slices(segments, _ids_of(cur), qo, ql, ko, kl))
                dq[:, :, qo:qo + ql] += dq_b
                dk[:, :, ko:ko + kl] += dk_b
                dv[:, :, ko:ko + kl] += dv_b
        if world == 1:
            return dq, dk, dv
        if grad_inflight:  # the block's partial sums from the ranks before us
            with span(comm):
                wait_all(grad_inflight[0])
            dk += grad_bufs[step % 2][0]
            dv += grad_bufs[step % 2][1]
        # pass them on; after the last step this hop delivers each block's sum to its owner. dk/dv
        # are rebound next step: the tuple keeps the sent tensors alive until the send is waited,
        # rather than trusting the backend to hold them
        with span(comm):
            grad_inflight = (ring.exchange([dk, dv], r + 1, list(grad_bufs[(step + 1) % 2]), r - 1, tag=GRAD_TAG),
                             (dk, dv))
        if kv_pending:
            with span(comm):
                wait_all(kv_pending)
            cur = nxt
    with span(f"{name}/backward/step{world - 1}/comm"):
        wait_all(grad_inflight[0])
    dk_own, dv_own = grad_bufs[world % 2]
    return dq, dk_own, dv_own


class RingAttention(torch.autograd.Function):
    """``softmax(scale q k^T + mask) v`` of the local queries over the whole ring's keys.

    | tensor | shape          | forward                         | backward                                  |
    |--------|----------------|---------------------------------|-------------------------------------------|
    | q      | [B, H, S, D]   | stays local                     | dQ accumulated locally (fp32)             |
    | k, v   | [B, H_kv, S, D]| travel the ring, P-1 hops       | dK/dV partial sums travel P hops to owner |
    | segments | [B, S] int64 or None | travel with k, v        | travel with k, v (no gradient)            |
    | out    | [B, H, S, D]   | merged over blocks (fp32)       | delta = rowsum(dO * O)                    |
    | lse    | [B, H, S]      | fp32                            | its gradient folds into delta             |
    """

    @staticmethod
    def forward(ctx, q, k, v, segments, group, causal, scale, layout, backend):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out, lse = ring_forward(q, k, v, group, causal, scale, layout, backend, segments)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, segments, out, lse)
        ctx.args, ctx.device = (group, causal, scale, layout, backend), q.device
        ctx.set_materialize_grads(False)
        # fp32 whatever the inputs, as the API (and flash-attn's softmax_lse) promise: callers that
        # merge partial attentions rely on it. fp64 inputs still compute it in fp64 internally. A
        # copy, never the saved tensor: a caller's in-place op on it must not break backward.
        return out, lse.to(torch.float32, copy=True)

    @staticmethod
    @first_order_only("ring_attention")
    @backward_without_autocast
    def backward(ctx, dout, dlse):
        return _backward(ctx, dout, dlse)


def _backward(ctx, dout, dlse):
    q, k, v, segments, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    with span(f"{_op_name(ctx.args[0])}/backward"):  # an op window for `profile report`, like the forward's
        dq, dk, dv = ring_backward(q, k, v, segments, out, lse, dout.contiguous(), dlse, *ctx.args)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None


def _to_bhsd(x, qkv_format):
    return x.transpose(1, 2) if qkv_format == "bshd" else x.permute(1, 2, 0, 3)


def _from_bhsd(x, qkv_format):
    return x.transpose(1, 2) if qkv_format == "bshd" else x.permute(2, 0, 1, 3)


def _validate(q, k, v, qkv_format, layout, softmax_scale):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t)  # a tensor, not a DTensor, not sparse or nested
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({qkv_format}), got shape {tuple(t.shape)}")
    if qkv_format not in FORMATS:
        raise ValueError(f"qkv_format={qkv_format!r}: expected one of {list(FORMATS)}")
    check_layout(layout)
    check_float_dtype("q", q)  # SDPA's choice too: integer, bool or complex scores have no softmax
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}.dtype={t.dtype} does not match q.dtype={q.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have one shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    seq, batch = (1, 0) if qkv_format == "bshd" else (0, 1)
    if (q.shape[batch], q.shape[seq], q.shape[3]) != (k.shape[batch], k.shape[seq], k.shape[3]):
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} ({qkv_format}) must agree in batch, local "
                         "sequence length and head dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q has {q.shape[2]} heads, k/v {k.shape[2]}: the query heads must be a multiple of the "
                         "key/value heads (GQA/MQA)")
    if layout == "zigzag" and q.shape[seq] % 2:
        raise ValueError(f"local sequence length {q.shape[seq]} (q.shape[{seq}], {qkv_format}) is odd: "
                         "layout='zigzag' needs S divisible by 2 x the group size")
    if softmax_scale is not None:
        _check_scale(softmax_scale)


def _check_segments(segment_ids, q, qkv_format):
    """[B, S_local] integer ids laid out as q's sequence (shard_sequence(ids, group, dim=1, ...)),
    whatever ``qkv_format``; on q's device. -> an int64 copy (every rank sends the same dtype; saved
    for backward, so a caller refilling its buffer meanwhile changes nothing, whatever its dtype)."""
    check_tensor("segment_ids", segment_ids)
    if not integer_ids(segment_ids):
        raise TypeError(f"segment_ids.dtype={segment_ids.dtype}: expected an integer tensor (one id per token)")
    seq, batch = (1, 0) if qkv_format == "bshd" else (0, 1)
    if tuple(segment_ids.shape) != (q.shape[batch], q.shape[seq]):
        raise ValueError(f"segment_ids.shape={tuple(segment_ids.shape)}: expected [B, S_local] = "
                         f"{[q.shape[batch], q.shape[seq]]} (batch-first whatever qkv_format={qkv_format!r})")
    if segment_ids.device != q.device:
        raise ValueError(f"segment_ids is on {segment_ids.device} but q is on {q.device}")
    return segment_ids.to(torch.int64, memory_format=torch.contiguous_format, copy=True)


def _check_scale(softmax_scale) -> float:
    """Any finite real (Python, numpy, or a one-element tensor) scales the scores, as SDPA's
    ``scale`` does; None is 1/sqrt(D). The kernels mask after scaling, so any sign is safe."""
    is_real = isinstance(softmax_scale, numbers.Real) or (isinstance(softmax_scale, torch.Tensor)
                                                           and softmax_scale.numel() == 1
                                                           and not softmax_scale.is_complex())
    if isinstance(softmax_scale, bool) or not is_real:
        raise TypeError(f"softmax_scale must be a real number or None, got {type(softmax_scale).__name__}")
    value = float(softmax_scale)
    if not math.isfinite(value):
        raise ValueError(f"softmax_scale={value}: expected a finite number or None")
    return value


def checked_inputs(q, k, v, causal, softmax_scale, layout, qkv_format, return_lse, segment_ids):
    """The checks and casts ring_attention and local_attention share, before any communication ->
    (q, k, v) in autocast's dtype, the segment ids' int64 copy (or None), the scale, the backend."""
    if isinstance(q, torch.Tensor):  # inside torch.autocast: its dtype, as SDPA would
        q, k, v = cast_operands(autocast_dtype(q.device), q, k, v)
    _validate(q, k, v, qkv_format, layout, softmax_scale)
    segments = _check_segments(segment_ids, q, qkv_format) if segment_ids is not None else None
    for name, flag in (("causal", causal), ("return_lse", return_lse)):
        if not isinstance(flag, bool):  # causal="no" is truthy: it would silently mean causal
            raise TypeError(f"{name}={flag!r}: expected a bool")
    # D = 0 (an empty result, as SDPA gives) must not divide by zero
    scale = _check_scale(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(max(q.shape[-1], 1))
    backend = default_backend(q)
    if backend == "triton":  # the kernels' own limits, before the ring exchanges anything
        _backend(backend).check_inputs(_to_bhsd(q, qkv_format).shape, _to_bhsd(k, qkv_format).shape, q.dtype,
                                       q.device)
    return q, k, v, segments, scale, backend


def checked_cp_inputs(call, what: str, group, q, k, v, causal, softmax_scale, layout, qkv_format, return_lse,
                      segment_ids) -> tuple:
    """The checks of a context-parallel attention call (``what``: ring_attention, ulysses_attention),
    inside its ``same_call_on_every_rank`` block: the inputs' layout tags, then ``checked_inputs``
    (whose result it returns); ``call.args`` records what the ranks must agree on."""
    seq_dim = SEQ_DIM.get(qkv_format) if isinstance(qkv_format, str) else None  # None: _validate names it
    for name, t in (("q", q), ("k", k), ("v", v)):  # before autocast's copies, which carry no tag
        check_layout_tag(t, name, seq_dim, group, layout, what)
    if segment_ids is not None:
        check_layout_tag(segment_ids, "segment_ids", 1, group, layout, what)
    checked = checked_inputs(q, k, v, causal, softmax_scale, layout, qkv_format, return_lse, segment_ids)
    q, k, v, segments, scale, _ = checked
    call.args = dict(q=q, k=k, v=v, causal=causal, softmax_scale=scale, layout=layout, qkv_format=qkv_format,
                     segment_ids=segments)
    return checked


def attention_fake(q, k, v, *args, qkv_format="bshd", return_lse=False, **kwargs):
    """The results' shapes (out like q; the fp32 lse [B, H, S]), for torch.compile (see ``_opaque``)."""
    check_tensor("q", q, min_dim=4)
    out = q.new_empty(q.shape)
    if not return_lse:
        return out
    b, s = (q.shape[0], q.shape[1]) if qkv_format == "bshd" else (q.shape[1], q.shape[0])
    return out, q.new_empty((b, q.shape[2], s), dtype=torch.float32)


def attention_unflatten(flat, *args, return_lse=False, **kwargs):
    return (flat[0], flat[1]) if return_lse else flat[0]


@opaque_under_compile(fake=attention_fake, unflatten=attention_unflatten, casts=("q", "k", "v"))  # see _opaque
def ring_attention(q, k, v, group=None, *, causal=False, softmax_scale=None, layout="contiguous",
                   qkv_format="bshd", return_lse=False, segment_ids=None):
    """Attention of this rank's queries over the whole sequence spread across ``group``.

    q [B, S_local, H, D], k/v [B, S_local, H_kv, D] (``"sbhd"``: sequence first), each rank holding
    its part as ``shard_sequence(..., layout=layout)`` lays it out. Returns out like q, and with
    ``return_lse`` also the log-sum-exp [B, H, S_local] (-inf for rows that see no key) in fp32,
    whatever the input dtype (fp64 inputs compute it in fp64 and round only the returned copy).
    ``segment_ids``: packed documents, an integer id per token [B, S_local] (batch first in either
    format), sharded as q (``shard_sequence(ids, group, dim=1, layout=layout)``); a query then sees
    only keys with its own id (and, if causal, at or before its position): a block-diagonal mask.
    """
    group = resolve_group(group)
    with same_call_on_every_rank(group, "ring_attention", getattr(q, "device", None)) as call:
        q, k, v, segments, scale, backend = checked_cp_inputs(call, "ring_attention", group, q, k, v, causal,
                                                              softmax_scale, layout, qkv_format, return_lse,
                                                              segment_ids)
    with span("ok/ring_attention"), autocast_off(q.device):  # the kernels keep fp32 softmax statistics
        out, lse = RingAttention.apply(_to_bhsd(q, qkv_format), _to_bhsd(k, qkv_format), _to_bhsd(v, qkv_format),
                                       segments, group, causal, scale, layout, backend)
    # laid out like q (callers .view() it to [B, S, H*D]), and always a copy of the tensor saved for
    # backward (contiguous() would alias it when H or S_local is 1), so in-place ops on it are safe
    out = tag_layout(_from_bhsd(out, qkv_format).clone(memory_format=torch.contiguous_format), SEQ_DIM[qkv_format],
                     group, layout)
    return (out, lse) if return_lse else out
