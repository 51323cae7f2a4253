"""Pipeline schedules (every kind valid, NCCL-safe P2P plans), the simulator against published
bubbles, and rendering. No ranks: the executor's tests are in test_pipeline.py."""
import sys

import pytest

from overlapkernels.runtime import pipeline as pp
from overlapkernels.runtime.pipeline import p2p
from nccl_like import replay_like_nccl


def _cases():
    for p in (2, 3, 4):
        for m in (1, p, 2 * p - 1, 2 * p, 3 * p + 1):
            for kind in pp.KINDS:
                for v in {"interleaved-1f1b": (1, 2, 3), "zb-v": (1, 2)}.get(kind, (1,)):
                    if kind == "interleaved-1f1b" and m % p:
                        continue
                    yield kind, p, m, v


@pytest.mark.parametrize("kind, p, m, v", list(_cases()))
def test_every_schedule_is_valid(kind, p, m, v):
    sched = pp.make_schedule(kind, p, m, num_virtual=v)
    pp.validate(sched)
    ops = {"F"} | ({"B", "W"} if kind in ("zb-h1", "zb-v") else {"BW"})
    assert {a.op for acts in sched.actions for a in acts} == ops
    assert sched.num_virtual == (2 if kind == "zb-v" else v)
    assert sum(len(a) for a in sched.actions) == p * sched.num_virtual * m * len(ops)
    for rank in range(p):  # each rank runs its own chunks' stages, and stage_of / rank_of agree
        mine = {sched.stage_of(rank, c) for c in range(sched.num_virtual)}
        assert {a.stage for a in sched.actions[rank]} == mine
        assert all(sched.rank_of(s) == rank for s in mine)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 7), (3, 6), (4, 4), (4, 13)])
def test_simulator_reproduces_published_bubbles(p, m):
    for kind in ("gpipe", "1f1b"):
        res = pp.simulate(pp.make_schedule(kind, p, m), t_f=1.0, t_b=1.0)
        assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert res.peak_activations == ([m] * p if kind == "gpipe" else [p - r for r in range(p)])
        assert res.peak_held == res.peak_activations  # (no W: B frees everything)
    one_f_one_b = pp.simulate(pp.make_schedule("1f1b", p, m), t_f=1.0, t_b=2.0)  # BW = B + W
    zb = pp.simulate(pp.make_schedule("zb-h1", p, m), t_f=1.0, t_b=1.0, t_w=1.0)
    idle = lambda r: r.makespan * p - sum(r.busy)  # noqa: E731
    assert idle(zb) == pytest.approx(idle(one_f_one_b) / 3)  # ZB-H1: a third of 1F1B's bubble
    assert zb.peak_activations == one_f_one_b.peak_activations
    # what W still reads stays bounded by 1F1B's peak, p, on every rank (was m: every W at the end)
    assert zb.peak_held == [min(p, m)] * p
    if m % p == 0:
        for v in (1, 2, 3):
            res = pp.simulate(pp.make_schedule("interleaved-1f1b", p, m, num_virtual=v))
            assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_actions_are_named_tuples_as_torchs():
    """torch.distributed.pipelining's _Action is a NamedTuple: code written against it unpacks
    actions and compares them with tuples (a frozen dataclass refused both)."""
    first = pp.make_schedule("1f1b", 2, 2).actions[0][0]
    op, stage, microbatch = first
    assert (op, stage, microbatch) == ("F", 0, 0) == first and str(first) == "F0.0"
    assert first == pp.Action(op="F", stage=0, microbatch=0) and first._replace(op="B") == ("B", 0, 0)


def test_interleaved_with_one_chunk_per_rank_is_1f1b():
    """Megatron's interleaved warm-up at v=1 held 2p - 1 microbatches on rank 0, 1F1B's p (same bubble)."""
    for p, m in ((2, 4), (4, 8), (3, 9)):
        got, want = pp.make_schedule("interleaved-1f1b", p, m), pp.make_schedule("1f1b", p, m)
        assert [[str(a) for a in acts] for acts in got.actions] == [[str(a) for a in acts] for acts in want.actions]
        assert pp.simulate(got).peak_activations == [p - r for r in range(p)]


@pytest.mark.parametrize("p, v, m", [(2, 2, 2), (2, 2, 4), (4, 2, 8), (4, 3, 8)])
def test_interleaved_peak_activations_are_megatrons_warmup_plus_one(p, v, m):
    """Megatron's interleaved 1F1B runs (p - r - 1) * 2 + (v - 1) * p warm-up forwards (of model
    chunks) on rank r, then one more before its first backward."""
    res = pp.simulate(pp.make_schedule("interleaved-1f1b", p, m, num_virtual=v))
    assert res.peak_activations == [min(m * v, (p - r - 1) * 2 + (v - 1) * p + 1) for r in range(p)]


def test_batches_mixing_sends_and_receives_follow_megatrons_parity_rule():
    """Even ranks list their sends first, odd ranks their receives (so two neighbours never both
    wait to send first on a backend that posts a batch in order)."""
    mixed = [0, 0]
    for kind, v in (("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)):
        for rank, points in enumerate(p2p.comm_plan(pp.make_schedule(kind, 4, 8, num_virtual=v))):
            for batch in (b for point in points for b in point):
                sends = [m.send for m in batch]
                if len(set(sends)) == 2:
                    mixed[rank % 2] += 1
                    assert sends == sorted(sends, reverse=rank % 2 == 0), (kind, rank, [str(m) for m in batch])
    assert all(mixed), mixed


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_an_unsplit_backward_costs_b_plus_w(kind):
    """BW computes the input and the weight gradients: t_b + t_w, as a split schedule pays in B and W."""
    sched = pp.make_schedule(kind, 4, 8)
    split_costs = pp.simulate(sched, t_f=1.0, t_b=1.0, t_w=1.0)
    one_cost = pp.simulate(sched, t_f=1.0, t_b=2.0)
    assert (split_costs.makespan, split_costs.busy) == (one_cost.makespan, one_cost.busy)
    assert split_costs.busy == [8 * 3.0] * 4


def test_comm_time_and_busy():
    # rank 0: F0 0-1, F1 1-2; rank 1 (each activation 0.5 later): F0 1.5-2.5, F1 2.5-3.5, B0 3.5-5.5,
    # B1 5.5-7.5; rank 0 (each gradient 0.5 later): B0 6-8, B1 8-10. Without comm time: 9.
    res = pp.simulate(pp.make_schedule("gpipe", 2, 2), t_f=1.0, t_b=2.0, t_comm=0.5)
    assert res.busy == [6.0, 6.0]
    assert res.makespan == 10.0
    assert pp.simulate(pp.make_schedule("gpipe", 2, 2), t_f=1.0, t_b=2.0, t_comm=0.0).makespan == 9.0
    # a dependency on the same rank costs no comm time: F0 0-1 | F1 1.5-2.5, B1 2.5-3.5 | B0 4-5
    assert pp.simulate(pp.make_schedule("1f1b", 2, 1), t_f=1.0, t_b=1.0, t_comm=0.5).makespan == 5.0
    # the step ends when its last rank does, not rank 0: under ZB-H1 with comm time, rank 2's last
    # W (35) ends after rank 0's (34); the bubble is over that makespan, 1 - 3 x 30 / (3 x 35)
    zb = pp.simulate(pp.make_schedule("zb-h1", 3, 6), t_f=1.0, t_b=1.0, t_w=3.0, t_comm=0.5)
    assert [tl[-1][1] for tl in zb.timeline] == [34.0, 34.5, 35.0] and zb.makespan == 35.0
    assert zb.bubble_fraction == pytest.approx(1 / 7)


def test_deadlock_and_broken_schedules_are_named():
    sched = pp.make_schedule("1f1b", 2, 2)
    sched.actions[1] = [sched.actions[1][1], sched.actions[1][0]] + sched.actions[1][2:]  # BW before its F
    with pytest.raises(pp.ScheduleError, match=r"^deadlock: BW1.0 needs F1.0, which rank 1 queues after it; "
                                                r"next on each rank: BW0.0, BW1.0$"):
        pp.validate(sched)
    A = pp.Action  # a loop across ranks: BW0.0 waits for BW1.0, queued behind F1.1, which waits for F0.1
    sched.actions = [[A("F", 0, 0), A("BW", 0, 0), A("F", 0, 1), A("BW", 0, 1)],
                     [A("F", 1, 0), A("F", 1, 1), A("BW", 1, 0), A("BW", 1, 1)]]
    with pytest.raises(pp.ScheduleError, match=r"^deadlock: BW0.0 needs BW1.0, which rank 1 queues after F1.1 "):
        pp.validate(sched)
    sched = pp.make_schedule("zb-h1", 2, 2)  # a W (weight gradient) before the B it needs
    # (rank 1 runs its first W last: the cool-down bubble it fills)
    assert [str(a) for a in sched.actions[1]] == ["F1.0", "B1.0", "F1.1", "B1.1", "W1.1", "W1.0"]
    sched.actions[1][1], sched.actions[1][5] = sched.actions[1][5], sched.actions[1][1]
    with pytest.raises(pp.ScheduleError, match=r"^deadlock: W1.0 needs B1.0, which rank 1 queues after it; "):
        pp.validate(sched)
    sched = pp.make_schedule("zb-h1", 2, 2)  # a B whose W is missing: its weight gradients would be lost
    sched.actions[1].pop()
    with pytest.raises(pp.ScheduleError, match=r"^stage 1 microbatch 0: B and W must both appear$"):
        pp.validate(sched)
    sched = pp.make_schedule("gpipe", 2, 2)
    sched.actions[0].pop()
    with pytest.raises(pp.ScheduleError, match=r"expected either BW or both B and W"):
        pp.validate(sched)
    with pytest.raises(pp.ScheduleError, match=r"expected either BW or both B and W"):
        pp.simulate(sched)  # no makespan for a schedule that skips a backward
    sched = pp.make_schedule("gpipe", 2, 2)
    sched.actions[0][0] = pp.Action("F", 1, 0)
    with pytest.raises(pp.ScheduleError, match=r"rank 0: F1.0 belongs to rank 1"):
        pp.validate(sched)
    # malformed action lists, refused before anything runs (validate and simulate check alike)
    for broken, message in [
        (lambda acts: acts.pop(), r"^1 action lists for 2 ranks$"),
        (lambda acts: acts[1].insert(0, A("X", 1, 0)), r"^rank 1: X1.0 has unknown op 'X'$"),
        (lambda acts: acts[0].append(A("F", 2, 0)), r"^rank 0: F2.0 is outside 2 stages x 2 microbatches$"),
        (lambda acts: acts[0].append(A("F", -2, 0)), r"^rank 0: F-2.0 is outside 2 stages x 2 microbatches$"),
        (lambda acts: acts[1].append(A("BW", 1, 2)), r"^rank 1: BW1.2 is outside 2 stages x 2 microbatches$"),
        (lambda acts: acts[0].append(A("F", 0, 1)), r"^rank 0: F0.1 appears twice$"),
        (lambda acts: acts[0].append(("F", 0, 1)), r"^rank 0: \('F', 0, 1\) is a tuple, not an Action\(op, stage, "
                                                    r"microbatch\)$"),
    ]:
        for check in (pp.validate, pp.simulate):
            sched = pp.make_schedule("gpipe", 2, 2)
            broken(sched.actions)
            with pytest.raises(pp.ScheduleError, match=message):
                check(sched)


def test_bad_arguments_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"kind='dualpipe': expected one of"):
        pp.make_schedule("dualpipe", 2, 4)
    with pytest.raises(ValueError, match=r"multiple of num_stages=4 \(allowed: 4, 8, 12, ...\); got 6"):
        pp.make_schedule("interleaved-1f1b", 4, 6, num_virtual=2)
    with pytest.raises(ValueError, match=r"num_virtual=2 needs kind='interleaved-1f1b'"):
        pp.make_schedule("1f1b", 2, 4, num_virtual=2)
    with pytest.raises(ValueError, match=r"num_microbatches=0"):
        pp.make_schedule("gpipe", 2, 0)
    with pytest.raises(ValueError, match=r"num_microbatches=True: expected an integer >= 1"):
        pp.make_schedule("1f1b", 2, True)  # a bool is not a count, though Python calls it an int
    numpy = pytest.importorskip("numpy")  # a numpy count is one (was refused as "not an integer")
    sched = pp.make_schedule("1f1b", numpy.int64(2), numpy.int64(3))
    assert (sched.num_ranks, sched.num_microbatches) == (2, 3) and type(sched.num_microbatches) is int
    # not a schedule: a TypeError naming what was expected (was an AttributeError from inside)
    for call in (lambda: pp.simulate("1f1b"), lambda: pp.validate(None)):
        with pytest.raises(TypeError, match=r"^schedule=(str|NoneType): expected a Schedule \(make_schedule"):
            call()
    with pytest.raises(TypeError, match=r"^render: expected a Schedule or a SimResult \(simulate's\), got NoneType$"):
        pp.render(None)
    with pytest.raises(TypeError, match=r"^path=5: expected a file path"):
        pp.render(pp.make_schedule("1f1b", 2, 2), path=5)


def test_render_text():
    text = pp.render(pp.make_schedule("zb-h1", 3, 4))
    assert text.splitlines()[0].startswith("zb-h1: 3 ranks, 4 microbatches") and "rank 2:" in text
    assert "W0.0" in text


def test_render_keeps_long_labels_whole_and_skips_actions_that_take_no_time():
    """Cells were 5 characters: BW0.10 and BW0.11 both printed as BW0.1, microbatch 1's label; and
    W actions of zero length (simulate's default t_w=0) were drawn over their neighbours."""
    rows = pp.render(pp.make_schedule("1f1b", 2, 12)).splitlines()[1:]
    labels = [label.strip(".") for row in rows for label in row.split(": ")[1].split()]
    assert sorted(filter(None, labels)) == sorted(f"{op}{s}.{m}" for op in ("F", "BW") for s in (0, 1)
                                                  for m in range(12))
    zero_w = pp.render(pp.simulate(pp.make_schedule("zb-h1", 2, 3)))
    assert "W" not in zero_w.replace("BW", "").split("\n", 1)[1]
    assert [row.count("B") for row in zero_w.splitlines()[1:]] == [3, 3]


def test_render_draws_every_action_when_times_fall_between_the_shortest_ops():
    """Cells were the shortest op long: with t_comm = 0.5 actions start on half units, and
    rounding put two in one cell, the later overwriting the earlier (F1.0 was missing)."""
    res = pp.simulate(pp.make_schedule("1f1b", 2, 3), t_f=1, t_b=2, t_comm=0.5)
    rows = pp.render(res).splitlines()[1:]
    for r, tl in enumerate(res.timeline):
        drawn = {label.strip(".") for label in rows[r].split(": ")[1].split()}
        assert {str(a) for _, _, a in tl} <= drawn, (r, rows[r])


def test_p2p_plan_names_a_shape_by_the_senders_first_forward():
    """Stages may run their forwards in different orders; the shape message travels with the
    sender's first activation, and the receiver expects it under that name."""
    a = pp.Action
    sched = pp.make_schedule("gpipe", 2, 2)
    sched.actions = [[a("F", 0, 1), a("F", 0, 0), a("BW", 0, 0), a("BW", 0, 1)],
                     [a("F", 1, 0), a("F", 1, 1), a("BW", 1, 0), a("BW", 1, 1)]]
    pp.validate(sched)
    plan = p2p.comm_plan(sched)
    p2p.check_comm_plan(sched, plan)
    replay_like_nccl(_as_log(plan))
    shapes = [m for points in plan for point in points for batch in point for m in batch if m.what == "shape"]
    assert [(m.send, m.microbatch) for m in shapes] == [(True, 1), (False, 1)]


@pytest.mark.parametrize("cost", ["t_f", "t_b", "t_w", "t_comm"])
@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), True, "1"])
def test_simulate_refuses_costs_that_are_not_finite_times(cost, value):
    """t_f=-1 gave a bubble of 100% with no busy time, a NaN cost a NaN makespan."""
    with pytest.raises(ValueError, match=rf"^{cost}={value!r}: expected a finite time >= 0$".replace("(", r"\(")):
        pp.simulate(pp.make_schedule("1f1b", 2, 2), **{cost: value})


def _png_width(path) -> int:
    with open(path, "rb") as f:
        head = f.read(24)
    assert head[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(head[16:20], "big")


def test_render_png(tmp_path):
    """Its width follows the timeline's cells, not the times' unit: measured times in ms made a
    PNG 198000 pixels wide, in us matplotlib refused to draw it ("image too large")."""
    pytest.importorskip("matplotlib")  # the [bench] extra; without it render draws no PNG
    pp.render(pp.make_schedule("zb-h1", 3, 4), str(tmp_path / "zb.png"))
    assert (tmp_path / "zb.png").stat().st_size > 0
    pp.render(pp.make_schedule("1f1b", 2, 2), str(tmp_path / "b.png").encode())  # a bytes path: a file, not a stream
    assert _png_width(tmp_path / "b.png") > 0
    widths = []
    for scale in (1, 1e3, 1e6):  # seconds, milliseconds, microseconds
        res = pp.simulate(pp.make_schedule("1f1b", 4, 8), t_f=0.12 * scale, t_b=0.24 * scale)
        pp.render(res, tmp_path / f"ms{scale:g}.png")
        widths.append(_png_width(tmp_path / f"ms{scale:g}.png"))
    assert widths[0] == widths[1] == widths[2] < 10_000, widths


def test_render_without_matplotlib_says_no_png_was_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.warns(UserWarning, match="no PNG written to .*needs matplotlib"):
        text = pp.render(pp.make_schedule("gpipe", 2, 2), str(tmp_path / "g.png"))
    assert text.startswith("gpipe: 2 ranks") and not (tmp_path / "g.png").exists()


def _unbatched_plan(sched):
    """The order of the old runner (the audit's finding): one isend or irecv at a time, receives
    just before their action, sends just after it."""
    plan = []
    for rank, actions in enumerate(sched.actions):
        announced, pending, points = set(), [], []
        for a in actions:
            recvs, sends = p2p._traffic(sched, rank, a, announced)
            points.append([(msg,) for msg in pending + recvs])
            pending = sends
        plan.append(points + [[(msg,) for msg in pending]])
    return plan


def _as_log(plan):
    return [[[(m.send, m.peer, m.what, m.boundary, m.microbatch, ()) for m in batch] for point in points
             for batch in point] for points in plan]


@pytest.mark.parametrize("kind, p, m, v", list(_cases()))
def test_p2p_plan_keeps_nccl_rules(kind, p, m, v):
    sched = pp.make_schedule(kind, p, m, num_virtual=v)
    plan = p2p.comm_plan(sched)
    p2p.check_comm_plan(sched, plan)
    replay_like_nccl(_as_log(plan))
    assert all(len(point) == len(acts) + 1 for point, acts in zip(plan, sched.actions))


def test_p2p_checks_catch_crossed_and_mismatched_orders():
    sched = pp.make_schedule("1f1b", 2, 2)  # the audit's case: act 1 and grad 0 cross
    with pytest.raises(pp.ScheduleError, match=r"P2P deadlock: rank 0's batch before BW0.0 waits to 'send to "
                                               r"rank 1: activation 0->1 microbatch 1', which rank 1 posts only in its "
                                               r"batch before F1.1"):
        p2p.check_comm_plan(sched, _unbatched_plan(sched))
    with pytest.raises(AssertionError, match="deadlock"):
        replay_like_nccl(_as_log(_unbatched_plan(sched)))
    # Megatron's 1F1B rule (one action's sends with the next one's receives) on interleaved: two
    # ranks each send a gradient the other receives only after its next forward
    sched = pp.make_schedule("interleaved-1f1b", 2, 4, num_virtual=2)
    per_action = []
    for rank, actions in enumerate(sched.actions):
        announced, pending, points = set(), [], []
        for a in actions:
            recvs, sends = p2p._traffic(sched, rank, a, announced)
            shape = [msg for msg in recvs if msg.what == "shape"]  # sizes the activation: a batch earlier
            batches = [pending + shape, [msg for msg in recvs if msg.what != "shape"]] if shape else [pending + recvs]
            points.append([tuple(b) for b in batches if b])
            pending = sends
        per_action.append(points + [[tuple(pending)] if pending else []])
    with pytest.raises(pp.ScheduleError, match="P2P deadlock"):
        p2p.check_comm_plan(sched, per_action)
    with pytest.raises(AssertionError, match="deadlock"):
        replay_like_nccl(_as_log(per_action))
    # receives posted out of the sends' order: NCCL would hand rank 1 microbatch 1 as microbatch 0
    # (a schedule whose stages order their forwards differently is fine: the plan posts in the
    # order messages are made, test_p2p_plan_names_a_shape_by_the_senders_first_forward)
    sched = pp.make_schedule("gpipe", 2, 2)
    plan = p2p.comm_plan(sched)
    plan[1][0][1], plan[1][1][0] = plan[1][1][0], plan[1][0][1]  # rank 1: activation 1's receive before 0's
    with pytest.raises(pp.ScheduleError, match=r"P2P mismatch: message #1 from rank 0 to rank 1 is activation 0->1 "
                                               r"microbatch 0, but rank 1 posts 'receive from rank 0: activation "
                                               r"0->1 microbatch 1' for it"):
        p2p.check_comm_plan(sched, plan)
    with pytest.raises(AssertionError, match="rank 0 -> rank 1"):
        replay_like_nccl(_as_log(plan))


@pytest.mark.parametrize("kind", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("p, m", [(4, 1), (4, 3), (3, 2)])
def test_fewer_microbatches_than_stages(kind, p, m):
    """m < p: the warm-up is cut at m forwards (p - r - 1 of them named microbatches that do not exist)."""
    sched = pp.make_schedule(kind, p, m)
    pp.validate(sched)
    assert all(a.microbatch < m for acts in sched.actions for a in acts)
    p2p.check_comm_plan(sched, p2p.comm_plan(sched))
    want = [m] * p if kind == "gpipe" else [min(m, p - r) for r in range(p)]
    assert pp.simulate(sched, t_w=1.0 if kind == "zb-h1" else 0.0).peak_activations == want


def test_schedules_run_their_microbatches_in_the_published_order():
    """Every order is pinned (a reordered one can be as valid, with the same bubble): GPipe's and
    1F1B's backwards in microbatch order, as torch's; ZB-H1's deferred W's in microbatch order."""
    def order(kind, p, m, v=1):
        return [" ".join(map(str, acts)) for acts in pp.make_schedule(kind, p, m, num_virtual=v).actions]

    assert order("gpipe", 2, 3) == ["F0.0 F0.1 F0.2 BW0.0 BW0.1 BW0.2", "F1.0 F1.1 F1.2 BW1.0 BW1.1 BW1.2"]
    assert order("1f1b", 3, 4) == ["F0.0 F0.1 F0.2 BW0.0 F0.3 BW0.1 BW0.2 BW0.3",
                                   "F1.0 F1.1 BW1.0 F1.2 BW1.1 F1.3 BW1.2 BW1.3",
                                   "F2.0 BW2.0 F2.1 BW2.1 F2.2 BW2.2 F2.3 BW2.3"]
    assert order("zb-h1", 3, 4) == ["F0.0 F0.1 F0.2 B0.0 W0.0 F0.3 B0.1 W0.1 B0.2 W0.2 B0.3 W0.3",
                                    "F1.0 F1.1 B1.0 F1.2 B1.1 W1.1 F1.3 B1.2 W1.2 B1.3 W1.3 W1.0",
                                    "F2.0 B2.0 F2.1 B2.1 F2.2 B2.2 W2.2 F2.3 B2.3 W2.3 W2.0 W2.1"]
    assert order("interleaved-1f1b", 2, 4, 2) == [
        "F0.0 F0.1 F2.0 F2.1 F0.2 BW2.0 F0.3 BW2.1 F2.2 BW0.0 F2.3 BW0.1 BW2.2 BW2.3 BW0.2 BW0.3",
        "F1.0 F1.1 F3.0 BW3.0 F3.1 BW3.1 F1.2 BW1.0 F1.3 BW1.1 F3.2 BW3.2 F3.3 BW3.3 BW1.2 BW1.3"]


def test_p2p_check_names_a_message_no_one_receives():
    """A send without its receive (or a receive without its send) is a mismatch, named as such."""
    sched = pp.make_schedule("gpipe", 2, 2)
    plan = p2p.comm_plan(sched)
    dropped = [(k, i) for k, point in enumerate(plan[1]) for i, batch in enumerate(point)
               if any(m.what == "activation" and m.microbatch == 1 for m in batch)]
    assert len(dropped) == 1 and len(plan[1][dropped[0][0]][dropped[0][1]]) == 1
    del plan[1][dropped[0][0]][dropped[0][1]]
    with pytest.raises(pp.ScheduleError, match=r"^P2P mismatch: message #2 from rank 0 to rank 1 is activation 0->1 "
                                               r"microbatch 1, but rank 1 posts 'nothing' for it"):
        p2p.check_comm_plan(sched, plan)


def test_render_header_names_the_schedule_and_its_figures():
    assert pp.render(pp.make_schedule("zb-h1", 3, 4)).splitlines()[0] == (
        "zb-h1: 3 ranks, 4 microbatches; makespan 14, bubble 14.3%, peak activations [3, 2, 1]")
    assert pp.render(pp.make_schedule("interleaved-1f1b", 2, 4, num_virtual=2)).splitlines()[0] == (
        "interleaved-1f1b: 2 ranks, 4 microbatches, 2 virtual; makespan 18, bubble 11.1%, peak activations [5, 3]")


def test_render_coarsens_a_grid_too_fine_to_print():
    """A tiny comm time next to whole-unit ops made cells 1e-5 long: rows of millions of characters."""
    max_cols = sys.modules["overlapkernels.runtime.pipeline.render"]._MAX_COLS
    res = pp.simulate(pp.make_schedule("1f1b", 2, 2), t_f=1.0, t_b=1.0, t_comm=1e-5)
    rows = pp.render(res).splitlines()[1:]
    assert len(rows) == 2 and all(len(row) <= len("rank 0: ") + 6 * max_cols for row in rows)
