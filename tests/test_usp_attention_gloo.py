"""USP (ulysses_attention with ring_group: all-to-alls within a group, a ring across): against SDPA
over the whole sequence (fp64) on ring x group worlds of several shapes, overlapping groups refused,
and ring peers that disagree named under TORCH_DISTRIBUTED_DEBUG=DETAIL."""
import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok


def _groups(ring_size, group_size, ring_outer=True):
    """Every rank makes every group. ring_outer: group = consecutive ranks (a node), ring strided."""
    world = ring_size * group_size
    assert dist.get_world_size() == world
    if ring_outer:
        groups = [[k * group_size + j for j in range(group_size)] for k in range(ring_size)]
        rings = [[k * group_size + j for k in range(ring_size)] for j in range(group_size)]
    else:
        rings = [[k * ring_size + j for j in range(ring_size)] for k in range(group_size)]
        groups = [[k * ring_size + j for k in range(group_size)] for j in range(ring_size)]
    made = {tuple(r): dist.new_group(r) for r in groups + rings}
    rank = dist.get_rank()
    group = made[tuple(next(g for g in groups if rank in g))]
    ring = made[tuple(next(r for r in rings if rank in r))]
    return group, ring


def _usp_general_on_rank(ring_size, group_size, layout, causal, heads, kv_heads, documents, chunks, fmt="bshd",
                         lse=True, ring_outer=True):
    from test_ring_attention_segments_gloo import _masked_reference

    group, ring = _groups(ring_size, group_size, ring_outer)
    g = torch.Generator().manual_seed(91)
    batch, dim = 2, 4
    seq = 4 * ring_size * group_size  # zigzag: 2 x ring x (2 x group)
    q = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    d_out = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    d_lse = torch.randn(batch, heads, seq, generator=g, dtype=torch.float64).float().double()
    if documents:
        ids = torch.stack([torch.randint(0, 3, (seq,), generator=g),
                           torch.repeat_interleave(torch.arange(2), torch.tensor([seq // 3, seq - seq // 3]))])
    else:
        ids = torch.zeros(batch, seq, dtype=torch.long)
    out_ref, lse_ref = _masked_reference(q, k, v, ids, causal, dim ** -0.5)
    only = lse == "only"  # the lse alone: out's gradient arrives as None
    lse = bool(lse)
    ((0 if only else (out_ref * d_out).sum()) + ((lse_ref * d_lse).sum() if lse else 0)).backward()

    def local(x, d=1):
        return ok.shard_sequence(ok.shard_sequence(x.detach(), ring, dim=d, layout=layout), group, dim=d,
                                 layout="contiguous")

    def fmt_in(x):
        return x if fmt == "bshd" else x.transpose(0, 1).contiguous()

    ql, kl, vl = (fmt_in(local(x)).requires_grad_() for x in (q, k, v))
    res = ok.ulysses_attention(ql, kl, vl, group, causal=causal, layout=layout, return_lse=lse, qkv_format=fmt,
                               segment_ids=local(ids) if documents else None, ring_group=ring, head_chunks=chunks)
    out, lse_l = res if lse else (res, None)
    loss = 0 if only else (out * fmt_in(local(d_out))).sum()
    if lse:
        loss = loss + (lse_l * local(d_lse, 2)).sum()
    loss.backward()
    dv_ref = torch.zeros_like(v) if v.grad is None else v.grad  # (the lse alone: v gets none)
    checks = {"out": (out, fmt_in(local(out_ref))), "dq": (ql.grad, fmt_in(local(q.grad))),
              "dk": (kl.grad, fmt_in(local(k.grad))), "dv": (vl.grad, fmt_in(local(dv_ref)))}
    if lse:
        checks["lse"] = (lse_l, local(lse_ref, 2).float())
    for name, (got, want) in checks.items():
        tol = 1e-6 if name == "lse" else 1e-10
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    return True


def _many_on_rank(ring_size, group_size, ring_outer):
    G = group_size
    cases = [("zigzag", True, 2 * G, G, False, 1, "bshd", True),  # GQA split, one head group
             ("zigzag", True, 2 * G, 1, True, 1, "bshd", True),  # MQA: the key/value head copied
             ("contiguous", True, 4 * G, 2 * G, True, 2, "sbhd", True),  # GQA, 2 head groups
             ("contiguous", False, 2 * G, 2 * G, False, 2, "bshd", False),
             ("zigzag", False, 4 * G, 2 * G, True, 2, "bshd", True),
             ("zigzag", True, 4 * G, 4 * G, True, None, "bshd", "only")]
    for layout, causal, heads, kv_heads, docs, chunks, fmt, lse in cases:
        _usp_general_on_rank(ring_size, group_size, layout, causal, heads, kv_heads, docs, chunks, fmt, lse,
                             ring_outer)
    return True


@pytest.mark.parametrize("ring_size, group_size, ring_outer", [
    (2, 2, True), (2, 2, False), (4, 1, True), (1, 4, True), (3, 2, True), (2, 3, True), (3, 2, False),
    (2, 1, True), (1, 2, True)])
def test_usp_shapes(rank_pool, ring_size, group_size, ring_outer):
    world = ring_size * group_size
    assert rank_pool(world).run(_many_on_rank, ring_size, group_size, ring_outer) == [True] * world


def _overlapping_groups_on_rank():
    """ring_group sharing ranks with group (the same group, or the world around pairs): refused on
    every rank before communicating, where it silently attended the wrong heads and positions."""
    from comm_guard import no_communication

    rank = dist.get_rank()
    pair = [dist.new_group(r) for r in ([0, 1], [2, 3])][rank // 2]
    q = torch.ones(1, 8, 4, 4, dtype=torch.float64)
    said = []
    for group, ring in ((pair, pair), (pair, dist.group.WORLD), (dist.group.WORLD, pair)):
        with pytest.raises(ValueError, match=r"group and ring_group share ranks \[\d(, \d)*\] besides this one"), \
                no_communication():
            ok.ulysses_attention(q, q, q, group, ring_group=ring)
        said.append(True)
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(total), said


def test_overlapping_groups_are_refused(rank_pool):
    assert rank_pool(4).run(_overlapping_groups_on_rank) == [(4, [True] * 3)] * 4


def _ring_disagrees_on_rank(kind):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: the ranks of a ring that disagree (causal on one pair only: a
    silent mix; head_chunks: gloo aborts; ring peers holding other heads: silently wrong) are named."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    rank = dist.get_rank()
    made = {r: dist.new_group(list(r)) for r in [(0, 1), (2, 3), (0, 2), (1, 3), (0, 3), (1, 2)]}
    pair = made[(0, 1) if rank < 2 else (2, 3)]
    ring = made[(0, 2) if rank % 2 == 0 else (1, 3)]
    q = torch.ones(1, 8, 4, 4, dtype=torch.float64)
    try:
        if kind == "causal":
            ok.ulysses_attention(q, q, q, pair, causal=rank < 2, layout="zigzag", ring_group=ring)
        elif kind == "head_chunks":
            ok.ulysses_attention(q, q, q, pair, layout="zigzag", ring_group=ring, head_chunks=1 if rank < 2 else 2)
        elif kind == "misaligned":  # ring {0, 3}: rank 0 holds head group 0, rank 3 head group 1
            ok.ulysses_attention(q, q, q, pair, ring_group=made[(0, 3) if rank in (0, 3) else (1, 2)])
        else:  # agreeing: runs
            ok.ulysses_attention(q, q, q, pair, causal=True, layout="zigzag", ring_group=ring)
            return "ran"
    except ValueError as exc:
        return str(exc)
    finally:
        dist.set_debug_level(level)
    return "no error"


@pytest.mark.parametrize("kind, named", [("causal", "disagree on causal"), ("head_chunks", "disagree on head_chunks"),
                                         ("misaligned", "disagree on group"), ("agree", None)])
def test_ring_ranks_that_disagree_are_named_under_distributed_debug(rank_pool, kind, named):
    for said in rank_pool(4).run(_ring_disagrees_on_rank, kind):
        assert said == "ran" if named is None else named in said, said


def _usp_on_rank(layout, causal, heads, kv_heads, documents):
    """USP on 4 ranks: all-to-alls within {0, 1} and {2, 3}, a ring across {0, 2} and {1, 3}; the
    sequence sharded over the ring with ``layout``, each ring part contiguously within the pair."""
    from test_ring_attention_segments_gloo import _masked_reference

    groups = [dist.new_group(r) for r in ([0, 1], [2, 3], [0, 2], [1, 3])]  # (every rank makes every group)
    rank = dist.get_rank()
    pair, ring = groups[rank // 2], groups[2 + rank % 2]
    g = torch.Generator().manual_seed(77)
    batch, seq, dim = 2, 32, 4
    q = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    d_out = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    d_lse = torch.randn(batch, heads, seq, generator=g, dtype=torch.float64).float().double()
    ids = torch.stack([torch.repeat_interleave(torch.arange(3), torch.tensor([5, 19, 8])), torch.zeros(seq).long()])
    if not documents:
        ids = torch.zeros(batch, seq, dtype=torch.long)
    out_ref, lse_ref = _masked_reference(q, k, v, ids, causal, dim ** -0.5)  # (one id: the causal mask alone)
    ((out_ref * d_out).sum() + (lse_ref * d_lse).sum()).backward()

    def local(x, d=1):
        return ok.shard_sequence(ok.shard_sequence(x.detach(), ring, dim=d, layout=layout), pair, dim=d,
                                 layout="contiguous")

    ql, kl, vl = (local(x).requires_grad_() for x in (q, k, v))
    out, lse = ok.ulysses_attention(ql, kl, vl, pair, causal=causal, layout=layout, return_lse=True,
                                    segment_ids=local(ids) if documents else None, ring_group=ring)
    ((out * local(d_out)).sum() + (lse * local(d_lse, 2)).sum()).backward()
    checks = {"out": (out, local(out_ref)), "lse": (lse, local(lse_ref, 2).float()), "dq": (ql.grad, local(q.grad)),
              "dk": (kl.grad, local(k.grad)), "dv": (vl.grad, local(v.grad))}
    for name, (got, want) in checks.items():
        tol = 1e-6 if name == "lse" else 1e-10
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("layout, causal, heads, kv_heads, documents", [
    ("zigzag", True, 4, 2, False), ("contiguous", True, 4, 1, True), ("zigzag", False, 8, 4, True)])
def test_usp_all_to_all_within_pairs_and_a_ring_across(rank_pool, layout, causal, heads, kv_heads, documents):
    assert rank_pool(4).run(_usp_on_rank, layout, causal, heads, kv_heads, documents) == [True] * 4


def _wrong_layouts_on_rank():
    """Refused before communicating, by the tags shard_sequence leaves: a ring sharded zigzag passed as
    contiguous (it attended wrongly without an error), and a zigzag cut within the group."""
    from comm_guard import no_communication

    group, ring = _groups(2, 2)
    x = torch.randn(2, 16, 2, 4, dtype=torch.float64)
    ring_part = ok.shard_sequence(x, ring, dim=1, layout="zigzag")
    part = ok.shard_sequence(ring_part, group, dim=1, layout="contiguous")
    with pytest.raises(ValueError, match=r"ulysses_attention \(ring_group\): q was laid out with layout='zigzag' .* "
                                         r"but layout='contiguous' was passed"), no_communication():
        ok.ulysses_attention(part, part, part, group, layout="contiguous", ring_group=ring)
    zigzag_within = ok.shard_sequence(ring_part, group, dim=1, layout="zigzag")
    with pytest.raises(ValueError, match=r"q was cut within group with layout='zigzag'; with ring_group shard over the "
                                         r"ring first"), no_communication():
        ok.ulysses_attention(zigzag_within, part, part, group, layout="zigzag", ring_group=ring)
    out = ok.ulysses_attention(part, part, part, group, layout="zigzag", ring_group=ring)  # right: runs, tagged alike
    ok.ulysses_attention(out, part, part, group, layout="zigzag", ring_group=ring)
    return True


def test_wrong_layouts_are_refused_by_their_tags(rank_pool):
    assert rank_pool(4).run(_wrong_layouts_on_rank) == [True] * 4
