"""The pipeline executor when a peer fails mid-step: a dead peer or one that dies on a given
microbatch is a PipelineTimeout naming it, an activation that changes shape within a step is refused
by name. Each of those runs a pool of its own (a failed step leaves messages in flight). And a
rank refusing its own arguments at construction: every rank raises (the shared pool: nothing is in
flight then)."""
import os
import re
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from overlapkernels.comm.rank_pool import RankError, RankPool
from overlapkernels.runtime import pipeline as pp
from test_pipeline import WIDTH, _model, _stage


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


class _DiesOnMicrobatch(nn.Module):
    """A stage that dies in its forward of microbatch ``mb``, once what it sent for the earlier ones
    has left (its sends are posted asynchronously: dying at once could lose them in flight)."""

    def __init__(self, stage, mb):
        super().__init__()
        self.stage, self.mb, self.calls, self.runner = stage, mb, 0, None

    def forward(self, x):
        if self.calls == self.mb:
            for work, _ in self.runner._sends:
                work.wait(timedelta(seconds=30))
            os._exit(7)
        self.calls += 1
        return self.stage(x)


def _dies_on_microbatch_1():
    sched = pp.make_schedule("1f1b", 2, 2)  # rank 1: F0, B0 (sends gradient 0), F1, B1
    rank = dist.get_rank()
    stage = _stage(_model(2), rank)
    if rank == 1:
        stage = _DiesOnMicrobatch(stage, 1)
    # the death is seen as a closed connection, not by the timeout: a long one costs nothing, and a
    # loaded machine's slow healthy waits must not end the test first
    runner = pp.PipelineRunner(stage, schedule=sched, loss_fn=F.mse_loss, timeout=30.0)
    stage.runner = runner
    x, y = torch.randn(4, WIDTH, dtype=torch.float64), torch.randn(4, WIDTH, dtype=torch.float64)
    runner.step(x if rank == 0 else None, y if rank == 1 else None)


def test_a_peer_dying_mid_step_is_a_timeout_naming_the_microbatch():
    """Rank 1 dies in its forward of microbatch 1, after microbatch 0's activation crossed and its
    gradient came back: rank 0 finishes microbatch 0's backward, then names microbatch 1 and the
    peer, whether it was already waiting for that gradient or posts its receive once the
    connection is gone."""
    with RankPool(2, timeout=60) as pool:
        with pytest.raises(RankError) as info:
            pool.run(_dies_on_microbatch_1)
    text = str(info.value)
    assert "process died with exit code 7" in text
    assert re.search(r"PipelineTimeout: stage 0 microbatch 1: (no gradient from|cannot exchange with) rank 1 "
                     r"\(stage 1\) \(", text), text


class _Cut(nn.Module):
    """A stage whose output shape depends on the data: one row for microbatches starting with a
    negative value. (Every microbatch of a step must cross a boundary with one shape.)"""

    def forward(self, x):
        return x if x[0, 0] > 0 else x[:1] * 1.0


def _changing_shape_on_rank():
    r = dist.get_rank()
    stage = _Cut() if r == 0 else nn.Linear(3, 3).double()
    runner = pp.PipelineRunner(stage, schedule=pp.make_schedule("1f1b", 2, 2), loss_fn=F.mse_loss, timeout=1.0)
    x = torch.tensor([[1., 0, 0], [1, 1, 1], [-1, 0, 0], [2, 2, 2]], dtype=torch.float64)
    said = []
    for _ in range(2):  # a retry on the same runner: refused at once, not paired with the failed step's messages
        try:
            runner.step(x if r == 0 else None, torch.zeros(4, 3, dtype=torch.float64) if r == 1 else None)
            said.append("no error")
        except (ValueError, RuntimeError, pp.PipelineTimeout) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    return said


def test_an_activation_changing_shape_within_a_step_is_refused():
    """gloo would receive the smaller message into the first microbatch's larger buffer and the
    next stage would compute on stale rows: the sender refuses it by name (its peer times out, on
    whichever message of rank 0's it was still waiting for).
    A pool of its own: the failed step leaves messages in flight."""
    with RankPool(2, timeout=60) as pool:
        (sender, sender_retry), (receiver, receiver_retry) = pool.run(_changing_shape_on_rank)
    assert sender == ("ValueError: stage 0 microbatch 1: output (1, 3) torch.float64 differs from this step's first "
                      "microbatch ((2, 3) torch.float64)"), sender
    assert re.match(r"PipelineTimeout: stage 1 microbatch \d: no (shape|activation) from rank 0 \(stage 0\)", receiver), receiver
    for retry, failed in ((sender_retry, sender), (receiver_retry, receiver)):
        assert retry.startswith("RuntimeError: PipelineRunner: an earlier step failed after it had started exchanging "
                                f"messages ({failed[:60]}") and retry.endswith(
            "); its messages may still be in flight, and this step's would pair with them (same tags): build a new "
            "runner over new process groups, or restart the job"), retry


def _in_place_first_op_on_rank():
    rank = dist.get_rank()
    torch.manual_seed(0)
    stages = [nn.Linear(4, 4).double(), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4)).double()]
    runner = pp.PipelineRunner(stages[rank], schedule=pp.make_schedule("gpipe", 2, 1), loss_fn=F.mse_loss, timeout=2)
    x = torch.randn(2, 4, dtype=torch.float64)
    try:
        runner.step(x if rank == 0 else None, x if rank == 1 else None)
    except (RuntimeError, pp.PipelineTimeout) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "ran"


def test_a_stage_changing_its_received_input_in_place_is_told_why():
    """The received activation is a leaf that collects the gradient sent back, and autograd
    refuses in-place ops on such leaves: the error names the stage and the fix, not only autograd's
    words. (Its peer waits out the runner's timeout, as for any stage failing mid-step.)"""
    with RankPool(2, timeout=60) as pool:
        first, second = pool.run(_in_place_first_op_on_rank)
    assert second.startswith("RuntimeError: stage 1 microbatch 0: the stage modifies its input in place"), second
    assert "make that first op out of place" in second
    assert "its input is the activation received from stage 0, a leaf" in second, second
    assert first.startswith("PipelineTimeout: stage 0 microbatch 0: no gradient from rank 1"), first


def _refused_on_some_ranks(refusing):
    """Ranks in ``refusing`` pass two stage modules to a schedule of one per rank (their own
    argument: the others' are fine) -> (error type, message) of each rank's constructor."""
    rank, world = dist.get_rank(), dist.get_world_size()
    stage = _stage(_model(world), rank)
    try:
        pp.PipelineRunner([stage, stage] if rank in refusing else stage, schedule=pp.make_schedule("1f1b", world, 2),
                          loss_fn=F.mse_loss, timeout=5)
    except ValueError as exc:
        return type(exc).__name__, str(exc)
    return None


def _bad_device_on_rank_1():
    rank = dist.get_rank()
    try:
        pp.PipelineRunner(_stage(_model(2), rank), schedule=pp.make_schedule("1f1b", 2, 2), loss_fn=F.mse_loss,
                          timeout=5, device="gpu0" if rank == 1 else None)
    except (ValueError, RuntimeError) as exc:
        return type(exc).__name__
    return None


def test_a_bad_device_on_one_rank_is_raised_on_every_rank(rank_pool):
    """torch.device's own error on rank 1 (a per-rank argument), told to rank 0 by the agreement."""
    assert rank_pool(2).run(_bad_device_on_rank_1) == ["RefusedElsewhere", "RuntimeError"]


@pytest.mark.parametrize("world, refusing", [(2, (1,)), (3, (1, 2))])
def test_a_refusal_on_some_ranks_is_raised_on_every_rank(rank_pool, world, refusing):
    """Was: only the refusing rank raised; the others' first step waited for it until the timeout.
    Now every rank raises in the constructor, before any P2P: the refusing ones their own error,
    the others one naming the lowest refusing rank and its reason."""
    results = rank_pool(world).run(_refused_on_some_ranks, refusing)
    own = "2 stage modules on this rank, the schedule has 1 per rank"
    others = f" (and ranks {list(refusing[1:])})" if len(refusing) > 1 else ""
    for rank, got in enumerate(results):
        if rank in refusing:
            assert got == ("ValueError", own), (rank, got)
        else:
            assert got == ("RefusedElsewhere", f"PipelineRunner: rank {refusing[0]} of the group{others} refused, so "
                           f"this rank stops too: ValueError: {own}"), (rank, got)
