"""symm and fused in the thread world (Triton interpreter): the peer-memory algorithms of
all_gather_matmul / matmul_reduce_scatter vs a dense reference, with stragglers, poisoned
buffers, repeated calls, autograd. Timeouts and failing ranks: test_ops_tp_peer_failures.py; the
fused GEMMs' tile configs and warm-up: test_ops_tp_peer_tiles.py."""
import time

import pytest
import torch

import overlapkernels as ok
from overlapkernels.comm.rank_pool import RankError
from overlapkernels.comm.thread_world import ThreadWorld
from test_ops_tp_gloo import fp32_partial_sums_case

METHODS = ["symm", "fused"]
WORLDS = [2, 4]
STRAGGLER_DELAY_S = 0.2  # models a slow rank: peers must wait on its signals, not race it


def _ints(shape, dtype, seed, device="cpu"):
    return torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)


def _rands(shape, seed, device="cpu"):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device)


def _forward_cases_on_rank(ctx, method, dtype, straggler, calls=3):
    r, w, dev = ctx.rank, ctx.world_size, ctx.device
    for call in range(calls):  # repeated calls reuse the workspace: epochs, released slots
        if r == straggler:
            time.sleep(STRAGGLER_DELAY_S)
        shards = [_ints((7, 33), dtype, 10 * call + q, dev) for q in range(w)]
        bs = [_ints((33, 5), dtype, 100 + call, dev), _ints((33, 3), dtype, 200 + call, dev)]
        gathered, outs = ok.all_gather_matmul(shards[r], bs, ctx, return_gathered=True, method=method)
        a_full = torch.cat(shards)
        assert torch.equal(gathered, a_full), call
        for out, b in zip(outs, bs):  # 0/1 inputs, K = 33: exact in any order, fp16 included
            assert out.dtype == dtype and torch.equal(out, (a_full.float() @ b.float()).to(dtype)), call
        a_all = [_ints((w * 7, 33), dtype, 300 + 10 * call + q, dev) for q in range(w)]
        b_all = [_ints((33, 6), dtype, 400 + 10 * call + q, dev) for q in range(w)]
        out = ok.matmul_reduce_scatter(a_all[r], b_all[r], ctx, method=method)
        want = sum(x.float() @ y.float() for x, y in zip(a_all, b_all)).chunk(w)[r].to(dtype)
        assert torch.equal(out, want), call
    # symmetric memory held by the all-gather: peers pull our shard from one [m, K] slot (it held W)
    capacities = {key[0]: ws.capacity for key, ws in ctx._workspaces.items() if key[0] in ("ag", "rs")}
    assert capacities == {"ag": 7 * 33, "rs": w * 7 * 6}, capacities
    return True


# fp16 at 2 ranks only: the dtype changes the tiles' element size, not the ring (4 ranks: ~11 s of CI)
@pytest.mark.parametrize("world, dtype", [(w, torch.float32) for w in WORLDS] + [(2, torch.float16)])
@pytest.mark.parametrize("method", METHODS)
def test_exact_with_straggler_and_poisoned_buffers(world, method, dtype):
    # workspaces start NaN-poisoned: a chunk read before it was written would show up here
    assert ThreadWorld(world, timeout=60).run(_forward_cases_on_rank, method, dtype, world - 1) == [True] * world


def _slow_inside_the_protocol_on_rank(ctx, method):
    """Rank 1 slow where the release waits matter (a straggler before the call cannot show them):
    - matmul_reduce_scatter: between 'every partial of my chunk arrived' and summing them, so peers
      must not push the next call's partials into its slots meanwhile;
    - all_gather_matmul: its copy engine slow to pull, so peers must not overwrite their published
      shard with the next call's before rank 1 has read it."""
    r, w = ctx.rank, ctx.world_size
    if r == 1:
        check_errors, side = ctx.check_errors, ctx.side_stream()
        submit = side.submit

        def slow_check(*args, **kwargs):
            time.sleep(STRAGGLER_DELAY_S)
            return check_errors(*args, **kwargs)

        def slow_submit(fn, keep_alive=()):
            def late():
                time.sleep(2 * STRAGGLER_DELAY_S)
                fn()
            return submit(late, keep_alive)

        ctx.check_errors, side.submit = slow_check, slow_submit
    # shrinking calls: each one's slots are a prefix of the region the previous call still reads
    for call, m in enumerate((7, 5, 3)):  # back to back: another op in between would hold the fast rank back
        shards = [torch.full((m, 33), float(10 * call + q)) for q in range(w)]
        gathered, _ = ok.all_gather_matmul(shards[r], torch.ones(33, 2), ctx, return_gathered=True, method=method)
        assert torch.equal(gathered, torch.cat(shards)), ("all_gather_matmul", call)
    for call, m in enumerate((7, 5, 3)):
        a_all = [_ints((w * m, 33), torch.float32, 10 * call + q) for q in range(w)]
        b = _ints((33, 6), torch.float32, 100 + call)
        out = ok.matmul_reduce_scatter(a_all[r], b, ctx, method=method)
        assert torch.equal(out, sum(x @ b for x in a_all).chunk(w)[r]), ("matmul_reduce_scatter", call)
    return True


@pytest.mark.parametrize("method", METHODS)
def test_slow_rank_inside_the_protocol(method):
    assert ThreadWorld(2, timeout=60).run(_slow_inside_the_protocol_on_rank, method) == [True, True]


def _autograd_on_rank(ctx, method):
    return _autograd_checks(ctx, ctx.rank, ctx.world_size, ctx.device, method)


def _autograd_checks(group, r, w, dev, method):
    """Forward and backward of both ops on ``group`` (a thread-world rank, or None: the default
    process group) vs dense fp32 math."""
    # all-gather + matmul, 3-D input gathered along dim 1, gradient of a, b and the gathered input
    shards = [_rands((2, 3, 16), q, dev) for q in range(w)]
    weights = [_rands((16, 8), 50 + q, dev) for q in range(w)]
    grads = [_rands((2, 3 * w, 8), 60 + q, dev) for q in range(w)]
    a = shards[r].clone().requires_grad_()
    b = weights[r].clone().requires_grad_()
    out = ok.all_gather_matmul(a, b, group, gather_dim=1, method=method)
    out.backward(grads[r])
    a_full = torch.cat(shards, dim=1)
    torch.testing.assert_close(out, a_full @ weights[r], atol=1e-5, rtol=1e-5)
    want_a = sum(g @ wt.T for g, wt in zip(grads, weights)).chunk(w, dim=1)[r]
    torch.testing.assert_close(a.grad, want_a, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b.grad, a_full.reshape(-1, 16).T @ grads[r].reshape(-1, 8), atol=1e-5, rtol=1e-5)

    # gathered along dim 0 the results are the method's own buffers: they must take in-place ops
    a0 = shards[r][:, 0].clone().requires_grad_()
    gathered, out0 = ok.all_gather_matmul(a0, weights[r], group, return_gathered=True, method=method)
    out0 += 1
    gathered.mul_(2)
    (out0.sum() + gathered.sum()).backward()
    a0_full = torch.cat([x[:, 0] for x in shards])
    torch.testing.assert_close(out0, a0_full @ weights[r] + 1, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(gathered, 2 * a0_full, atol=0, rtol=0)

    # matmul + reduce-scatter
    a_all = [_rands((w * 5, 16), 70 + q, dev) for q in range(w)]
    b_all = [_rands((16, 4), 80 + q, dev) for q in range(w)]
    g_all = [_rands((5, 4), 90 + q, dev) for q in range(w)]
    a2 = a_all[r].clone().requires_grad_()
    b2 = b_all[r].clone().requires_grad_()
    out2 = ok.matmul_reduce_scatter(a2, b2, group, method=method)
    out2.backward(g_all[r])
    torch.testing.assert_close(out2, sum(x @ y for x, y in zip(a_all, b_all)).chunk(w)[r], atol=1e-5, rtol=1e-5)
    g_full = torch.cat(g_all)
    torch.testing.assert_close(a2.grad, g_full @ b_all[r].T, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b2.grad, a_all[r].T @ g_full, atol=1e-5, rtol=1e-5)

    # linear + reduce-scatter over N (the output's last dim): the weight is the rows' operand
    from overlapkernels.ops.matmul_reduce_scatter import linear_reduce_scatter

    x_all = [_rands((2, 5, 16), 100 + q, dev) for q in range(w)]
    w_all = [_rands((w * 4, 16), 110 + q, dev) for q in range(w)]
    gn_all = [_rands((2, 5, 4), 120 + q, dev) for q in range(w)]
    x3, w3 = x_all[r].clone().requires_grad_(), w_all[r].clone().requires_grad_()
    out3 = linear_reduce_scatter(x3, w3, group, scatter_dim=-1, method=method)
    out3.backward(gn_all[r])
    want3 = sum(x @ wt.T for x, wt in zip(x_all, w_all)).chunk(w, dim=-1)[r]
    torch.testing.assert_close(out3, want3, atol=1e-5, rtol=1e-5)
    gn_full = torch.cat(gn_all, dim=-1)
    torch.testing.assert_close(x3.grad, gn_full @ w_all[r], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w3.grad, gn_full.reshape(-1, w * 4).T @ x_all[r].reshape(-1, 16), atol=1e-5, rtol=1e-5)
    return True


# symm at 2 ranks only: its 4-rank ring is the forward tests' (autograd adds the dual op, not the ring)
@pytest.mark.parametrize("world, method", [(2, "symm"), (2, "fused"), (4, "fused")])
def test_autograd_matches_dense(world, method):
    assert ThreadWorld(world, timeout=60).run(_autograd_on_rank, method) == [True] * world


@pytest.mark.parametrize("op", ["all_gather_matmul", "matmul_reduce_scatter"])
def test_a_planted_error_fails_the_autograd_checks(monkeypatch, op):
    """The checks above hold fp32 to 1e-5: a result off by 1e-4 in one element (a tile or chunk
    read early, a partial added twice would be off by far more) must fail them."""
    original = getattr(ok, op)

    def off(*args, **kwargs):
        result = original(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            return result
        return result + 1e-4 * (torch.arange(result.numel()) == 0).reshape(result.shape)

    monkeypatch.setattr(ok, op, off)
    with pytest.raises(RankError, match="Tensor-likes are not close"):
        ThreadWorld(2, timeout=60).run(_autograd_on_rank, "symm")


def _auto_on_rank(ctx):
    ok.reset_overlap_stats() if ctx.rank == 0 else None
    ctx.barrier()
    out = ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 2), ctx)
    ctx.barrier()
    return torch.equal(out, torch.full((4 * ctx.world_size, 2), 8.0))


def _auto_world_of_one_on_rank(ctx):
    ok.reset_overlap_stats()
    ag = ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 2), ctx)
    rs = ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 2), ctx)
    return torch.equal(ag, torch.full((4, 2), 8.0)) and torch.equal(rs, ag), dict(ok.overlap_stats())


def test_auto_in_a_thread_world_of_one_runs_and_counts_what_ran():
    """auto chose baseline for a world of one, which a thread-world group refuses: the default call
    raised, and overlap_stats counted a baseline call that never ran."""
    (ran, stats), = ThreadWorld(1, timeout=60).run(_auto_world_of_one_on_rank)
    assert ran and stats == {("all_gather_matmul", "symm"): 1, ("matmul_reduce_scatter", "symm"): 1}, stats


def test_auto_picks_fused_in_a_peer_world(caplog):
    with caplog.at_level("DEBUG", logger="overlapkernels.ops"):
        assert ThreadWorld(2).run(_auto_on_rank) == [True, True]
    stats = ok.overlap_stats()
    assert stats[("all_gather_matmul", "fused")] == 2
    reason = "peer-memory world: persistent Triton GEMM waiting on chunk signals"
    assert stats.reasons[("all_gather_matmul", "fused")] == {reason: 2}
    assert f"all_gather_matmul: method=fused ({reason})" in caplog.text  # the debug log says why, too


def _bf16_on_rank(ctx):
    """bf16 in the thread world on CPU: explicit fused is refused before any signal (no peer waits),
    auto runs symm; forward and backward of both ops vs fp32 math on the same bf16 values."""
    import re

    r, w = ctx.rank, ctx.world_size
    refused = []
    for call in (lambda: ok.all_gather_matmul(torch.ones(4, 8, dtype=torch.bfloat16),
                                              torch.ones(8, 2, dtype=torch.bfloat16), ctx, method="fused"),
                 lambda: ok.matmul_reduce_scatter(torch.ones(4, 8, dtype=torch.bfloat16),
                                                  torch.ones(8, 2, dtype=torch.bfloat16), ctx, method="fused")):
        try:
            call()
        except ValueError as exc:
            said = r"method='fused' with bfloat16 runs in Triton's interpreter here \(CPU\).*, or method='symm'$"
            refused.append(bool(re.search(said, str(exc))))
    shards = [_rands((6, 16), q).bfloat16() for q in range(w)]
    b = _rands((16, 8), 50).bfloat16().requires_grad_()
    a = shards[r].clone().requires_grad_()
    out = ok.all_gather_matmul(a, b, ctx)
    out.float().sum().backward()
    a_full = torch.cat(shards).float()
    # one bf16 rounding of values of a few units: 2^-8 relative, and the fp32 reference is exact-ish
    torch.testing.assert_close(out.float(), a_full @ b.detach().float(), atol=0.1, rtol=1e-2)
    torch.testing.assert_close(a.grad.float(), (torch.ones(6 * w, 8) @ b.detach().float().T).chunk(w)[r] * w,
                               atol=0.1, rtol=1e-2)
    a_all = [_rands((w * 3, 16), 70 + q).bfloat16() for q in range(w)]
    out2 = ok.matmul_reduce_scatter(a_all[r], b.detach(), ctx)
    torch.testing.assert_close(out2.float(), sum(x.float() @ b.detach().float() for x in a_all).chunk(w)[r],
                               atol=0.1, rtol=1e-2)
    return refused


def test_bf16_on_cpu_runs_symm_and_refuses_fused():
    """Triton's interpreter computes with bf16 wrongly (results ~1e10 off, silently): fused in bf16 on CPU is
    refused by name, and auto picks symm, whose GEMMs are torch's."""
    ok.reset_overlap_stats()
    assert ThreadWorld(2, timeout=60).run(_bf16_on_rank) == [[True, True]] * 2
    stats = ok.overlap_stats()
    assert {op for op, method in stats if method == "fused"} == set(), dict(stats)
    assert stats[("all_gather_matmul", "symm")] == 2 and stats[("matmul_reduce_scatter", "symm")] == 4, dict(stats)
    assert stats.reasons[("all_gather_matmul", "symm")] == {
        "peer-memory world, bfloat16 in Triton's interpreter, which computes bf16 wrongly: symm multiplies with torch": 2}


def _rs_partials_in_fp32_on_rank(ctx, dtype):
    """The owner sums the W partials of its chunk in fp32 and rounds once."""
    a_all, b_all, want, telling = fp32_partial_sums_case(ctx.world_size, ctx.rank, dtype)
    return torch.equal(ok.matmul_reduce_scatter(a_all[ctx.rank], b_all[ctx.rank], ctx, method="symm"), want), telling


def test_symm_owner_adds_partials_in_fp32():
    assert ThreadWorld(4, timeout=60).run(_rs_partials_in_fp32_on_rank, torch.bfloat16) == [(True, True)] * 4


def _fused_bf16_inside_on_rank(ctx):
    """_methods' entry points refuse fused bf16 on CPU by name themselves, before any signal: a
    caller that reaches them with a resolved method, without the op's check_available, is covered."""
    from overlapkernels.ops import _methods

    a, b = torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 2, dtype=torch.bfloat16)
    said = []
    for call in (lambda: _methods.ag_matmul(a, [b], ctx, "fused"), lambda: _methods.matmul_rs(a, b, ctx, "fused")):
        with pytest.raises(ValueError) as info:
            call()
        said.append(str(info.value).startswith("method='fused' with bfloat16 runs in Triton's interpreter here (CPU)"))
    return said


def test_fused_bf16_on_cpu_is_refused_inside_the_method_router():
    assert ThreadWorld(2, timeout=30).run(_fused_bf16_inside_on_rank) == [[True, True]] * 2


def _process_group_method_on_rank(ctx, method):
    """baseline and decomposed call torch.distributed, which a thread world is not: refused by name,
    for each op, before any rank touches the world's buffers (the symm call after them is exact)."""
    said = []
    for call in (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 2), ctx, method=method),
                 lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 2), ctx, method=method)):
        with pytest.raises(ValueError) as info:
            call()
        said.append(str(info.value))
    out = ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 2), ctx, method="symm")
    return said, torch.equal(out, torch.full((4 * ctx.world_size, 2), 8.0))


@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_process_group_methods_in_a_thread_world_are_refused_by_name(method):
    want = f"method={method!r} needs a process group; a thread-world group runs 'symm' or 'fused'"
    assert ThreadWorld(2, timeout=30).run(_process_group_method_on_rank, method) == [([want] * 2, True)] * 2


def _two_dtypes_one_shape_on_rank(ctx, method):
    """A float16 call, then a float32 one of the same shape: each dtype gets its own symmetric
    slots (a float16 slot would round the float32 shards on their way, silently)."""
    r, w = ctx.rank, ctx.world_size
    ones = (torch.ones(4, 8, dtype=torch.float16), torch.ones(8, 2, dtype=torch.float16))
    ok.all_gather_matmul(*ones, ctx, method=method)
    ok.matmul_reduce_scatter(torch.ones(w * 4, 8, dtype=torch.float16), ones[1], ctx, method=method)
    shards = [_rands((4, 8), q) * (1 + 2 ** -20) for q in range(w)]  # not representable in fp16
    gathered, _ = ok.all_gather_matmul(shards[r], torch.ones(8, 2), ctx, return_gathered=True, method=method)
    a_all = [_rands((w * 4, 8), 10 + q) for q in range(w)]
    b = _rands((8, 2), 20)
    out = ok.matmul_reduce_scatter(a_all[r], b, ctx, method=method)
    want = sum(x @ b for x in a_all).chunk(w)[r]
    return torch.equal(gathered, torch.cat(shards)), torch.allclose(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["symm", "fused"])
def test_each_dtype_has_its_own_workspace(method):
    assert ThreadWorld(2, timeout=60).run(_two_dtypes_one_shape_on_rank, method) == [(True, True)] * 2


def _float64_on_rank(ctx):
    """float64 in a peer-memory world: auto picked fused, whose Triton GEMM takes 32/16-bit only, and
    raised mid-call (after publishing the shard); now auto takes symm (exact), and an explicit fused
    is refused by name before any communication."""
    r, w = ctx.rank, ctx.world_size
    shards = [_rands((5, 8), 10 + q).double() for q in range(w)]
    b = _rands((8, 3), 20).double()
    ok.reset_overlap_stats()
    out = ok.all_gather_matmul(shards[r], b, ctx)
    a_all = [_rands((w * 5, 8), 30 + q).double() for q in range(w)]
    out_rs = ok.matmul_reduce_scatter(a_all[r], b, ctx)
    exact = (torch.equal(out, torch.cat(shards) @ b)
             and torch.allclose(out_rs, sum(a @ b for a in a_all).chunk(w)[r], atol=1e-12, rtol=1e-12))
    refused = []
    for call in (lambda: ok.all_gather_matmul(shards[r], b, ctx, method="fused"),
                 lambda: ok.matmul_reduce_scatter(a_all[r], b, ctx, method="fused")):
        try:
            call()
        except ValueError as exc:
            refused.append(str(exc).startswith("method='fused' computes float32, float16 or bfloat16 operands, "
                                               "got torch.float64"))
    return exact, sorted(method for _, method in ok.overlap_stats()), refused


def test_float64_takes_symm_and_fused_refuses_it_by_name():
    assert ThreadWorld(2, timeout=60).run(_float64_on_rank) == [(True, ["symm", "symm"], [True, True])] * 2


def _eval_then_train_on_rank(ctx, method):
    """An eval under inference_mode first (the op's first call: its workspace is built then), then
    training: the buffers kept across calls are no inference tensors (a later copy into them failed
    for good), and the thread world's copy thread runs in the caller's mode (it failed, and the rank
    spun on the flag it never set)."""
    g = torch.Generator().manual_seed(0)  # (not the global one: the ranks are threads of one process)
    a_all, b = torch.randn(8, 8, generator=g), torch.randn(8, 6, generator=g)
    shard = a_all.chunk(2)[ctx.rank].clone()
    with torch.inference_mode():
        evaluated = ok.all_gather_matmul(shard, b, ctx, method=method)
        summed = ok.matmul_reduce_scatter(a_all, b, ctx, method=method)
    a, w = shard.clone().requires_grad_(), b.clone().requires_grad_()
    out = ok.all_gather_matmul(a, w, ctx, method=method)
    out.sum().backward()
    want = a_all @ b
    return (torch.allclose(evaluated, want, atol=1e-5) and torch.allclose(out, want, atol=1e-5)
            and torch.allclose(summed, (2 * want).chunk(2)[ctx.rank], atol=1e-5)
            and torch.allclose(a.grad, (torch.ones(8, 6) @ b.T).chunk(2)[ctx.rank] * 2, atol=1e-5))


@pytest.mark.parametrize("method", ["symm", "fused"])
def test_an_inference_mode_call_first_then_training(method):
    assert ThreadWorld(2, timeout=60).run(_eval_then_train_on_rank, method) == [True, True]
