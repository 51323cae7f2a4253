"""all_gather_matmul / matmul_reduce_scatter on gloo ranks vs a dense single-process reference.

Every rank rebuilds the whole problem from one seed (its own and its peers' inputs), so it can
compute the unsharded reference itself. Inputs of small integers make every sum exact in any
order: those cases compare bitwise (atol=0), outputs and gradients alike. Also: 16-bit partial sums
added in fp32, autocast, and what callers do with the results (in-place ops, empty shards, a second
order refused). Bad input refused before communicating: test_ops_tp_bad_input_gloo.py.
"""

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok

WORLDS = [2, 4]
METHODS = ["baseline", "decomposed", "auto"]
TOL = {torch.float64: (1e-12, 1e-12), torch.float32: (2e-5, 2e-5)}  # (atol, rtol) for random inputs


def _make(shape, dtype, seed, exact):
    g = torch.Generator().manual_seed(seed)
    if exact:
        return torch.randint(0, 2, shape, generator=g).to(dtype)
    return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def _compare(name, got, want, exact, dtype):
    atol, rtol = (0.0, 0.0) if exact else TOL[dtype]
    torch.testing.assert_close(got, want, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- all_gather_matmul
AG_CASES = [  # (shard shape, gather_dim, weight widths)
    ((7, 33), 0, [5]),
    ((7, 3, 33), 0, [4, 9, 1]),
    ((3, 7, 33), 1, [6]),
    ((2, 7, 3, 33), -2, [2, 3]),
]


def _ag_case_on_rank(method, shard_shape, gather_dim, widths, dtype, exact, save_gathered, as_list, unused=None,
                     group=None):
    """``unused``: the index of an output that gets no gradient (a QKV part a model leaves out)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    k = shard_shape[-1]
    gd = gather_dim % len(shard_shape)
    shards = [_make(shard_shape, dtype, 100 + r, exact) for r in range(world)]
    weights = [[_make((k, n), dtype, 200 + 10 * r + i, exact) for i, n in enumerate(widths)] for r in range(world)]
    a_full = torch.cat(shards, dim=gd)
    grads_out = [[_make((*a_full.shape[:-1], n), dtype, 300 + 10 * r + i, exact) for i, n in enumerate(widths)]
                 for r in range(world)]

    a_shard = shards[rank].clone().requires_grad_()
    bs = [w.clone().requires_grad_() for w in weights[rank]]
    b_arg = bs if (as_list or len(bs) > 1) else bs[0]
    gathered, outs = ok.all_gather_matmul(a_shard, b_arg, group, gather_dim=gather_dim, return_gathered=True,
                                          method=method, save_gathered=save_gathered)
    assert isinstance(outs, list) == isinstance(b_arg, list)  # a tensor in, a tensor out
    outs = outs if isinstance(outs, list) else [outs]
    assert gathered.is_contiguous() and all(o.is_contiguous() for o in outs)  # like torch.cat(...) @ b
    _compare("gathered", gathered, a_full, True, dtype)  # a gather never rounds
    for i, out in enumerate(outs):
        _compare(f"out[{i}]", out, a_full @ weights[rank][i], exact, dtype)
    used = [i for i in range(len(outs)) if i != unused]
    torch.autograd.backward([outs[i] for i in used], [grads_out[rank][i] for i in used])

    # reference gradients: d a_full = sum over ranks and used weights of g @ b.T; our chunk along gd
    grad_a_full = sum(grads_out[r][i] @ weights[r][i].T for r in range(world) for i in used)
    _compare("grad a_shard", a_shard.grad, grad_a_full.chunk(world, dim=gd)[rank], exact, dtype)
    for i, b in enumerate(bs):
        if i == unused:
            assert b.grad is None
            continue
        want = a_full.reshape(-1, k).T @ grads_out[rank][i].reshape(-1, widths[i])
        _compare(f"grad b[{i}]", b.grad, want, exact, dtype)
    return True


def _ag_all_cases_on_rank(method, group=None):
    for shape, gd, widths in AG_CASES:
        for save in (False, True):
            _ag_case_on_rank(method, shape, gd, widths, torch.float64, True, save, False, group=group)
    _ag_case_on_rank(method, (7, 33), 0, [5, 3], torch.float64, False, False, True, group=group)
    _ag_case_on_rank(method, (7, 33), 0, [4, 5, 2], torch.float64, True, False, True, unused=1,  # K of QKV unused
                     group=group)
    _ag_case_on_rank(method, (7, 2, 33), 0, [5], torch.float32, False, False, False, group=group)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", METHODS)
def test_all_gather_matmul_matches_dense(rank_pool, world, method):
    assert rank_pool(world).run(_ag_all_cases_on_rank, method) == [True] * world


# ------------------------------------------------------------------------- matmul_reduce_scatter
RS_CASES = [  # (the output's shape but N, with the scatter dim per rank; scatter_dim; K; N per rank)
    ((7,), 0, 33, 5),
    ((7, 2), 0, 33, 4),
    ((2, 7), 1, 33, 6),
    ((2, 3, 7), 2, 33, 5),  # 4-D: moving dim 2 to the front and back are different permutations
    ((7,), 1, 33, 3),  # scattered over N, the output's last dim
    ((2, 5), -1, 33, 3),
]


def _rs_case_on_rank(method, lead_per_rank, scatter_dim, k, n, dtype, exact, group=None):
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    over_n = scatter_dim in (-1, len(lead_per_rank))
    lead = list(lead_per_rank)
    if over_n:  # N per rank x world columns, each rank keeps its n
        n_all = n * world
    else:
        lead[scatter_dim] *= world
        n_all = n
    a_all = [_make((*lead, k), dtype, 400 + r, exact) for r in range(world)]
    b_all = [_make((k, n_all), dtype, 500 + r, exact) for r in range(world)]
    out_shape = list(lead) + [n]
    if not over_n:
        out_shape[scatter_dim] //= world
    g_all = [_make(tuple(out_shape), dtype, 600 + r, exact) for r in range(world)]

    a = a_all[rank].clone().requires_grad_()
    b = b_all[rank].clone().requires_grad_()
    out = ok.matmul_reduce_scatter(a, b, group, scatter_dim=scatter_dim, method=method)
    assert out.is_contiguous()
    full = sum(x @ w for x, w in zip(a_all, b_all))
    _compare("out", out, full.chunk(world, dim=scatter_dim)[rank], exact, dtype)
    out.backward(g_all[rank])
    g_full = torch.cat(g_all, dim=scatter_dim)
    _compare("grad a", a.grad, g_full @ b_all[rank].T, exact, dtype)
    _compare("grad b", b.grad, a_all[rank].reshape(-1, k).T @ g_full.reshape(-1, n_all), exact, dtype)
    return True


def _rs_all_cases_on_rank(method, group=None):
    for lead, sd, k, n in RS_CASES:
        _rs_case_on_rank(method, lead, sd, k, n, torch.float64, True, group)
    _rs_case_on_rank(method, (7,), 0, 33, 5, torch.float64, False, group)
    _rs_case_on_rank(method, (7, 2), 0, 33, 5, torch.float32, False, group)
    return True


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("method", METHODS)
def test_matmul_reduce_scatter_matches_dense(rank_pool, world, method):
    assert rank_pool(world).run(_rs_all_cases_on_rank, method) == [True] * world


# ---------------------------------------------------------------------------------- planted error
def _planted_error_on_rank():
    """A one-ulp-scale error in one rank's chunk must fail the comparisons used above."""
    rank, world = dist.get_rank(), dist.get_world_size()
    a = _make((world * 7, 33), torch.float64, 7, False)
    b = _make((33, 5), torch.float64, 8, False)
    out = ok.matmul_reduce_scatter(a, b, method="decomposed")
    want = (a @ b * world).chunk(world)[rank]  # every rank holds the same a and b
    _compare("out", out, want, False, torch.float64)
    caught = []
    for exact in (False, True):
        bad = out.clone()
        bad[3, 2] += 1e-9 * max(1.0, abs(float(bad[3, 2])))
        try:
            _compare("out", bad, want, exact, torch.float64)
            caught.append(False)
        except AssertionError:
            caught.append(True)
    return caught


def fp32_partial_sums_case(world, rank, dtype):
    """Every rank's (a, b) and rank ``rank``'s chunk of the sum of a @ b, added in fp32 and rounded
    once. Random values (0/1 inputs sum exactly in any dtype, so they cannot tell): each chunk GEMM
    is rounded to 16 bits, and a sum of four such values is exact in fp32, so the reference is
    order-free and bitwise. Also tells whether 16-bit accumulation would differ on these inputs."""
    g = torch.Generator().manual_seed(0)
    a_all = [torch.randn(world * 16, 64, generator=g).to(dtype) for _ in range(world)]
    b_all = [torch.randn(64, 24, generator=g).to(dtype) for _ in range(world)]
    want = sum((x.chunk(world)[rank] @ y).float() for x, y in zip(a_all, b_all)).to(dtype)
    rounded_each_step = sum((x.chunk(world)[rank] @ y for x, y in zip(a_all, b_all)), torch.zeros_like(want))
    return a_all, b_all, want, not torch.equal(rounded_each_step, want)


def _fp32_partial_sums_on_rank(dtype):
    r, w = dist.get_rank(), dist.get_world_size()
    a_all, b_all, want, telling = fp32_partial_sums_case(w, r, dtype)
    reduced = torch.equal(ok.matmul_reduce_scatter(a_all[r], b_all[r], method="decomposed"), want)
    # the weight gradient of all-gather + matmul (only the shard saved: the ring gathers it again)
    # adds each arriving chunk's 16-bit product in fp32 the same way
    g = torch.Generator().manual_seed(1)
    shards = [torch.randn(16, 64, generator=g).to(dtype) for _ in range(w)]
    b = torch.randn(64, 24, generator=g).to(dtype).requires_grad_()
    grad_out = torch.randn(w * 16, 24, generator=g).to(dtype)
    ok.all_gather_matmul(shards[r], b, method="decomposed").backward(grad_out)
    products = [s.T @ grad_out[q * 16:(q + 1) * 16] for q, s in enumerate(shards)]
    want_wgrad = sum(p.float() for p in products).to(dtype)
    wgrad_telling = not torch.equal(sum(products, torch.zeros_like(want_wgrad)), want_wgrad)
    return reduced and torch.equal(b.grad, want_wgrad), telling and wgrad_telling


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_partial_sums_add_in_fp32(rank_pool, dtype):
    assert rank_pool(4).run(_fp32_partial_sums_on_rank, dtype) == [(True, True)] * 4


def test_planted_error_is_caught(rank_pool):
    assert rank_pool(2).run(_planted_error_on_rank) == [[True, True]] * 2


# ------------------------------------------------------------------------------------ autocast
def _autocast_on_rank(method):
    """Inside torch.autocast the ops run in its dtype, as the matmul they replace would, and their
    gradients reach fp32 leaves in fp32. 0/1 inputs with K = 16: bf16 products are exact."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [_make((6, 16), torch.float32, 10 + r, True) for r in range(world)]
    b = _make((16, 5), torch.float32, 20, True).requires_grad_()
    a = shards[rank].clone().requires_grad_()
    a_rows = torch.cat(shards).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ok.all_gather_matmul(a, b, method=method)
        out_rs = ok.matmul_reduce_scatter(a_rows, b, method=method)
        gathered, _ = ok.all_gather_matmul(a, b, method=method, return_gathered=True)
    full = torch.cat(shards).bfloat16() @ b.detach().bfloat16()
    assert out.dtype == out_rs.dtype == torch.bfloat16, (out.dtype, out_rs.dtype)
    # the shard travels cast (half the bytes): the gathered input is the one the GEMM consumed
    assert gathered.dtype == torch.bfloat16 and torch.equal(gathered, torch.cat(shards).bfloat16())
    _compare("out", out, full, True, None)
    _compare("out_rs", out_rs, (world * full.float()).chunk(world)[rank].bfloat16(), True, None)
    (out.float().sum() + out_rs.float().sum()).backward()
    assert a.grad.dtype == b.grad.dtype == a_rows.grad.dtype == torch.float32
    ones = torch.ones(world * 6, 5)
    _compare("grad a", a.grad, (world * ones @ b.detach().T).chunk(world)[rank], True, None)
    _compare("grad a_rows", a_rows.grad, ones @ b.detach().T, True, None)
    want_b = torch.cat(shards).T @ ones + a_rows.detach().T @ ones.chunk(world)[0].repeat(world, 1)
    _compare("grad b", b.grad, want_b, True, None)

    # backward called inside autocast (a loss computed there): the ops' backward keeps the forward's
    # precision, as autograd does for torch.matmul. Random values: bf16 would be off by ~1e-2
    g = torch.Generator().manual_seed(7)
    shards = [torch.randn(8, 32, generator=g) for _ in range(world)]
    b = torch.randn(32, 12, generator=g).requires_grad_()
    a, a_rows = shards[rank].clone().requires_grad_(), torch.cat(shards).requires_grad_()
    out, out_rs = ok.all_gather_matmul(a, b, method=method), ok.matmul_reduce_scatter(a_rows, b, method=method)
    g_out, g_rs = torch.randn(out.shape, generator=g), torch.randn(out_rs.shape, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.autograd.backward([out, out_rs], [g_out, g_rs])
    g_outs, g_rss = [torch.empty_like(g_out) for _ in range(world)], [torch.empty_like(g_rs) for _ in range(world)]
    dist.all_gather(g_outs, g_out)
    dist.all_gather(g_rss, g_rs)
    tight = dict(atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.grad, (sum(g_outs) @ b.detach().T).chunk(world)[rank], **tight)
    torch.testing.assert_close(a_rows.grad, torch.cat(g_rss) @ b.detach().T, **tight)
    torch.testing.assert_close(b.grad, torch.cat(shards).T @ g_out + a_rows.detach().T @ torch.cat(g_rss), **tight)

    qkv = [torch.randn(1, 4 * world, 2, 8, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    local = [x.chunk(world, dim=1)[rank] for x in qkv]  # layout="contiguous": rank r holds block r
    with torch.autocast("cpu", dtype=torch.bfloat16):
        att = ok.ring_attention(*local, causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(*(x.transpose(1, 2) for x in qkv), is_causal=True)
    assert att.dtype == torch.bfloat16
    torch.testing.assert_close(att.float(), want.transpose(1, 2).chunk(world, dim=1)[rank], atol=2e-2, rtol=2e-2)
    return True


@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_autocast_runs_in_its_dtype(rank_pool, method):
    assert rank_pool(2).run(_autocast_on_rank, method) == [True, True]


# ------------------------------------------------------------- what callers do with the results
def _callers_use_on_rank(method):
    """What code written for ``torch.cat(all_gather(a)) @ b`` does with the result must work for
    every method: in-place ops on the output and on the gathered input (out += bias, ReLU(inplace)),
    empty shards and K = 0; a second order raises by name rather than returning wrong gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [_make((3, 2, 6), torch.float64, 30 + r, False) for r in range(world)]
    b0, bias = _make((6, 5), torch.float64, 40, False), _make((5,), torch.float64, 41, False)
    a, b = shards[rank].clone().requires_grad_(), b0.clone().requires_grad_()
    gathered, out = ok.all_gather_matmul(a, b, return_gathered=True, method=method)
    out += bias
    out.relu_()
    gathered.mul_(2)
    (out.sum() + gathered.sum()).backward()
    ra, rb = torch.cat(shards).requires_grad_(), b0.clone().requires_grad_()
    ((ra @ rb + bias).relu().sum() + (2 * ra).sum()).backward()
    _compare("out", out, (ra @ rb + bias).relu(), False, torch.float64)
    _compare("grad a", a.grad, ra.grad.chunk(world)[rank] * world, False, torch.float64)  # every rank's loss
    _compare("grad b", b.grad, rb.grad, False, torch.float64)
    a_rs = torch.cat(shards).requires_grad_()  # the same on every rank: the sum is world * a @ b
    rs = ok.matmul_reduce_scatter(a_rs, b0, method=method)
    rs += bias  # in place on the reduce-scattered output too
    rs.sum().backward()
    _compare("rs out", rs, (world * (a_rs.detach() @ b0)).chunk(world)[rank] + bias, False, torch.float64)
    # the summed loss over ranks is sum(sum_q a_q @ b): each rank's a gets ones @ b^T
    _compare("rs grad a", a_rs.grad, torch.ones(*a_rs.shape[:-1], 5, dtype=torch.float64) @ b0.T, False,
             torch.float64)

    # the products are not views (a module returning one would make FSDP2 warn, and an in-place op on
    # it drop FSDP2's pre-backward hook), for 2-D and 3-D inputs, gather dims 0 and 1, lists of weights
    for x, dim in ((shards[rank], 0), (shards[rank], 1), (shards[rank][0], 0)):
        for got in (ok.all_gather_matmul(x, b0, gather_dim=dim, method=method),
                    *ok.all_gather_matmul(x, [b0, b0[:, :2]], gather_dim=dim, method=method),
                    ok.matmul_reduce_scatter(torch.cat([x] * world, dim=dim), b0, scatter_dim=dim, method=method)):
            assert got._base is None, (x.shape, dim)
    # the gathered input stays a view of what backward saved (save_gathered): changing it in place raises
    a = shards[rank].clone().requires_grad_()
    gathered, out = ok.all_gather_matmul(a, b0, return_gathered=True, save_gathered=True, method=method)
    gathered.mul_(2)
    try:
        out.sum().backward()
    except RuntimeError as exc:
        assert "modified by an inplace operation" in str(exc), str(exc)
    else:
        raise AssertionError("an in-place change to the saved gathered input went unnoticed")

    for m_rows, k in ((0, 6), (2, 0)):  # as torch.cat(...) @ b: an empty result, or zeros
        got = ok.all_gather_matmul(torch.ones(m_rows, k, dtype=torch.float64), torch.ones(k, 5, dtype=torch.float64),
                                   method=method)
        assert got.shape == (world * m_rows, 5) and not got.any(), (m_rows, k, got)
        got = ok.matmul_reduce_scatter(torch.ones(world * m_rows, k, dtype=torch.float64),
                                       torch.ones(k, 5, dtype=torch.float64), method=method)
        assert got.shape == (m_rows, 5) and not got.any(), (m_rows, k, got)

    # a loss nonlinear in the output, and one linear in it (then no incoming gradient requires grad:
    # torch's once_differentiable would let that through with the second-order terms missing, as it
    # would a second autograd.grad with inputs=): building the graph of backward is refused at once
    for op, name in (("ag", "all_gather_matmul"), ("rs", "matmul_reduce_scatter")):
        for linear in (False, True):
            x = (shards[rank] if op == "ag" else torch.cat(shards)).clone().requires_grad_()
            y = (ok.all_gather_matmul(torch.tanh(x), b0, method=method) if op == "ag" else
                 ok.matmul_reduce_scatter(torch.tanh(x), b0, method=method))
            try:
                torch.autograd.grad((y * 3 if linear else y ** 2).sum(), x, create_graph=True)
            except RuntimeError as exc:
                assert f"{name}: create_graph=True (a second derivative) is not supported" in str(exc), str(exc)
            else:
                raise AssertionError(f"{op} (linear={linear}): a graph of backward was built without the "
                                     "communication")
    return True


@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_callers_use_of_results(rank_pool, method):
    assert rank_pool(2).run(_callers_use_on_rank, method) == [True, True]
