"""Pipeline schedules, simulator and executor."""
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from overlapkernels.comm.rank_pool import RankError, RankPool
from overlapkernels.runtime import pipeline as pp


def _cases():
    for p in (2, 3, 4):
        for m in (p, 2 * p, 3 * p + 1):
            for kind in pp.KINDS:
                for v in ((1, 2) if kind == "interleaved-1f1b" else (1,)):
                    if kind == "interleaved-1f1b" and m % p:
                        continue
                    yield kind, p, m, v


@pytest.mark.parametrize("kind, p, m, v", list(_cases()))
def test_every_schedule_is_valid(kind, p, m, v):
    sched = pp.make_schedule(kind, p, m, num_virtual=v)
    pp.validate(sched)
    ops = {"F"} | ({"B", "W"} if kind == "zb-h1" else {"BW"})
    assert {a.op for acts in sched.actions for a in acts} == ops
    assert sum(len(a) for a in sched.actions) == p * v * m * len(ops)


@pytest.mark.parametrize("p, m", [(2, 2), (2, 7), (3, 6), (4, 4), (4, 13)])
def test_simulator_reproduces_published_bubbles(p, m):
    for kind in ("gpipe", "1f1b"):
        res = pp.simulate(pp.make_schedule(kind, p, m), t_f=1.0, t_b=1.0)
        assert res.bubble_fraction == pytest.approx((p - 1) / (m + p - 1))
        assert res.peak_activations == ([m] * p if kind == "gpipe" else [p - r for r in range(p)])
    one_f_one_b = pp.simulate(pp.make_schedule("1f1b", p, m), t_f=1.0, t_b=2.0)  # BW = B + W
    zb = pp.simulate(pp.make_schedule("zb-h1", p, m), t_f=1.0, t_b=1.0, t_w=1.0)
    idle = lambda r: r.makespan * p - sum(r.busy)  # noqa: E731
    assert idle(zb) == pytest.approx(idle(one_f_one_b) / 3)  # ZB-H1: a third of 1F1B's bubble
    assert zb.peak_activations == one_f_one_b.peak_activations
    if m % p == 0:
        for v in (1, 2):
            res = pp.simulate(pp.make_schedule("interleaved-1f1b", p, m, num_virtual=v))
            assert res.bubble_fraction == pytest.approx((p - 1) / (v * m + p - 1))


def test_comm_time_and_busy():
    res = pp.simulate(pp.make_schedule("gpipe", 2, 2), t_f=1.0, t_b=2.0, t_comm=0.5)
    assert res.busy == [6.0, 6.0]
    assert res.makespan == pytest.approx(1 + 0.5 + 1 + 1 + 2 + 0.5 + 2 + 2 - 1 + 0.0) or res.makespan > 6


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
    sched = pp.make_schedule("gpipe", 2, 2)
    sched.actions[0].pop()
    with pytest.raises(pp.ScheduleError, match=r"expected either BW or both B and W"):
        pp.validate(sched)
    sched = pp.make_schedule("gpipe", 2, 2)
    sched.actions[0][0] = pp.Action("F", 1, 0)
    with pytest.raises(pp.ScheduleError, match=r"rank 0: F1.0 belongs to rank 1"):
        pp.validate(sched)


def test_bad_arguments_name_the_allowed_values():
    with pytest.raises(ValueError, match=r"kind='dualpipe': expected one of"):
        pp.make_schedule("dualpipe", 2, 4)
    with pytest.raises(ValueError, match=r"multiple of num_stages=4 \(allowed: 4, 8, 12, ...\); got 6"):
        pp.make_schedule("interleaved-1f1b", 4, 6, num_virtual=2)
    with pytest.raises(ValueError, match=r"num_virtual=2 needs kind='interleaved-1f1b'"):
        pp.make_schedule("1f1b", 2, 4, num_virtual=2)
    with pytest.raises(ValueError, match=r"num_microbatches=0"):
        pp.make_schedule("gpipe", 2, 0)


def test_render_text_and_png(tmp_path):
    text = pp.render(pp.make_schedule("zb-h1", 3, 4), str(tmp_path / "zb.png"))
    assert text.splitlines()[0].startswith("zb-h1: 3 ranks, 4 microbatches") and "rank 2:" in text
    assert "W0.0" in text and (tmp_path / "zb.png").exists()


# ---------------------------------------------------------------------------------- executor
WIDTH = 5


def _model(num_stages, layers_per_stage=2):
    torch.manual_seed(0)
    layers = []
    for _ in range(num_stages * layers_per_stage):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).double()


def _stage(model, stage, layers_per_stage=2):
    per = 2 * layers_per_stage
    return model[stage * per:(stage + 1) * per]


def _executor_on_rank(kind, m, v):
    p, rank = dist.get_world_size(), dist.get_rank()
    sched = pp.make_schedule(kind, p, m, num_virtual=v)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(2 * m, WIDTH, generator=g, dtype=torch.float64), torch.randn(2 * m, WIDTH, generator=g,
                                                                                      dtype=torch.float64)
    ref = _model(p * v)
    F.mse_loss(ref(x), y).backward()
    model = _model(p * v)
    if kind == "zb-h1":
        pp.enable_zero_bubble(model)
    stages = [_stage(model, c * p + rank) for c in range(v)]
    runner = pp.PipelineRunner(stages if v > 1 else stages[0], schedule=sched, loss_fn=F.mse_loss)
    loss = runner.step(x if rank == 0 else None, y if sched.rank_of(sched.num_stages - 1) == rank else None)
    if loss is not None:
        torch.testing.assert_close(loss, F.mse_loss(ref(x), y), atol=1e-12, rtol=1e-12)
    for c in range(v):
        s = c * p + rank
        for (name, got), want in zip(_stage(model, s).named_parameters(), _stage(ref, s).parameters()):
            torch.testing.assert_close(got.grad, want.grad, atol=1e-12, rtol=1e-12,
                                       msg=lambda msg, n=name: f"stage {s} {n}: {msg}")
    return loss is not None


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_executor_gradients_equal_full_batch(rank_pool, world, kind, v):
    m = 2 * world
    has_loss = rank_pool(world).run(_executor_on_rank, kind, m, v)
    assert sum(has_loss) == 1  # only the last stage reports the loss


def _dies_mid_step():
    sched = pp.make_schedule("1f1b", 2, 2)
    model = _model(2)
    runner = pp.PipelineRunner(_stage(model, dist.get_rank()), schedule=sched, loss_fn=F.mse_loss, timeout=2.0)
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    if dist.get_rank() == 1:
        os._exit(7)  # the last stage dies before answering
    runner.step(x, None)


def test_a_dead_peer_is_a_timeout_naming_it():
    with RankPool(2, timeout=60) as pool:
        with pytest.raises(RankError) as info:
            pool.run(_dies_mid_step)
    text = str(info.value)
    assert "process died with exit code 7" in text
    assert "PipelineTimeout: stage 0 microbatch " in text and "rank 1 (stage 1)" in text


def _planted_on_rank():
    """Forget to scale each microbatch's loss by 1/m: the gradient parity check must catch it."""
    original = pp.PipelineRunner._run_action

    def unscaled(self, a, inputs_mb, targets_mb, state, stores, losses):
        self.schedule.num_microbatches, m = 1, self.schedule.num_microbatches
        try:
            return original(self, a, inputs_mb, targets_mb, state, stores, losses)
        finally:
            self.schedule.num_microbatches = m

    pp.PipelineRunner._run_action = unscaled
    try:
        _executor_on_rank("1f1b", 4, 1)
    except AssertionError:
        return "caught"
    finally:
        pp.PipelineRunner._run_action = original
    return "missed"


def test_planted_error_is_caught(rank_pool):
    assert rank_pool(2).run(_planted_on_rank) == ["caught", "caught"]
