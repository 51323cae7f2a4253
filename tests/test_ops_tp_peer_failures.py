"""symm and fused in the thread world when something goes wrong: a rank that never signals (the
wait names its chunk), a rank that fails (its peers' waits are released), the run's limit, a
missing wait planted in the fused GEMM, and an error raised at a call's check that must leave the
protocol in step."""
import re

import pytest
import torch

import overlapkernels as ok
from overlapkernels.comm.rank_pool import RankError
from overlapkernels.comm.thread_world import ThreadWorld
from overlapkernels.kernels.errors import new_error_record
from overlapkernels.kernels.triton.ag_gemm import ag_gemm
from overlapkernels.kernels.triton.signals import polls
from test_ops_tp_peer import METHODS, _ints


def _one_call(ctx, op, method):
    if op == "ag":
        ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 2), ctx, method=method)
    else:
        ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 2), ctx, method=method)


def _missing_rank_on_rank(ctx, op, method, short_wait=True):
    _one_call(ctx, op, method)  # both ranks: the workspace exists, flags are at call 1
    if ctx.rank == 0:
        if short_wait:
            # a short budget for the wait that must fail only: call 1's waits under a loaded machine
            # could outlast one and fail a wait that was not meant to (seen 1 run in 9 at 0.1 s)
            ctx.wait_timeout = 0.1
        _one_call(ctx, op, method)  # rank 1 never joins call 2


def _failing_rank_on_rank(ctx, op, method):
    _one_call(ctx, op, method)
    if ctx.rank == 1:
        raise ValueError("planted failure on rank 1")
    _one_call(ctx, op, method)  # waits for rank 1, with the world's whole budget


NEVER_SIGNALS = {"ag": "all_gather_matmul[{m}]: rank 0 timed out waiting for chunk 1 from rank 1 (call 2)",
                 "rs": "matmul_reduce_scatter[{m}]: rank 0 timed out waiting for rank 1's partial of chunk 0 (call 2)"}


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_a_rank_that_never_signals_times_out_naming_the_chunk(method, op):
    with pytest.raises(RankError) as info:
        ThreadWorld(2, timeout=60).run(_missing_rank_on_rank, op, method)
    assert "SignalTimeoutError: ok/" + NEVER_SIGNALS[op].format(m=method) in str(info.value)


@pytest.mark.parametrize("method, op", [("symm", "rs"), ("fused", "ag")])
def test_a_failing_rank_releases_the_waits_of_its_peers(method, op):
    """Rank 1 raises between two calls; rank 0's second call waits for it with the world's whole
    budget (30 s, minutes of interpreted polls on a loaded machine). It ran that out - a thread that
    cannot be killed, spinning on one of CI's two cores - and the run ended as a RankTimeout after
    60 s. Now the failure releases the peers' waits: rank 1's error comes first, rank 0's wait
    as its consequence (whichever wait of its call was not yet satisfied when released: its own
    partial's too, so the test does not pin the chunk)."""
    with pytest.raises(RankError) as info:
        ThreadWorld(2, timeout=60).run(_failing_rank_on_rank, op, method)
    text = str(info.value)
    # (rank 0's part, once in ~30 runs under load, was not the released wait's: kept to what is certain)
    assert re.search(r"(?s)ranks \[0, 1\] failed\n  rank 1: ValueError: planted failure on rank 1\n  rank 0: [^\n]*\(a consequence\)\n"
                     r"--- rank 1 of 2 ---.*ValueError: planted failure on rank 1\n+"
                     r"--- rank 0 of 2 ---\n\((waits released|barrier aborted) because another rank failed\)", text), text


def test_the_runs_limit_releases_a_wait_for_a_rank_that_never_came():
    """No short budget this time: the world's (300 s) would outlast the run's 5 s limit, which
    reported only "still running" and left the spinning thread behind, the world unusable. Now the
    limit releases the wait, which names its chunk, and the world runs again at once."""
    world = ThreadWorld(2, timeout=600)
    with pytest.raises(RankError) as info:
        world.run(_missing_rank_on_rank, "ag", "symm", False, timeout=5)
    text = str(info.value)
    assert "ranks [0] failed (their waits released at the run's 5 s limit)" in text, text
    assert "SignalTimeoutError: ok/" + NEVER_SIGNALS["ag"].format(m="symm") in text
    assert world.run(lambda ctx: ctx.rank) == [0, 1]


def test_planted_missing_wait_is_caught():
    """The fused GEMM reads chunks only after their arrived flag. Pre-set flags with chunks not yet
    copied (poisoned): the exact comparison must fail, so the tests above would catch a missing
    or misplaced wait. With the flags honest and nobody copying, it times out instead."""
    w, m = 2, 7
    a_full = torch.full((w * m, 33), float("nan"))
    a_full[:m] = _ints((m, 33), torch.float32, 1)
    b = _ints((33, 5), torch.float32, 2)
    out = torch.empty(w * m, 5)
    err = new_error_record("cpu")
    ag_gemm(a_full, b, out, torch.ones(w, dtype=torch.int64), err, rank=0, world_size=w, epoch=1, budget=polls(10))
    assert torch.equal(out[:m], a_full[:m] @ b) and out[m:].isnan().all()
    ag_gemm(a_full, b, out, torch.zeros(w, dtype=torch.int64), err, rank=0, world_size=w, epoch=1, budget=polls(10))
    assert err[:4].tolist() == [1, 0, 1, 1]  # ready timeout, rank 0, chunk 1, peer 1


class _EarlierCallTimedOut(RuntimeError):
    """What a call's ``check_errors`` raises on a GPU when an earlier call had timed out."""


def _deferred_error_on_rank(ctx, op, method):
    """On a GPU process world a timeout is raised a call late (``DeferredErrorCheck``): a call that
    itself went fine raises its predecessor's error from ``check_errors``. That call must still have
    finished its part of the protocol (released its slots), or every peer's next call waits out
    its timeout, and one error spreads to all ranks. Rank 0's check raises on call 1 here."""
    r, w = ctx.rank, ctx.world_size

    def call(seed):
        if op == "ag":
            shards = [_ints((4, 8), torch.float32, seed + q) for q in range(w)]
            out = ok.all_gather_matmul(shards[r], _ints((8, 3), torch.float32, seed), ctx, method=method)
            return torch.equal(out, torch.cat(shards) @ _ints((8, 3), torch.float32, seed))
        a_all = [_ints((2 * w, 8), torch.float32, seed + q) for q in range(w)]
        out = ok.matmul_reduce_scatter(a_all[r], _ints((8, 3), torch.float32, seed), ctx, method=method)
        return torch.equal(out, sum(x @ _ints((8, 3), torch.float32, seed) for x in a_all).chunk(w)[r])

    check_errors = ctx.check_errors
    if r == 0:
        def raising(*args, **kwargs):
            ctx.check_errors = check_errors  # once
            raise _EarlierCallTimedOut("an earlier call timed out")

        ctx.check_errors = raising
    try:
        call(0)
        caught = False
    except _EarlierCallTimedOut:
        caught = True
    return caught, call(10), call(20)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("op", ["ag", "rs"])
def test_an_error_raised_at_the_check_leaves_the_protocol_in_step(method, op):
    # wait timeout 10 s (half the world's; slack for a loaded CI machine): a slot never released makes
    # the next call wait it out and time out
    results = ThreadWorld(2, timeout=20).run(_deferred_error_on_rank, op, method, timeout=90)
    assert results == [(True, True, True), (False, True, True)]
