"""PipelineRunner.step's stage_kwargs (tensors every stage takes besides its input, as packed
documents' segment_ids): split by microbatch and passed by name; refused by name, shape or device
before any P2P on the rank that passed them. The Trainer's use of them: test_train_4d.py."""
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from overlapkernels.comm.rank_pool import RankPool
from overlapkernels.runtime import pipeline as pp
from test_pipeline import WIDTH, _X, _Y


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("bad, error, match", [
    ([_X], TypeError, r"^stage_kwargs=list: expected a dict of name -> tensor$"),
    ({"segment_ids": _X[:3]}, ValueError, r"^stage_kwargs\['segment_ids'\]: expected a tensor whose dim 0 is divisible "
                                          r"by 2 microbatches, got \(3, 3\)$"),
])
def test_bad_stage_kwargs_are_named_before_any_communication(monkeypatch, bad, error, match):
    runner = pp.PipelineRunner(nn.Linear(3, 3), schedule=pp.make_schedule("1f1b", 1, 2), loss_fn=F.mse_loss)
    runner._nccl, calls = True, []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append("all_reduce"))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: calls.append("p2p"))
    with pytest.raises(error, match=match):
        runner.step(_X, _Y, stage_kwargs=bad)
    assert calls == []


@pytest.mark.usefixtures("world_of_one")
def test_stage_kwargs_reach_each_stage_split_by_microbatch():
    """Each microbatch's slice of every stage_kwargs tensor, by name, beside the stage's input."""
    seen = []

    class Stage(nn.Linear):
        def forward(self, x, *, offset):
            seen.append(offset.clone())
            return super().forward(x) + offset

    runner = pp.PipelineRunner(Stage(3, 3), schedule=pp.make_schedule("gpipe", 1, 2), loss_fn=F.mse_loss)
    offset = torch.arange(12.0).reshape(4, 3)
    with pytest.raises(TypeError, match=r"^stage 0: its forward takes no keyword argument \['offsets'\] \(stage_kwargs\)$"):
        runner.step(_X, _Y, stage_kwargs={"offsets": offset})  # refused before the stage runs: the runner goes on
    with pytest.raises(ValueError, match=r"^stage_kwargs\['offset'\] is on meta but the stages run on cpu$"):
        runner.step(_X, _Y, stage_kwargs={"offset": offset.to("meta")})
    runner.step(_X, _Y, stage_kwargs={"offset": offset})
    assert [t.tolist() for t in seen] == [t.tolist() for t in offset.chunk(2)]

    class Wrapper(nn.Module):  # a child named "module" (as fsdp.shard's wrapper has): its own forward counts
        def __init__(self):
            super().__init__()
            self.module = nn.Linear(3, 3)

        def forward(self, x, offset=None):
            return self.module(x) + offset

    pp.PipelineRunner(Wrapper(), schedule=pp.make_schedule("gpipe", 1, 2), loss_fn=F.mse_loss).step(
        _X, _Y, stage_kwargs={"offset": offset})


class _TakesIds(nn.Linear):
    def forward(self, x, segment_ids=None):
        return super().forward(x) + (0 if segment_ids is None else segment_ids.sum() * 0)


class _TakesAnything(nn.Linear):
    def forward(self, x, **kwargs):
        return super().forward(x)


def _misnamed_stage_kwarg_on_rank():
    """Rank 0's stage takes no such keyword: refused there before any P2P (its runner stays usable);
    rank 1 (whose stage takes any), waiting for rank 0's first message, stops at the runner's timeout
    naming it."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    runner = pp.PipelineRunner((_TakesIds if rank == 0 else _TakesAnything)(WIDTH, WIDTH),
                               schedule=pp.make_schedule("1f1b", 2, 2), loss_fn=F.mse_loss, timeout=2)
    x = torch.randn(4, WIDTH)
    try:
        runner.step(x if rank == 0 else None, x if rank == 1 else None,
                    stage_kwargs={"segment_id": torch.zeros(4, 3, dtype=torch.long)})
    except (TypeError, pp.PipelineTimeout) as exc:
        return f"{type(exc).__name__}: {exc}", runner._failed is None


def test_a_stage_kwarg_a_stage_does_not_take_is_refused_before_any_p2p():
    with RankPool(2, timeout=60) as pool:  # (rank 1's timed-out receives stay posted: a pool of its own)
        (said0, usable0), (said1, usable1) = pool.run(_misnamed_stage_kwarg_on_rank)
    assert said0 == "TypeError: stage 0: its forward takes no keyword argument ['segment_id'] (stage_kwargs)"
    assert usable0 and said1.startswith("PipelineTimeout: stage 1 microbatch 0") and "rank 0" in said1, said1
