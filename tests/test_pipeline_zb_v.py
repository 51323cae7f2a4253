"""ZB-V (Qi et al. 2024): two chunks per rank in a V - its placement, validity and NCCL-safe plans at
every size, and the simulator's figures against ZB-H1 and 1F1B. The executor running it:
test_pipeline.py; the Trainer: test_train_options.py."""
import pytest

from overlapkernels.runtime import pipeline as pp
from overlapkernels.runtime.pipeline import p2p


@pytest.mark.parametrize("p", [1, 2, 3, 4, 5])
def test_zb_v_is_as_short_as_a_pipeline_can_be_with_1f1bs_memory(p):
    """ZB-V at t_f = t_b = t_w (of a chunk, half a stage) and m >= 2p - 1: rank r busy without a gap
    for 6m from its start after r forwards, so the makespan is 6m + p - 1 (rank p - 1 cannot start
    before p - 1 forwards); 2p half-stage activations on every rank, 1F1B's p stages' on its rank 0; and half
    ZB-H1's bubble time, a sixth of 1F1B's, on the same model (a whole stage costing 2 per op)."""
    sched = pp.make_schedule("zb-v", p, 1)
    assert [sched.stage_of(r, c) for r in range(p) for c in (0, 1)] == [s for r in range(p) for s in (r, 2 * p - 1 - r)]
    assert sched.rank_of(0) == sched.rank_of(2 * p - 1) == 0  # the first and the last stage on rank 0
    for m in (2 * p - 1, 2 * p, 3 * p + 1, 4 * p):
        zbv = pp.simulate(pp.make_schedule("zb-v", p, m), t_f=1.0, t_b=1.0, t_w=1.0)
        assert zbv.makespan == 6 * m + p - 1
        assert [tl[0][0] for tl in zbv.timeline] == list(range(p))  # (rank r starts after r forwards)
        assert zbv.busy == [6.0 * m] * p and zbv.peak_activations == zbv.peak_held == [2 * p] * p
        full = dict(t_f=2.0, t_b=2.0, t_w=2.0)
        zbh1, one_f_one_b = pp.simulate(pp.make_schedule("zb-h1", p, m), **full), pp.simulate(
            pp.make_schedule("1f1b", p, m), t_f=2.0, t_b=4.0)
        idle = lambda r: r.makespan - r.busy[0]  # noqa: E731 (rank 0's)
        assert idle(zbv) == pytest.approx(idle(zbh1) / 2) == pytest.approx(idle(one_f_one_b) / 6)
        assert one_f_one_b.peak_activations[0] * 2 == zbv.peak_activations[0]
    # fewer microbatches than the V needs: still valid, with no more activations than that
    for m in range(1, 2 * p - 1):
        res = pp.simulate(pp.make_schedule("zb-v", p, m), t_f=1.0, t_b=1.0, t_w=1.0)
        assert max(res.peak_activations) <= 2 * m and res.makespan >= 6 * m + p - 1


def test_zb_v_takes_two_chunks_per_rank_only():
    assert pp.make_schedule("zb-v", 2, 4, num_virtual=2).actions == pp.make_schedule("zb-v", 2, 4).actions
    with pytest.raises(ValueError, match=r"num_virtual=3: zb-v runs exactly 2 chunks per rank"):
        pp.make_schedule("zb-v", 2, 4, num_virtual=3)


def test_zb_v_is_valid_and_keeps_nccls_rules_for_every_size():
    """Every pipeline of 1..8 ranks and 1..20 microbatches: a complete, deadlock-free schedule
    whose P2P plan pairs and completes under NCCL's rules (the runner refuses it otherwise)."""
    for p in range(1, 9):
        for m in range(1, 21):
            sched = pp.make_schedule("zb-v", p, m)
            pp.validate(sched)
            p2p.check_comm_plan(sched, p2p.comm_plan(sched))


@pytest.mark.parametrize("t_f, t_b, t_w", [(1.0, 2.0, 1.0), (1.0, 1.0, 0.0), (2.0, 3.0, 1.0), (1.0, 1.5, 0.5)])
def test_zb_v_makespan_at_unequal_costs(t_f, t_b, t_w):
    """Beyond t_f = t_b = t_w (where the order of the cool-down's B's and W's makes no difference to
    the makespan): 2m chunks' work per rank plus (p - 1)(t_f + max(0, t_b - t_w)) - what this order
    gives (a regression guard, not a proof of the least), half ZB-H1's bubble time on the same model
    (a whole stage costing twice a chunk) here too. A cool-down that runs the up chunk's B first, or
    its W's last, is slower and is caught here."""
    for p in range(1, 6):
        for m in (2 * p - 1, 2 * p, 3 * p + 1):
            zbv = pp.simulate(pp.make_schedule("zb-v", p, m), t_f=t_f, t_b=t_b, t_w=t_w)
            assert zbv.makespan == pytest.approx(2 * m * (t_f + t_b + t_w) + (p - 1) * (t_f + max(0.0, t_b - t_w))), (p, m)
            zbh1 = pp.simulate(pp.make_schedule("zb-h1", p, m), t_f=2 * t_f, t_b=2 * t_b, t_w=2 * t_w)
            assert zbv.makespan - zbv.busy[0] == pytest.approx((zbh1.makespan - zbh1.busy[0]) / 2), (p, m)


def test_stage_and_rank_maps_refuse_what_is_not_there():
    """Out of range they answered quietly: under zb-v stage_of(r, 5) gave r's second stage, rank_of(2p) -1."""
    for kind, v in (("zb-v", 2), ("interleaved-1f1b", 2), ("1f1b", 1)):
        sched = pp.make_schedule(kind, 3, 6, num_virtual=v)
        for call, name, bad, count in ((lambda x: sched.stage_of(0, x), "chunk", v, v),
                                       (lambda x: sched.stage_of(x, 0), "rank", 3, 3),
                                       (lambda x: sched.rank_of(x), "stage", 3 * v, 3 * v),
                                       (lambda x: sched.rank_of(x), "stage", -1, 3 * v),
                                       (lambda x: sched.rank_of(x), "stage", True, 3 * v)):
            with pytest.raises(ValueError, match=rf"^{name}={bad!r}: expected an integer from 0 to {count - 1}$"):
                call(bad)
