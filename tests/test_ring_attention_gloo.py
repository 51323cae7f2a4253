"""ring_attention on gloo ranks vs F.scaled_dot_product_attention on the full sequence (fp64):
outputs, lse and the gradients of q, k, v, for every layout, mask, GQA/MQA and format."""
import importlib
import re

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import overlapkernels as ok
from comm_guard import no_communication
ra = importlib.import_module("overlapkernels.ops.ring_attention")  # the module (the package re-exports the function)

ATOL = RTOL = 1e-10  # fp64: every difference is reduction order
LSE_TOL = 1e-6  # the returned lse is fp32: one rounding of an fp64 value of a few units


def _full_reference(q, k, v, causal, scale):
    """SDPA over the whole sequence (bshd in, bshd out) and the exact log-sum-exp."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal, scale=scale).transpose(1, 2)
    s = qt @ kt.transpose(-1, -2) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return out, torch.logsumexp(s, dim=-1)


def _case_on_rank(layout, causal, heads, kv_heads, fmt, with_lse, scale=None, batch=2, dim=8, per_rank=6,
                  group=None, planted=0.0, attention=None):
    """``planted``: added to one element of the ring's output before the comparison. ``attention``:
    the context-parallel attention under test, called as ``ring_attention`` (the default)."""
    attention = attention or ok.ring_attention
    world = dist.get_world_size(group)
    seq = per_rank * world
    g = torch.Generator().manual_seed(1000 + 7 * heads + kv_heads + int(causal))
    q = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, seq, kv_heads, dim, generator=g, dtype=torch.float64, requires_grad=True)
    d_out = torch.randn(batch, seq, heads, dim, generator=g, dtype=torch.float64)
    # fp32-representable, so the gradient reaching the fp32 lse is exact and dq/dk/dv stay fp64-tight
    d_lse = torch.randn(batch, heads, seq, generator=g, dtype=torch.float64).float().double()
    sc = float(scale) if scale is not None else dim ** -0.5
    out_ref, lse_ref = _full_reference(q, k, v, causal, sc)
    # with_lse="only": a loss of the lse alone (out's gradient is None in backward, not zeros)
    loss = (0 if with_lse == "only" else (out_ref * d_out).sum()) + ((lse_ref * d_lse).sum() if with_lse else 0)
    loss.backward()

    def local(x, d=1):  # this rank's part, laid out like the inputs
        return ok.shard_sequence(x.detach(), group, dim=d, layout=layout)

    seq_dim = 1 if fmt == "bshd" else 0

    def fmt_in(x):
        x = local(x)
        return (x if fmt == "bshd" else x.transpose(0, 1).contiguous()).requires_grad_()

    ql, kl, vl = fmt_in(q), fmt_in(k), fmt_in(v)
    out, lse = attention(ql, kl, vl, group, causal=causal, softmax_scale=scale, layout=layout, qkv_format=fmt,
                         return_lse=True)
    d_out_local = local(d_out) if fmt == "bshd" else local(d_out).transpose(0, 1)
    loss_local = ((0 if with_lse == "only" else (out * d_out_local).sum())
                  + ((lse * local(d_lse, 2)).sum() if with_lse else 0))
    loss_local.backward()
    if planted:
        out = out.detach().clone()
        out.view(-1)[out.numel() // 2] += planted

    def back(x):
        return x if fmt == "bshd" else x.transpose(0, 1)

    checks = {"out": (back(out), local(out_ref)), "lse": (lse, local(lse_ref, 2).float()),
              "dq": (back(ql.grad), local(q.grad)), "dk": (back(kl.grad), local(k.grad)),
              "dv": (back(vl.grad), local(torch.zeros_like(v) if v.grad is None else v.grad))}  # lse alone: none
    for name, (got, want) in checks.items():
        tol = LSE_TOL if name == "lse" else ATOL  # the API returns the lse in fp32
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    assert out.shape == ql.shape and lse.dtype == torch.float32 and seq_dim in (0, 1)
    assert out.is_contiguous()  # laid out like q: a caller's out.view(B, S, H * D) must work
    return True


CASES = [
    ("zigzag", True, 4, 4, "bshd", False), ("contiguous", True, 4, 4, "bshd", False),
    ("contiguous", False, 4, 4, "bshd", False), ("zigzag", False, 4, 4, "bshd", False),
    ("zigzag", True, 4, 2, "bshd", False),  # GQA
    ("contiguous", True, 4, 1, "bshd", True),  # MQA, gradient through lse too
    ("zigzag", True, 4, 2, "sbhd", True),
    ("zigzag", True, 4, 2, "bshd", "only"),  # the lse alone: out's gradient arrives as None
]


def _all_cases_on_rank(group=None):
    for case in CASES:
        _case_on_rank(*case, group=group)
    _case_on_rank("zigzag", True, 2, 1, "bshd", False, scale=0.3, group=group)
    _case_on_rank("contiguous", False, 2, 2, "sbhd", False, scale=np.float32(-0.25),  # any finite real, as SDPA
                  group=group)
    _case_on_rank("contiguous", True, 2, 1, "bshd", False, scale=torch.tensor(0.5, dtype=torch.float64), group=group)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_matches_sdpa_on_the_full_sequence(rank_pool, world):
    assert rank_pool(world).run(_all_cases_on_rank) == [True] * world


def _stale_kv_on_rank(plant):
    """Regression for a bug class seen in other ring implementations: using step 0's K/V at every
    step. The planted version must fail the same comparison the real one passes."""
    original = ra._kv_for_step
    if plant:
        ra._kv_for_step = lambda k_cur, v_cur, k_own, v_own, step: (k_own, v_own)
    try:
        _case_on_rank("zigzag", True, 4, 2, "bshd", False)
        return "passed"
    except AssertionError as exc:
        return str(exc).split(":")[0]  # which tensor the comparison caught
    finally:
        ra._kv_for_step = original


def test_each_step_uses_its_own_rotated_kv(rank_pool):
    assert rank_pool(2).run(_stale_kv_on_rank, False) == ["passed", "passed"]
    failures = rank_pool(2).run(_stale_kv_on_rank, True)
    assert all(f in ("out", "lse", "dq", "dk", "dv") for f in failures), failures


def _small_planted_error_on_rank():
    """The same case passes, then fails with one output element off by 1e-8 (100 x the tolerance):
    the comparison catches small errors too, not only a stale K/V's."""
    said = []
    for planted in (0.0, 1e-8):
        try:
            _case_on_rank("zigzag", True, 2, 1, "bshd", False, planted=planted)
            said.append("passed")
        except AssertionError as exc:
            said.append(str(exc).split(":")[0])
    return said


def test_small_planted_error_is_caught(rank_pool):
    assert rank_pool(2).run(_small_planted_error_on_rank) == [["passed", "out"]] * 2


def _shard_roundtrip_on_rank():
    world, rank = dist.get_world_size(), dist.get_rank()
    x = torch.arange(2 * 4 * world * 3, dtype=torch.float64).reshape(2, 4 * world, 3)
    zig = ok.shard_sequence(x, layout="zigzag")
    chunk = x.shape[1] // (2 * world)
    want = torch.cat([x[:, rank * chunk:(rank + 1) * chunk], x[:, (2 * world - 1 - rank) * chunk:
                                                                (2 * world - rank) * chunk]], dim=1)
    assert torch.equal(zig, want)
    assert torch.equal(ok.shard_sequence(x, layout="contiguous"), x.chunk(world, dim=1)[rank])
    for layout in ("zigzag", "contiguous"):
        part = ok.shard_sequence(x, layout=layout).requires_grad_()
        full = ok.unshard_sequence(part, layout=layout)
        assert torch.equal(full, x) and full.is_contiguous()  # like a tensor built whole: .view() works
        # each rank's loss weights every position differently: the gradient must come back reordered
        weight = torch.arange(x.numel(), dtype=torch.float64).reshape(x.shape)
        (full * weight * (rank + 1)).sum().backward()
        assert torch.equal(part.grad, sum(range(1, world + 1)) * ok.shard_sequence(weight, layout=layout))
    assert torch.equal(ok.unshard_sequence(ok.shard_sequence(x.transpose(0, 1), dim=0), dim=0), x.transpose(0, 1))
    # ring_attention's output carries its layout: unsharding it with another one is refused
    qkv = ok.shard_sequence(torch.ones(1, 4 * world, 2, 4, dtype=torch.float64), layout="contiguous")
    out = ok.ring_attention(qkv, qkv, qkv, causal=True)  # contiguous both: accepted
    with pytest.raises(ValueError, match=r"x_local was laid out with layout='contiguous'"):
        ok.unshard_sequence(out)
    assert ok.unshard_sequence(out, layout="contiguous").shape == (1, 4 * world, 2, 4)
    zz = ok.shard_sequence(torch.ones(1, 4 * world, 2, 4, dtype=torch.float64))  # zigzag, the default
    out = ok.ring_attention(zz, zz, zz, causal=True, layout="zigzag")  # tagged with its own layout
    with pytest.raises(ValueError, match=r"x_local was laid out with layout='zigzag'"):
        ok.unshard_sequence(out, layout="contiguous")
    assert ok.unshard_sequence(out).shape == (1, 4 * world, 2, 4)
    # tags are per (dim, group): a sequence sharded over CP (zigzag) and then its heads over TP
    # (contiguous) is still zigzag along the sequence over CP
    if world == 4:
        dims = ok.init_parallel(tp=2, cp=2)
        full = torch.randn(1, 8, 4, 2, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
        y = ok.shard_sequence(ok.shard_sequence(full, dims.cp_group, dim=1, layout="zigzag"), dims.tp_group, dim=2,
                              layout="contiguous")
        assert torch.equal(ok.unshard_sequence(y, dims.cp_group, dim=1, layout="zigzag"),
                           ok.shard_sequence(full, dims.tp_group, dim=2, layout="contiguous"))
        ok.ring_attention(y, y, y, dims.cp_group, causal=True, layout="zigzag")  # accepted
        with pytest.raises(ValueError, match=r"x_local was laid out with layout='zigzag'"):
            ok.unshard_sequence(y, dims.cp_group, dim=1, layout="contiguous")
    # the global positions each rank's pieces claim (the causal masks' and RoPE's) are the ones it holds
    from overlapkernels.ops.sequence_shard import segments

    positions = torch.arange(x.shape[1])
    for layout in ("zigzag", "contiguous"):
        held = ok.shard_sequence(positions, dim=0, layout=layout)
        pieces = segments(layout, world, rank, held.numel())
        assert sum(n for *_, n in pieces) == held.numel(), (layout, pieces)
        for offset, start, n in pieces:
            assert torch.equal(held[offset:offset + n], torch.arange(start, start + n)), (layout, offset, start)
    return True


def test_shard_and_unshard_sequence(rank_pool):
    assert rank_pool(4).run(_shard_roundtrip_on_rank) == [True] * 4


BAD = [
    # a truthy string would silently mean causal; SDPA's is_causal is refused the same way
    (lambda q, k, v: ok.ring_attention(q, k, v, causal="no"), TypeError, r"causal='no': expected a bool"),
    (lambda q, k, v: ok.ring_attention(q, k, v, return_lse=1), TypeError, r"return_lse=1: expected a bool"),
    (lambda q, k, v: ok.ring_attention(q, k, v, layout="ring"), ValueError,
     r"layout='ring': expected one of \['contiguous', 'zigzag'\]"),
    (lambda q, k, v: ok.ring_attention(q, k, v, qkv_format="bhsd"), ValueError, r"qkv_format='bhsd': expected one of"),
    (lambda q, k, v: ok.ring_attention(q, k.expand(2, 6, 3, 8), v.expand(2, 6, 3, 8)), ValueError,
     r"q has 4 heads, k/v 3: the query heads must be a multiple of the key/value heads"),
    (lambda q, k, v: ok.ring_attention(q, k.float(), v), ValueError, r"k.dtype=torch.float32 does not match q.dtype"),
    (lambda q, k, v: ok.ring_attention(q, k.to("meta"), v.to("meta")), ValueError, r"^k is on meta but q is on cpu$"),
    (lambda q, k, v: ok.ring_attention(q, k, v.expand(2, 6, 2, 8)), ValueError, r"k and v must have one shape"),
    (lambda q, k, v: ok.ring_attention(q[:, :5], k[:, :5], v[:, :5], layout="zigzag"), ValueError,
     r"local sequence length 5 \(q.shape\[1\], bshd\) is odd: layout='zigzag' needs S divisible by 2 x the group "
     r"size"),
    # sbhd: the sequence is dim 0 (checking dim 1, the batch, let an odd part through to be cut short)
    (lambda q, k, v: ok.ring_attention(*(t.transpose(0, 1)[:5] for t in (q, k, v)), layout="zigzag",
                                       qkv_format="sbhd"), ValueError,
     r"local sequence length 5 \(q.shape\[0\], sbhd\) is odd"),
    (lambda q, k, v: ok.ring_attention(q, k[:, :4], v[:, :4]), ValueError,
     r"must agree in batch, local sequence length and head dim"),
    (lambda q, k, v: ok.ring_attention(q[0], k, v), ValueError, r"q must be 4-D \(bshd\), got shape \(6, 4, 8\)"),
    (lambda q, k, v: ok.ring_attention(q, k, v, softmax_scale=float("nan")), ValueError,
     r"softmax_scale=nan: expected a finite number"),
    (lambda q, k, v: ok.ring_attention(q, k, v, softmax_scale="0.1"), TypeError,
     r"softmax_scale must be a real number or None, got str"),
    (lambda q, k, v: ok.ring_attention(q.numpy(), k, v), TypeError, r"q must be a torch.Tensor, got ndarray"),
    (lambda q, k, v: ok.shard_sequence(torch.ones(2, 7), layout="zigzag"), ValueError,
     r"x.shape\[1\]=7 is not divisible by 4 \(2 x the group size 2, layout='zigzag'\)"),
    (lambda q, k, v: ok.shard_sequence(torch.ones(2, 7), layout="contiguous"), ValueError,
     r"x.shape\[1\]=7 is not divisible by 2 \(the group size 2"),
    (lambda q, k, v: ok.shard_sequence(torch.ones(2, 8), dim=2), ValueError, r"dim=2 is not a dim of x"),
    (lambda q, k, v: ok.shard_sequence(torch.ones(2, 8), dim="1"), ValueError, r"dim='1' is not a dim of x"),
    (lambda q, k, v: ok.unshard_sequence(torch.ones(2, 8), dim=1.0), ValueError, r"dim=1.0 is not a dim of x_local"),
    (lambda q, k, v: ok.unshard_sequence(torch.ones(2, 3)), ValueError, r"x_local.shape\[1\]=3 is odd"),
    (lambda q, k, v: ok.ring_attention(q.long(), k.long(), v.long()), ValueError,
     r"q.dtype=torch.int64: expected one of \['torch.float16', 'torch.bfloat16', 'torch.float32', 'torch.float64'\]"),
    (lambda q, k, v: ok.ring_attention(q.bool(), k.bool(), v.bool()), ValueError, r"q.dtype=torch.bool: expected"),
    (lambda q, k, v: ok.ring_attention(q, k[:, :, :0], v[:, :, :0]), ValueError, r"k/v 0: the query heads must be"),
    # the defaults differ (shard_sequence zigzag, ring_attention contiguous): a dropped layout= is refused
    (lambda q, k, v: ok.ring_attention(*(ok.shard_sequence(t[:, :4]) for t in (q, k, v)), causal=True), ValueError,
     r"ring_attention: q was laid out with layout='zigzag' \(by shard_sequence or ring_attention\) but "
     r"layout='contiguous' was passed"),
    (lambda q, k, v: ok.unshard_sequence(ok.shard_sequence(q[:, :4], layout="contiguous")), ValueError,
     r"unshard_sequence: x_local was laid out with layout='contiguous'.* but layout='zigzag' was passed"),
]


def _bad_inputs_on_rank():
    q = torch.ones(2, 6, 4, 8, dtype=torch.float64)
    k = v = torch.ones(2, 6, 1, 8, dtype=torch.float64)
    for i, (call, exc_type, pattern) in enumerate(BAD):
        try:
            with no_communication():  # refused before the ring starts, not after a step every rank ran
                call(q, k, v)
        except exc_type as exc:
            assert re.search(pattern, str(exc)), (i, str(exc))
        else:
            raise AssertionError(f"case {i}: no {exc_type.__name__}")
    total = torch.ones(1)
    dist.all_reduce(total)  # nobody communicated before raising
    return int(total)


def test_bad_input_raises_before_communicating(rank_pool):
    assert rank_pool(2).run(_bad_inputs_on_rank) == [2, 2]


def _disagreeing_ranks_on_rank():
    r, level = dist.get_rank(), dist.get_debug_level()
    q = torch.ones(1, 4, 2, 8, dtype=torch.float64)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        ok.ring_attention(q, q, q, causal=r == 0, layout="zigzag")
    except ValueError as exc:
        return str(exc)
    finally:
        dist.set_debug_level(level)


def test_disagreeing_ranks_are_named_under_distributed_debug(rank_pool):
    """A causal rank beside a non-causal one would silently compute a mix of the two (and other
    shapes would abort gloo); with TORCH_DISTRIBUTED_DEBUG=DETAIL every rank is told instead."""
    for message in rank_pool(2).run(_disagreeing_ranks_on_rank):
        assert message == ("ring_attention: the ranks of the group disagree on causal (rank 0: causal=True; "
                           "rank 1: causal=False); every rank must make the same call "
                           "(TORCH_DISTRIBUTED_DEBUG=DETAIL check)")


@pytest.mark.usefixtures("world_of_one")
def test_group_of_one_is_plain_attention():
    """A 1-rank world in this process: the ring degenerates to one block."""
    group = dist.new_group([0])
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
    for causal in (False, True):
        out = ok.ring_attention(q, k, v, group, causal=causal)
        want, _ = _full_reference(q, k, v, causal, 4 ** -0.5)
        torch.testing.assert_close(out, want, atol=ATOL, rtol=RTOL)


def _callers_use_on_rank():
    """In-place ops on the output work (as on SDPA's); a second order raises by name rather than
    returning gradients that miss the ring's communication."""
    g = torch.Generator().manual_seed(5)
    seq = 4 * dist.get_world_size()
    for dtype, heads, tol in ((torch.float64, 2, ATOL), (torch.float32, 1, 1e-5)):  # fp32 lse / H = 1: no copy
        full = [torch.randn(1, seq, heads, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        out_ref, lse_ref = _full_reference(*full, True, 8 ** -0.5)
        (2 * out_ref.sum() + lse_ref.sum()).backward()
        q, k, v = (ok.shard_sequence(x.detach(), layout="zigzag").to(dtype).requires_grad_() for x in full)
        out, lse = ok.ring_attention(q, k, v, causal=True, layout="zigzag", return_lse=True)
        out.mul_(2)  # a backward reading the modified out or lse would give other gradients
        lse.add_(1)
        (out.sum() + lse.sum()).backward()
        for name, got, x in zip(("dq", "dk", "dv"), (q.grad, k.grad, v.grad), full):
            want = ok.shard_sequence(x.grad, layout="zigzag").to(dtype)
            torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n} ({dtype}): {m}")
    results = []
    for linear in (False, True):  # a loss linear in the output too: no incoming gradient requires grad
        out = ok.ring_attention(torch.tanh(q), k, v)
        try:
            torch.autograd.grad((out * 3 if linear else out ** 2).sum(), q, create_graph=True)
        except RuntimeError as exc:
            results.append("ring_attention: create_graph=True (a second derivative) is not supported" in str(exc))
        else:
            results.append(False)
    out = ok.ring_attention(q, k, v)
    (gq,) = torch.autograd.grad(out.sum(), q)  # first order without a graph: fine
    return all(results) and gq.shape == q.shape


def test_callers_use_of_results(rank_pool):
    assert rank_pool(2).run(_callers_use_on_rank) == [True, True]
