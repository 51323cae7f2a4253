"""ring_attention with ``segment_ids`` (packed documents) on gloo ranks vs SDPA with the dense
block-diagonal mask on the full sequence (fp64): outputs, lse and the gradients of q, k, v, for both
layouts, causal or not, GQA and both formats; ids that are not sorted; a planted bug that keeps
the local ids for a travelling block; bad ids refused before any rank communicates."""
import importlib
import re

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import overlapkernels as ok
from comm_guard import no_communication
ra = importlib.import_module("overlapkernels.ops.ring_attention")

ATOL = RTOL = 1e-10  # fp64: every difference is reduction order
LSE_TOL = 1e-6  # the returned lse is fp32


def packed_ids(batch, seq, lengths_per_row):
    """[B, S] ids of documents of the given lengths, one row per batch entry (ids count up)."""
    rows = []
    for lengths in lengths_per_row:
        assert sum(lengths) == seq, lengths
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)))
    return torch.stack(rows[:batch])


def _masked_reference(q, k, v, ids, causal, scale):
    """SDPA over the whole sequence with the same-document (and causal) mask, and the exact lse."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    seq = q.shape[1]
    visible = (ids[:, :, None] == ids[:, None, :])[:, None]  # [B, 1, S, S]
    if causal:
        visible = visible & torch.ones(seq, seq, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=visible, scale=scale).transpose(1, 2)
    s = (qt @ kt.transpose(-1, -2) * scale).masked_fill(~visible, float("-inf"))
    return out, torch.logsumexp(s, dim=-1)


def _case_on_rank(layout, causal, heads, kv_heads, fmt, ids_kind, group=None, batch=2, dim=8, per_rank=12,
                  plant=None, attention=None):
    """``attention``: the context-parallel attention under test, called as ``ring_attention`` (the default)."""
    attention = attention or ok.ring_attention
    world = dist.get_world_size(group)
    seq = per_rank * world
    g = torch.Generator().manual_seed(2000 + 7 * heads + kv_heads + int(causal))
    q = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    d_lse = torch.randn(batch, heads, seq, generator=g, dtype=torch.float64).float().double()
    if ids_kind == "packed":  # documents crossing rank (and zigzag half) boundaries, one of length 1
        third = seq // 3
        ids = packed_ids(batch, seq, [[5, 1, third - 6, seq - third], [seq]])
    else:  # any ids, not sorted: a document may come back later in the sequence (padding id -1 too)
        ids = torch.randint(-1, 3, (batch, seq), generator=g)
    scale = dim ** -0.5
    out_ref, lse_ref = _masked_reference(q, k, v, ids, causal, scale)
    ((out_ref * d_out).sum() + (lse_ref * d_lse).sum()).backward()

    def local(x, d=1):
        return ok.shard_sequence(x.detach(), group, dim=d, layout=layout)

    def fmt_in(x):
        x = local(x)
        return (x if fmt == "bshd" else x.transpose(0, 1).contiguous()).requires_grad_()

    ql, kl, vl = fmt_in(q), fmt_in(k), fmt_in(v)
    ids_local = local(ids).to(torch.int32)  # any integer dtype
    original = ra._segment_slices
    if plant == "local ids":  # the travelling block's ids never sent: its keys judged by this rank's ids
        ra._segment_slices = lambda q_seg, k_seg, qo, ql_, ko, kl_: original(q_seg, q_seg, qo, ql_, ko, kl_)
    elif plant == "no mask":
        ra._segment_slices = lambda *args: {}
    try:
        out, lse = attention(ql, kl, vl, group, causal=causal, layout=layout, qkv_format=fmt,
                             return_lse=True, segment_ids=ids_local)
        d_out_local = local(d_out) if fmt == "bshd" else local(d_out).transpose(0, 1)
        ((out * d_out_local).sum() + (lse * local(d_lse, 2)).sum()).backward()
    finally:
        ra._segment_slices = original

    def back(x):
        return x if fmt == "bshd" else x.transpose(0, 1)

    checks = {"out": (back(out), local(out_ref)), "lse": (lse, local(lse_ref, 2).float()),
              "dq": (back(ql.grad), local(q.grad)), "dk": (back(kl.grad), local(k.grad)),
              "dv": (back(vl.grad), local(v.grad))}
    for name, (got, want) in checks.items():
        tol = LSE_TOL if name == "lse" else ATOL
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    return True


CASES = [
    ("zigzag", True, 4, 2, "bshd", "packed"), ("contiguous", True, 4, 4, "bshd", "packed"),
    ("zigzag", False, 4, 1, "bshd", "packed"), ("contiguous", False, 4, 2, "sbhd", "packed"),
    ("zigzag", True, 4, 2, "sbhd", "unsorted"), ("contiguous", True, 2, 2, "bshd", "unsorted"),
]


def _all_cases_on_rank(group=None):
    for case in CASES:
        _case_on_rank(*case, group=group)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_matches_sdpa_with_the_document_mask(rank_pool, world):
    assert rank_pool(world).run(_all_cases_on_rank) == [True] * world


def _planted_on_rank(plant):
    try:
        _case_on_rank("zigzag", True, 4, 2, "bshd", "packed", plant=plant)
        return "passed"
    except AssertionError as exc:
        return str(exc).split(":")[0]


@pytest.mark.parametrize("plant", ["local ids", "no mask"])
def test_a_planted_segment_bug_is_caught(rank_pool, plant):
    """Keys judged by the receiving rank's own ids (the ids not travelling with their block), or no
    document mask at all: the comparison that passes above fails."""
    assert all(f in ("out", "lse", "dq", "dk", "dv") for f in rank_pool(2).run(_planted_on_rank, plant))


def _one_segment_on_rank():
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    with_ids = ok.ring_attention(q, k, v, causal=True, layout="zigzag", segment_ids=torch.full((1, 8), 7))
    return torch.equal(with_ids, ok.ring_attention(q, k, v, causal=True, layout="zigzag"))


def test_one_segment_is_plain_attention(rank_pool):
    """All tokens in one document: the result is ring attention without ids, bit for bit."""
    assert rank_pool(2).run(_one_segment_on_rank) == [True, True]


def _ids_reused_on_rank():
    """The caller refills its ids buffer (the next microbatch's) between forward and backward: the
    backward still masks with the ids of its forward, whatever their integer dtype."""
    g = torch.Generator().manual_seed(8)
    results = []
    for dtype in (torch.int64, torch.int32):
        q, k, v = (torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
        ids = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]], dtype=dtype)
        want = torch.autograd.grad(ok.ring_attention(q, k, v, causal=True, segment_ids=ids.clone()).sum(), (q, k, v))
        out = ok.ring_attention(q, k, v, causal=True, segment_ids=ids)
        ids.fill_(0)
        got = torch.autograd.grad(out.sum(), (q, k, v))
        results.append(all(torch.equal(a, b) for a, b in zip(got, want)))
    return results


def test_ids_refilled_before_backward_do_not_change_it(rank_pool):
    assert rank_pool(2).run(_ids_reused_on_rank) == [[True, True]] * 2


BAD = [
    (lambda q, ids: ok.ring_attention(q, q, q, segment_ids=ids.double()), TypeError,
     r"segment_ids.dtype=torch.float64: expected an integer tensor \(one id per token\)"),
    (lambda q, ids: ok.ring_attention(q, q, q, segment_ids=ids.bool()), TypeError, r"segment_ids.dtype=torch.bool"),
    (lambda q, ids: ok.ring_attention(q, q, q, segment_ids=ids[:, :4]), ValueError,
     r"segment_ids.shape=\(2, 4\): expected \[B, S_local\] = \[2, 6\] \(batch-first whatever qkv_format='bshd'\)"),
    (lambda q, ids: ok.ring_attention(q, q, q, qkv_format="sbhd", segment_ids=ids), ValueError,
     r"segment_ids.shape=\(2, 6\): expected \[B, S_local\] = \[6, 2\]"),
    (lambda q, ids: ok.ring_attention(q, q, q, segment_ids=ids.to("meta")), ValueError,
     r"^segment_ids is on meta but q is on cpu$"),
    (lambda q, ids: ok.ring_attention(q, q, q, segment_ids=ids.tolist()), TypeError,
     r"segment_ids must be a torch.Tensor, got list"),
    # ids sharded one way, attention told the other
    (lambda q, ids: ok.ring_attention(q, q, q, causal=True, segment_ids=ok.shard_sequence(
        torch.zeros(2, 12, dtype=torch.long), layout="zigzag")), ValueError,
     r"ring_attention: segment_ids was laid out with layout='zigzag'.* but layout='contiguous' was passed"),
]


def _bad_inputs_on_rank():
    q = torch.ones(2, 6, 2, 8, dtype=torch.float64)
    ids = torch.zeros(2, 6, dtype=torch.long)
    for i, (call, exc_type, pattern) in enumerate(BAD):
        try:
            with no_communication():
                call(q, ids)
        except exc_type as exc:
            assert re.search(pattern, str(exc)), (i, str(exc))
        else:
            raise AssertionError(f"case {i}: no {exc_type.__name__}")
    return True


def test_bad_segment_ids_are_refused_before_communicating(rank_pool):
    assert rank_pool(2).run(_bad_inputs_on_rank) == [True, True]


def _disagreeing_ranks_on_rank():
    r, level = dist.get_rank(), dist.get_debug_level()
    q = torch.ones(1, 4, 2, 8, dtype=torch.float64)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        ok.ring_attention(q, q, q, segment_ids=torch.zeros(1, 4, dtype=torch.long) if r == 0 else None)
    except ValueError as exc:
        return str(exc)
    finally:
        dist.set_debug_level(level)


def test_ranks_disagreeing_on_segment_ids_are_named_under_distributed_debug(rank_pool):
    """One rank with ids, one without, would exchange three tensors against two (gloo aborts)."""
    for message in rank_pool(2).run(_disagreeing_ranks_on_rank):
        assert message.startswith("ring_attention: the ranks of the group disagree on segment_ids"), message
