"""How the TP ops choose and police their method, on gloo ranks and in-process: auto's rules and
strict mode, overlap_stats and its reasons, and the cross-rank call check under
TORCH_DISTRIBUTED_DEBUG=DETAIL. Measured auto: test_ops_measured_auto_gloo.py; the process world's
peer-memory rules: test_process_world_gloo.py; the numerics: test_ops_tp_gloo.py.
"""
import os

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.layers import RowParallelLinear


# ------------------------------------------------------------------------- auto, stats, strict mode
def _auto_and_strict_on_rank():
    ok.reset_overlap_stats()
    small = torch.ones(4, 8, dtype=torch.float64)
    big = torch.ones(128, 512, dtype=torch.float64)  # 512 KiB ring messages, 0.75 flop/B: decomposed pays off
    w_small, w_big = torch.ones(8, 3, dtype=torch.float64), torch.ones(512, 3, dtype=torch.float64)
    ok.all_gather_matmul(small, w_small)
    ok.all_gather_matmul(big, w_big)
    ok.all_gather_matmul(small, w_small, method="decomposed")
    stats = ok.overlap_stats()
    try:
        with ok.strict_overlap():
            ok.all_gather_matmul(big, w_big)  # fine: overlapped
            ok.all_gather_matmul(small, w_small, method="baseline")  # explicit: not a fallback
            empty = ok.all_gather_matmul(small[:0], w_small)  # nothing to overlap: not policed (it raised)
            assert empty.shape == (0, 3)
            ok.all_gather_matmul(small, w_small)
        strict_error = None
    except ok.StrictOverlapError as exc:
        strict_error = str(exc)
    # the refused call never ran: only the two strict calls that did are counted
    ran = {("all_gather_matmul", "decomposed"): 1, ("all_gather_matmul", "baseline"): 2}
    assert dict(ok.overlap_stats()) == {k: stats.get(k, 0) + ran.get(k, 0) for k in {*stats, *ran}}
    return dict(stats), {k: list(v) for k, v in stats.reasons.items()}, strict_error, _strict_backward_error()


def _strict_backward_error():
    """On CUDA the autograd engine runs backward on its own thread, where strict_overlap()'s
    context is unset: the op must carry forward's strictness into its backward. K = 1024: the
    forward matmul + reduce-scatter overlaps (256 flop/B), its backward all-gather + GEMM would not."""
    import threading

    a = torch.ones(128, 1024, dtype=torch.float64, requires_grad=True)
    b = torch.ones(1024, 1024, dtype=torch.float64)
    with ok.strict_overlap():
        out = ok.matmul_reduce_scatter(a, b)
    errors = []

    def run_backward():
        try:
            out.sum().backward()
        except ok.StrictOverlapError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=run_backward)  # a new thread starts with an empty context
    worker.start()
    worker.join()
    return errors[0] if errors else None


def test_auto_records_choice_and_strict_mode_raises(rank_pool):
    for counts, reasons, strict_error, backward_error in rank_pool(2).run(_auto_and_strict_on_rank):
        assert counts == {("all_gather_matmul", "baseline"): 1, ("all_gather_matmul", "decomposed"): 2}
        assert any("gloo ring message 256 B <" in r for r in reasons[("all_gather_matmul", "baseline")])
        assert "requested" in reasons[("all_gather_matmul", "decomposed")]
        assert strict_error and "all_gather_matmul: strict_overlap() is active" in strict_error
        assert "gloo ring message 256 B" in strict_error
        assert backward_error and "all_gather_matmul: strict_overlap() is active" in backward_error
        assert "256 GEMM flop per byte sent > 128" in backward_error


def _frozen_input_backward_on_rank():
    """matmul_reduce_scatter with ``a`` frozen (a LoRA base's input): backward gathers grad_out for
    b's gradient but multiplies nothing, so there is nothing to overlap - auto takes the plain
    collective, says why, and strict mode (which polices fallbacks of GEMM calls) lets it be."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    a_full = torch.randn(world * 256, 8, generator=g, dtype=torch.float64)  # each rank's own a
    b = torch.randn(8, 256, generator=g, dtype=torch.float64, requires_grad=True)
    a = a_full + rank
    ok.reset_overlap_stats()
    with ok.strict_overlap():
        out = ok.matmul_reduce_scatter(a, b)  # 512 KiB ring messages at 2 flop/B: overlapped
        (out * (rank + 1)).sum().backward()
    stats = ok.overlap_stats()
    # rank q's b (a TP shard) gets d/db_q sum_r (r + 1) * chunk_r(sum_q a_q @ b_q) = a_q.T @ G,
    # G's chunk r all (r + 1): the gathered gradient
    grad_out = torch.cat([torch.full((256, 256), r + 1.0, dtype=torch.float64) for r in range(world)])
    want = a.T @ grad_out
    torch.testing.assert_close(b.grad, want, rtol=1e-12, atol=1e-9)
    return dict(stats), list(stats.reasons.get(("all_gather_matmul", "baseline"), []))


def test_backward_gather_without_gemm_is_one_collective(rank_pool):
    for counts, reasons in rank_pool(2).run(_frozen_input_backward_on_rank):
        assert counts == {("matmul_reduce_scatter", "decomposed"): 1, ("all_gather_matmul", "baseline"): 1}
        assert reasons and all("no GEMM in this call" in r for r in reasons), reasons


def _rs_reason_on_rank():
    ok.reset_overlap_stats()
    ok.matmul_reduce_scatter(torch.ones(2 * 128, 512, dtype=torch.float64), torch.ones(512, 8, dtype=torch.float64))
    # bf16 operands: the running sum travels in fp32, 128 x 1024 x 4 B = 512 KiB (2 B each would be 256 KiB)
    ok.matmul_reduce_scatter(torch.ones(2 * 128, 8, dtype=torch.bfloat16), torch.ones(8, 1024, dtype=torch.bfloat16))
    return {key: list(reasons) for key, reasons in ok.overlap_stats(reset=True).reasons.items()}


def test_reduce_scatter_rules_see_one_chunk(rank_pool):
    """A ring step of matmul + reduce-scatter sends one [m, N] running sum, m = rows / world:
    128 x 8 fp64 = 8192 B here (the whole [256, 8] would be twice that); fp32 for 16-bit inputs."""
    for reasons in rank_pool(2).run(_rs_reason_on_rank):
        assert any("gloo ring message 8192 B <" in r for r in reasons[("matmul_reduce_scatter", "baseline")]), reasons
        assert reasons[("matmul_reduce_scatter", "decomposed")] == [
            "gloo ring message 524288 B, 4 flop/B: async P2P overlaps the CPU matmul (CPU benchmark)"], reasons


def _shared_gather_reason_on_rank():
    ok.reset_overlap_stats()
    a = torch.ones(128, 512, dtype=torch.float64)  # 512 KiB ring messages
    ok.all_gather_matmul(a, [torch.ones(512, 384, dtype=torch.float64)] * 2)  # 2 x 384 columns: 192 flop/B
    return {key: list(reasons) for key, reasons in ok.overlap_stats(reset=True).reasons.items()}


def test_a_shared_gather_counts_every_weights_gemm(rank_pool):
    """One gather feeding several GEMMs (QKV, gate/up) hides behind all of them: the intensity is
    that of the weights' total width (each alone, 96 flop/B, would be under the limit of 128)."""
    for reasons in rank_pool(2).run(_shared_gather_reason_on_rank):
        assert list(reasons) == [("all_gather_matmul", "baseline")], reasons
        assert "gloo, 192 GEMM flop per byte sent > 128" in reasons[("all_gather_matmul", "baseline")][0], reasons


def test_rule_thresholds_at_their_boundaries():
    """The documented rules exactly at their limits: CUDA from 1024 rows per rank, gloo from 512 KiB
    messages and up to (including) the op's flop-per-byte limit."""
    from overlapkernels.ops import dispatch

    def method(op="all_gather_matmul", *, device="cpu", rows=8, nbytes=dispatch.GLOO_MIN_STEP_BYTES, flops=None):
        return dispatch.choose(op, "auto", world_size=4, rows_per_rank=rows, step_bytes=nbytes,
                               step_flops=nbytes if flops is None else flops, device=torch.device(device),
                               peer_memory=False).method

    try:
        limit = dispatch.CUDA_MIN_ROWS_PER_RANK
        assert [method(device="cuda", rows=rows) for rows in (limit - 1, limit)] == ["baseline", "decomposed"]
        least = dispatch.GLOO_MIN_STEP_BYTES
        assert [method(nbytes=nbytes) for nbytes in (least - 1, least)] == ["baseline", "decomposed"]
        for op, most in dispatch.GLOO_MAX_FLOPS_PER_BYTE.items():
            assert [method(op, flops=most * least + extra) for extra in (0, 1)] == ["decomposed", "baseline"], op
    finally:
        ok.reset_overlap_stats()


def test_a_peer_memory_world_says_why_float64_runs_symm():
    """float64 in a peer-memory world: the ops pass fused_fits=False for a dtype the fused GEMMs do
    not take, and the reason names the dtype, not the 32-bit offsets the chunks are within."""
    from overlapkernels.ops import dispatch

    try:
        choice = dispatch.choose("all_gather_matmul", "auto", world_size=2, rows_per_rank=8, step_bytes=512,
                                 step_flops=4096, device=torch.device("cpu"), peer_memory=True,
                                 dtype=torch.float64, fused_fits=False)
    finally:
        ok.reset_overlap_stats()
    assert choice.method == "symm" and "torch.float64: the fused GEMMs take float32/16-bit operands" in choice.reason


def test_reasons_stay_bounded_over_many_shapes():
    """Reasons name sizes: a long run of distinct shapes counts its later reasons under one entry."""
    from overlapkernels.ops import dispatch

    ok.reset_overlap_stats()
    for rows in range(dispatch.MAX_REASONS_PER_KEY + 50):
        dispatch.record("all_gather_matmul", dispatch.Choice("baseline", f"{rows} rows per rank"))
    dispatch.record("all_gather_matmul", dispatch.Choice("baseline", "0 rows per rank"))  # a known one still counts as itself
    stats = ok.overlap_stats(reset=True)
    by_reason = stats.reasons[("all_gather_matmul", "baseline")]
    assert stats[("all_gather_matmul", "baseline")] == dispatch.MAX_REASONS_PER_KEY + 51
    assert len(by_reason) == dispatch.MAX_REASONS_PER_KEY + 1 and by_reason[dispatch.OTHER_REASONS] == 50
    assert by_reason["0 rows per rank"] == 2 and sum(by_reason.values()) == dispatch.MAX_REASONS_PER_KEY + 51


def _mismatched_calls_on_rank():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: a rank calling with other shapes or options, or one whose own
    checks reject its call, is named on every rank before the op communicates (gloo would abort
    in the P2P ring, or the others would wait for the rejected rank); agreeing calls still run."""
    r = dist.get_rank()
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    errors = []
    try:
        b = torch.ones(8, 3)
        calls = [
            lambda: ok.all_gather_matmul(torch.ones(4 + (r == 1), 8), b, method="decomposed"),
            lambda: ok.all_gather_matmul(torch.ones(4, 8), b, method="decomposed" if r else "baseline"),
            lambda: ok.all_gather_matmul(torch.ones(4, 8, requires_grad=r == 1), b, save_gathered=r == 0),
            # backward reduce-scatters the gathered tensor's gradient on the ranks that returned it
            lambda: ok.all_gather_matmul(torch.ones(4, 8), b, return_gathered=r == 0, method="decomposed"),
            lambda: ok.matmul_reduce_scatter(torch.ones(4 + r, 8), b, method="decomposed"),  # 5 rows: rank 1 rejects
            lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), b, method="symm" if r else "decomposed"),
            lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), b, scatter_dim=0 if r else -2, method="decomposed"),
            # a layer's own wording of the op's check, still made where every rank hears of it
            lambda: RowParallelLinear(8, 4, dist.group.WORLD, sequence_parallel=True, method="decomposed")(
                torch.ones(4 + r, 1, 4)),
        ]
        for call in calls:
            try:
                call()
                errors.append(None)
            except (ValueError, TypeError) as exc:
                errors.append(str(exc))
        out = ok.all_gather_matmul(torch.ones(4, 8), b, method="decomposed")  # agreeing: runs
        assert torch.equal(out, torch.full((4 * dist.get_world_size(), 3), 8.0))
    finally:
        dist.set_debug_level(level)
    return errors


def _auto_modes_differ_on_rank():
    """OVERLAPKERNELS_AUTO set on one rank only: that rank would measure (timed collectives of every
    candidate) while the other ran its rules' method. Named under the debug check, before any."""
    r = dist.get_rank()
    level, saved = dist.get_debug_level(), os.environ.pop("OVERLAPKERNELS_AUTO", None)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    if r == 0:
        os.environ["OVERLAPKERNELS_AUTO"] = "measure"
    said = []
    try:
        for call in (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3)),
                     lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 3))):
            with pytest.raises(ValueError) as info:
                call()
            said.append(str(info.value))
        out = ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), method="baseline")  # not auto: runs
    finally:
        dist.set_debug_level(level)
        os.environ.pop("OVERLAPKERNELS_AUTO", None)
        if saved is not None:
            os.environ["OVERLAPKERNELS_AUTO"] = saved
    return said, torch.equal(out, torch.full((8, 3), 8.0))


def test_auto_modes_that_differ_between_ranks_are_named_under_distributed_debug(rank_pool):
    for said, ran in rank_pool(2).run(_auto_modes_differ_on_rank):
        assert ran
        for op, message in zip(("all_gather_matmul", "matmul_reduce_scatter"), said):
            assert message.startswith(f"{op}: the ranks of the group disagree on OVERLAPKERNELS_AUTO (rank 0: "
                                      "OVERLAPKERNELS_AUTO='measure'; rank 1: OVERLAPKERNELS_AUTO='rules')"), message


def test_ranks_that_disagree_are_named_under_distributed_debug(rank_pool):
    hint = "; every rank must make the same call (TORCH_DISTRIBUTED_DEBUG=DETAIL check)"
    errors = rank_pool(2).run(_mismatched_calls_on_rank)
    for shapes, method, grads, gathered, _, _, dims, _ in errors:
        assert ("disagree on return_gathered (rank 0: return_gathered=True; rank 1: return_gathered=False)"
                in gathered), gathered
        assert shapes == ("all_gather_matmul: the ranks of the group disagree on a_shard (rank 0: a_shard=[4, 8] "
                          "float32; rank 1: a_shard=[5, 8] float32)" + hint), shapes
        assert "disagree on method (rank 0: method='baseline'; rank 1: method='decomposed')" in method, method
        assert grads.startswith("all_gather_matmul: the ranks of the group disagree on a_shard, save_gathered (rank "
                                "0: a_shard=[4, 8] float32, save_gathered=True; rank 1: a_shard=[4, 8] float32 (gets "
                                "a gradient), save_gathered=False)"), grads
        assert dims is None  # scatter_dim -2 and 0 are the same dim of a 2-D a: no disagreement
    # the rank whose own check failed raises that error; the other is told which rank and why
    assert errors[1][4] == "a.shape[scatter_dim=0]=5 is not divisible by the group size 2"
    assert errors[0][4] == ("matmul_reduce_scatter: other ranks' arguments were rejected (rank 1: ValueError: "
                            "a.shape[scatter_dim=0]=5 is not divisible by the group size 2)" + hint)
    assert "needs CUDA" in errors[1][5] and errors[0][5].startswith(
        "matmul_reduce_scatter: other ranks' arguments were rejected (rank 1: ValueError: ")
    layer = "RowParallelLinear(sequence_parallel=True), which scatters x's dim 0 (the sequence of [S, B, H]) over the " \
            "tensor-parallel ranks: "
    assert errors[1][7] == layer + "x.shape[scatter_dim=0]=5 is not divisible by the group size 2"
    assert errors[0][7] == layer + ("linear_reduce_scatter: other ranks' arguments were rejected (rank 1: ValueError: "
                                    "x.shape[scatter_dim=0]=5 is not divisible by the group size 2)" + hint)


def _strict_only_around_backward_on_rank():
    """strict_overlap() around backward alone (forward ran outside it): backward's dual ops are calls
    made inside it, and are policed as any other. K = 1024: the forward matmul + reduce-scatter
    overlaps, its backward all-gather + GEMM (256 flop/B) would not."""
    a = torch.ones(128, 1024, dtype=torch.float64, requires_grad=True)
    out = ok.matmul_reduce_scatter(a, torch.ones(1024, 1024, dtype=torch.float64))
    try:
        with ok.strict_overlap():
            out.sum().backward()
    except ok.StrictOverlapError as exc:
        return str(exc)
    finally:
        ok.reset_overlap_stats()
    return None


def test_strict_overlap_around_backward_alone_polices_the_dual_ops(rank_pool):
    for said in rank_pool(2).run(_strict_only_around_backward_on_rank):
        assert said and said.startswith("all_gather_matmul: strict_overlap() is active"), said


def _no_grad_calls_under_distributed_debug_on_rank():
    """Under torch.no_grad() no gradient flows whatever the inputs' requires_grad: ranks whose shards
    differ only there make the same call (no backward will communicate) and are not refused."""
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        with torch.no_grad():
            out = ok.all_gather_matmul(torch.ones(4, 8, requires_grad=dist.get_rank() == 0), torch.ones(8, 3),
                                       method="decomposed")
    finally:
        dist.set_debug_level(level)
    return torch.equal(out, torch.full((4 * dist.get_world_size(), 3), 8.0))


def test_requires_grad_that_differs_under_no_grad_is_no_disagreement(rank_pool):
    assert rank_pool(2).run(_no_grad_calls_under_distributed_debug_on_rank) == [True, True]
