"""OVERLAPKERNELS_AUTO=measure on gloo ranks: auto times its candidates on the first call of each
shape (forward and backward's dual ops), the slowest rank's times decide, every rank agrees, later
calls reuse the choice, and a bad mode is refused by name before anything communicates."""
import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from test_ops_tp_gloo import _compare, _make


def _measured_auto_on_rank():
    import os

    from overlapkernels.ops import measure

    r, w = dist.get_rank(), dist.get_world_size()
    os.environ["OVERLAPKERNELS_AUTO"] = "measure"
    try:
        measure._cache.clear()
        ok.reset_overlap_stats()
        g = torch.Generator().manual_seed(5)
        shards = [torch.randn(16, 24, generator=g, dtype=torch.float64) for _ in range(w)]
        b = torch.randn(24, 8, generator=g, dtype=torch.float64)
        a_all = [torch.randn(16 * w, 24, generator=g, dtype=torch.float64) for _ in range(w)]
        for _ in range(2):  # the second call of each shape takes the cached choice
            out = ok.all_gather_matmul(shards[r], b)
            torch.testing.assert_close(out, torch.cat(shards) @ b, atol=1e-12, rtol=1e-12)
            out = ok.matmul_reduce_scatter(a_all[r], b)
            torch.testing.assert_close(out, sum(x @ b for x in a_all).chunk(w)[r], atol=1e-12, rtol=1e-12)
        stats = ok.overlap_stats()
        # another group (its own communicator, maybe other links) is measured on its own
        ok.all_gather_matmul(shards[r], b, dist.new_group(list(range(w))))
        assert len(measure._cache) == 3, measure._cache
    finally:
        del os.environ["OVERLAPKERNELS_AUTO"]
    chosen = {op: method for (op, method), count in stats.items()}
    reasons = [reason for by_reason in stats.reasons.values() for reason in by_reason]
    assert sorted(stats.values()) == [2, 2], dict(stats)
    assert all(reason.startswith("measured on the first call") and "baseline" in reason and "decomposed" in reason
               for reason in reasons), reasons
    return chosen


def test_measured_auto_times_candidates_once_and_ranks_agree(rank_pool):
    """OVERLAPKERNELS_AUTO=measure: the first call of a shape times baseline and decomposed, every
    rank keeps the same (slowest-rank) fastest method, later calls reuse it, results stay exact."""
    chosen = rank_pool(2).run(_measured_auto_on_rank)
    assert chosen[0] == chosen[1] and set(chosen[0]) == {"all_gather_matmul", "matmul_reduce_scatter"}


def _measured_choice_on_fake_clock(costs_by_rank):
    """``measure.measured`` with a ``run`` that only advances a fake clock by this rank's cost of
    each method (seconds per call): which method wins follows from the costs alone."""
    from types import SimpleNamespace

    from overlapkernels.ops import measure

    clock, calls = [0.0], []

    def run(method):
        calls.append(method)
        cost = costs_by_rank[dist.get_rank()][method]  # seconds per call, or one per call in turn
        clock[0] += cost if isinstance(cost, float) else cost[calls.count(method) - 1]

    real_time = measure.time
    measure.time = SimpleNamespace(perf_counter=lambda: clock[0])
    measure._cache.clear()
    try:
        choice = measure.measured("matmul_reduce_scatter", ("fake",), dist.group.WORLD, torch.device("cpu"), run)
    finally:
        measure.time = real_time
        measure._cache.clear()
    # a warm-up call, then REPEATS timed ones, per candidate
    assert calls == [m for m in ("baseline", "decomposed") for _ in range(1 + measure.REPEATS)], calls
    return choice.method, choice.reason


@pytest.mark.parametrize("costs, expected", [
    # each rank alone would pick the other method; the slowest rank's step time decides: baseline
    # costs 20 ms (rank 0's), decomposed 40 ms (rank 1's)
    ([{"baseline": 0.020, "decomposed": 0.002}, {"baseline": 0.002, "decomposed": 0.040}], "baseline"),
    # decomposed slower on every rank: never chosen over baseline
    ([{"baseline": 0.010, "decomposed": 0.011}, {"baseline": 0.010, "decomposed": 0.012}], "baseline"),
    ([{"baseline": 0.010, "decomposed": 0.004}, {"baseline": 0.012, "decomposed": 0.006}], "decomposed"),
    # faster by less than the margin (2% < 3%): a tie, and baseline is the safe side
    ([{"baseline": 0.010, "decomposed": 0.0098}, {"baseline": 0.010, "decomposed": 0.0098}], "baseline"),
    # faster by more than the margin (5% > 3%): decomposed
    ([{"baseline": 0.010, "decomposed": 0.0095}, {"baseline": 0.010, "decomposed": 0.0095}], "decomposed"),
    # rank 0 alone would keep baseline (10 < 12 ms), but its peer's 30 ms baseline is the step's time:
    # every rank takes decomposed (14 ms), or the ranks would run different methods and hang
    ([{"baseline": 0.010, "decomposed": 0.012}, {"baseline": 0.030, "decomposed": 0.014}], "decomposed"),
])
def test_measured_auto_picks_the_fastest_by_the_slowest_rank(rank_pool, costs, expected):
    for method, reason in rank_pool(2).run(_measured_choice_on_fake_clock, costs):
        assert method == expected, reason
        slowest = {m: max(c[m] for c in costs) for m in ("baseline", "decomposed")}
        assert reason == ("measured on the first call of this shape (slowest rank): "
                          f"baseline {slowest['baseline'] * 1e3:.3g} ms, decomposed {slowest['decomposed'] * 1e3:.3g} ms")


def _measured_with_failing_candidates_on_rank(failing):
    """``failing[rank]``: the methods whose warm-up raises on that rank (a peer-memory setup that
    failed, an out-of-memory). -> (method or the error's text, whether the group still works)."""
    from types import SimpleNamespace

    from overlapkernels.ops import measure

    clock = [0.0]

    def run(method):
        if method in failing[dist.get_rank()]:
            raise RuntimeError(f"{method} cannot set up here")
        clock[0] += {"baseline": 0.010, "decomposed": 0.004}[method]

    real_time = measure.time
    measure.time = SimpleNamespace(perf_counter=lambda: clock[0])
    measure._cache.clear()
    try:
        outcome = measure.measured("all_gather_matmul", ("fake",), dist.group.WORLD, torch.device("cpu"), run).reason
    except RuntimeError as exc:
        outcome = f"raised: {exc}"
    finally:
        measure.time = real_time
        measure._cache.clear()
    total = torch.ones(1)
    dist.all_reduce(total)  # the ranks are still in step: nobody was left waiting in a collective
    return outcome, int(total)


def test_a_candidate_that_fails_on_one_rank_is_dropped_by_every_rank(rank_pool):
    (r0, n0), (r1, n1) = rank_pool(2).run(_measured_with_failing_candidates_on_rank, [set(), {"decomposed"}])
    assert n0 == n1 == 2
    assert r0 == ("measured on the first call of this shape (slowest rank): baseline 10 ms, "
                  "decomposed failed on another rank")
    assert r1 == ("measured on the first call of this shape (slowest rank): baseline 10 ms, "
                  "decomposed failed here (RuntimeError: decomposed cannot set up here)")


def test_when_every_candidate_fails_every_rank_raises_naming_them(rank_pool):
    (r0, n0), (r1, n1) = rank_pool(2).run(_measured_with_failing_candidates_on_rank,
                                          [{"baseline"}, {"decomposed"}])
    assert n0 == n1 == 2
    for outcome in (r0, r1):
        assert outcome.startswith("raised: all_gather_matmul: OVERLAPKERNELS_AUTO=measure: every candidate failed (")
    assert "baseline failed here" in r0 and "decomposed failed on another rank" in r0


def test_one_slow_timed_call_does_not_decide(rank_pool):
    """Each candidate's time is the median of its timed calls: one 100 ms hiccup among 4 ms calls
    (a context switch, a clock ramp) leaves decomposed the winner; a mean would have made it 23 ms."""
    decomposed = [0.004, 0.004, 0.004, 0.100, 0.004, 0.004]  # warm-up, then the timed calls
    costs = [{"baseline": 0.010, "decomposed": decomposed}] * 2
    for method, reason in rank_pool(2).run(_measured_choice_on_fake_clock, costs):
        assert method == "decomposed" and reason.endswith("baseline 10 ms, decomposed 4 ms"), reason


def _bad_auto_mode_on_rank():
    import os
    import re

    os.environ["OVERLAPKERNELS_AUTO"] = "fastest"
    try:
        for call in (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3)),
                     lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 3))):
            try:
                call()
            except ValueError as exc:
                assert re.search(r"OVERLAPKERNELS_AUTO='fastest': expected one of \['rules', 'measure'\]", str(exc))
            else:
                raise AssertionError("no ValueError")
    finally:
        del os.environ["OVERLAPKERNELS_AUTO"]
    total = torch.ones(1)
    dist.all_reduce(total)  # nobody communicated before raising
    return int(total)


def test_bad_auto_mode_is_rejected_by_name_before_communicating(rank_pool):
    assert rank_pool(2).run(_bad_auto_mode_on_rank) == [2, 2]


def _measured_backward_on_rank():
    """OVERLAPKERNELS_AUTO=measure times backward's dual ops too, under their own shapes (the
    all-gather's dgrad is a matmul + reduce-scatter of [W*m, N] @ [N, K], and back); grads exact."""
    import os

    from overlapkernels.ops import measure

    r, w = dist.get_rank(), dist.get_world_size()
    os.environ["OVERLAPKERNELS_AUTO"] = "measure"
    try:
        measure._cache.clear()
        ok.reset_overlap_stats()
        shards = [_make((16, 24), torch.float64, 70 + q, True) for q in range(w)]
        b = _make((24, 8), torch.float64, 80, True).requires_grad_()
        a = shards[r].clone().requires_grad_()
        ok.all_gather_matmul(a, b).sum().backward()
        rows = torch.cat(shards).requires_grad_()
        ok.matmul_reduce_scatter(rows, b).sum().backward()
        stats = ok.overlap_stats()
    finally:
        del os.environ["OVERLAPKERNELS_AUTO"]
    ones = torch.ones(16 * w, 8, dtype=torch.float64)
    _compare("grad a", a.grad, (w * ones @ b.detach().T).chunk(w)[r], True, torch.float64)
    _compare("grad rows", rows.grad, ones @ b.detach().T, True, torch.float64)
    keys = sorted((op, shapes) for op, _, *shapes in measure._cache)
    cpu = torch.device("cpu")
    assert keys == sorted([("all_gather_matmul", [(16, 24), ((24, 8),), torch.float64, cpu]),  # forward
                           ("all_gather_matmul", [(16, 8), ((8, 24),), torch.float64, cpu]),  # RS's dgrad
                           ("matmul_reduce_scatter", [(16 * w, 8), (8, 24), torch.float64, cpu]),  # AG's dgrad
                           ("matmul_reduce_scatter", [(16 * w, 24), (24, 8), torch.float64, cpu])]), keys
    reasons = [reason for by_reason in stats.reasons.values() for reason in by_reason]
    assert sum(stats.values()) == 4 and all(reason.startswith("measured on the first call") for reason in reasons)
    return {op: method for (op, method) in stats}


def test_measured_auto_covers_backward_dual_ops(rank_pool):
    chosen = rank_pool(2).run(_measured_backward_on_rank)
    assert chosen[0] == chosen[1]


def _measured_backward_with_frozen_input_on_rank():
    """matmul_reduce_scatter's backward with `a` frozen runs a plain gather of the gradient (no
    dgrad GEMM): nothing to overlap, so it takes the one collective unmeasured (it was timed, on
    that call), and is not measured on a GEMM it never runs either."""
    import os

    from overlapkernels.ops import measure

    w = dist.get_world_size()
    os.environ["OVERLAPKERNELS_AUTO"] = "measure"
    try:
        measure._cache.clear()
        ok.reset_overlap_stats()
        rows = _make((16 * w, 24), torch.float64, 90, True)  # no grad: frozen
        b = _make((24, 8), torch.float64, 91, True).requires_grad_()
        ok.matmul_reduce_scatter(rows, b).sum().backward()
    finally:
        del os.environ["OVERLAPKERNELS_AUTO"]
    _compare("grad b", b.grad, rows.T @ torch.ones(16 * w, 8, dtype=torch.float64), True, torch.float64)
    gathers = ok.overlap_stats().reasons.get(("all_gather_matmul", "baseline"), [])
    return sorted((op, shapes[1]) for op, _, *shapes in measure._cache), list(gathers)


def test_measured_backward_of_a_frozen_input_takes_the_plain_gather(rank_pool):
    for keys, gathers in rank_pool(2).run(_measured_backward_with_frozen_input_on_rank):
        assert keys == [("matmul_reduce_scatter", (24, 8))], keys
        assert gathers and all("no GEMM in this call" in g for g in gathers), gathers


def _measured_shapes_capped_on_rank():
    """Past MAX_SHAPES measured shapes of an op, new shapes take the rules; measured ones keep their
    choice. (Variable sequence lengths would otherwise measure call after call.)"""
    import os

    from overlapkernels.ops import measure

    os.environ["OVERLAPKERNELS_AUTO"] = "measure"
    saved = measure.MAX_SHAPES
    measure.MAX_SHAPES = 2
    try:
        measure._cache.clear()
        reasons = []
        for rows in (4, 6, 8, 4):  # two measured, a third shape past the cap, the first again
            ok.reset_overlap_stats()
            ok.all_gather_matmul(torch.ones(rows, 8, dtype=torch.float64), torch.ones(8, 3, dtype=torch.float64))
            (by_reason,) = ok.overlap_stats().reasons.values()
            reasons.append(next(iter(by_reason)))
        measured_keys = len(measure._cache)
    finally:
        measure.MAX_SHAPES = saved
        measure._cache.clear()
        del os.environ["OVERLAPKERNELS_AUTO"]
    return [r.startswith("measured on the first call") for r in reasons], measured_keys


def test_measured_auto_stops_measuring_new_shapes_past_its_cap(rank_pool):
    for measured_flags, keys in rank_pool(2).run(_measured_shapes_capped_on_rank):
        assert measured_flags == [True, True, False, True] and keys == 2


def _measured_cap_is_per_op_and_group_on_rank():
    """The cap counts one op's shapes on one group: another op, or the same op on another group,
    still measures its first shape. And matmul_reduce_scatter scattered over N (the output's last
    dim) is measured as over M."""
    import os

    from overlapkernels.ops import measure

    os.environ["OVERLAPKERNELS_AUTO"] = "measure"
    saved = measure.MAX_SHAPES
    measure.MAX_SHAPES = 1
    b = torch.ones(8, 4, dtype=torch.float64)
    group = dist.new_group(list(range(dist.get_world_size())))
    calls = [lambda: ok.all_gather_matmul(torch.ones(4, 8, dtype=torch.float64), b),  # fills the cap
             lambda: ok.matmul_reduce_scatter(torch.ones(4, 8, dtype=torch.float64), b),  # another op
             lambda: ok.all_gather_matmul(torch.ones(6, 8, dtype=torch.float64), b, group)]  # another group
    try:
        measure._cache.clear()
        reasons = []
        for call in calls:
            ok.reset_overlap_stats()
            call()
            (by_reason,) = ok.overlap_stats().reasons.values()
            reasons.append(next(iter(by_reason)))
        measure.MAX_SHAPES = saved
        ok.reset_overlap_stats()
        ok.matmul_reduce_scatter(torch.ones(4, 8, dtype=torch.float64), b, scatter_dim=-1)
        (by_reason,) = ok.overlap_stats(reset=True).reasons.values()
        reasons += list(by_reason)
    finally:
        measure.MAX_SHAPES = saved
        measure._cache.clear()
        del os.environ["OVERLAPKERNELS_AUTO"]
    return [r.startswith("measured on the first call") for r in reasons]


def test_measured_auto_caps_shapes_per_op_and_group(rank_pool):
    for measured_flags in rank_pool(2).run(_measured_cap_is_per_op_and_group_on_rank):
        assert measured_flags == [True, True, True, True]


def _every_candidate_failing_chains_the_first_error_on_rank(failing):
    """When every candidate failed, the RuntimeError each rank raises chains (``raise ... from``)
    the first error this rank's own warm-ups raised, so its traceback shows where that came from."""
    from overlapkernels.ops import measure

    def run(method):
        if method in failing[dist.get_rank()]:
            raise ValueError(f"{method} cannot set up here")

    measure._cache.clear()
    try:
        measure.measured("all_gather_matmul", ("fake",), dist.group.WORLD, torch.device("cpu"), run)
    except RuntimeError as exc:
        cause = exc.__cause__
        return None if cause is None else f"{type(cause).__name__}: {cause}"
    finally:
        measure._cache.clear()
    return "no error"


def test_when_every_candidate_fails_the_first_local_error_is_the_cause(rank_pool):
    """Rank 0's baseline fails and its decomposed only on rank 1; rank 1 fails both: each chains
    its first own failure, never the last, and none where it had none of its own."""
    causes = rank_pool(2).run(_every_candidate_failing_chains_the_first_error_on_rank,
                              [{"baseline"}, {"baseline", "decomposed"}])
    assert causes == ["ValueError: baseline cannot set up here"] * 2, causes
