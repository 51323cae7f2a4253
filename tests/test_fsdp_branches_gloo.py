"""fsdp when ranks' graphs differ: a unit that only some data-parallel ranks use in a step (a
data-dependent branch, an expert that got no tokens), and a second backward through a graph built
before the first (two losses, retain_graph). Each vs a single-process model trained the same way."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_IN, _net

D = 6


class Branchy(nn.Module):
    def __init__(self, width_b):
        super().__init__()
        self.a = nn.Linear(D, D)
        self.b = nn.Sequential(nn.Linear(D, width_b), nn.Linear(width_b, D))  # the branch
        self.c = nn.Linear(D, 1)

    def forward(self, x, use_b):
        y = self.a(x)
        return self.c(y + self.b(y) if use_b else y)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _branch_on_rank(stage, width_b, steps=2):
    """Rank 0 takes the branch in step 0 only, rank 1 never: units b's gradients exist on one rank.
    Stages 2-3 reduce-scatter during backward; every rank must still post the same reduce-scatters
    in the same order (rank 1 zeros for b), and nobody steps b when no rank used it (step 1)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    xs = [torch.randn(3, D, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    torch.manual_seed(0)
    sharded = fsdp.shard(Branchy(width_b).double(), stage=stage, optimizer=_sgd)  # units: a, b, c
    torch.manual_seed(0)
    ref = Branchy(width_b).double()
    opt = _sgd(ref.parameters())
    for step in range(steps):
        sharded(xs[rank], rank == 0 and step == 0).pow(2).mean().backward()
        sharded.step()
        opt.zero_grad(set_to_none=True)
        sum(ref(xs[r], r == 0 and step == 0).pow(2).mean() for r in range(world)).div(world).backward()
        opt.step()
    state, want = sharded.full_state_dict(), ref.state_dict()
    return [k for k in want if not torch.allclose(state[k], want[k], atol=1e-12, rtol=1e-12)]


@pytest.mark.parametrize("width_b", [D, 5])  # b's units the size of another unit, or not
@pytest.mark.parametrize("stage", [1, 2])
def test_a_unit_used_on_some_ranks_only(rank_pool, stage, width_b):
    """(Stage 3 gathers each unit when its forward starts: like FSDP2 and ZeRO-3 it needs every
    rank to run the same units; see the README.)"""
    assert rank_pool(2).run(_branch_on_rank, stage, width_b, timeout=30) == [[], []]


def _second_backward_on_rank(stage, how):
    """Two backwards through graphs built before the first: stage 3 must not have freed the root
    unit (Net.scale here), which nothing gathers again before the second backward."""
    world, rank = dist.get_world_size(), dist.get_rank()
    xs = [torch.randn(2, D_IN, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    sharded = fsdp.shard(_net(), stage=stage, optimizer=_sgd)
    ref = _net()
    opt = _sgd(ref.parameters())

    def losses(model, x):
        if how == "retain_graph":
            loss = model(x).pow(2).sum()
            return [loss, loss]
        return [model(x).pow(2).sum(), model(2 * x).pow(2).sum()]

    first, second = losses(sharded, xs[rank])
    first.backward(retain_graph=how == "retain_graph")
    second.backward()
    sharded.step()
    for x in xs:
        for loss in losses(ref, x):
            (loss / world).backward(retain_graph=True)
    opt.step()
    state, want = sharded.full_state_dict(), ref.state_dict()
    return [k for k in want if not torch.allclose(state[k], want[k], atol=1e-12, rtol=1e-12)]


@pytest.mark.parametrize("how", ["two losses", "retain_graph"])
@pytest.mark.parametrize("stage", [2, 3])
def test_a_second_backward_through_an_earlier_graph(rank_pool, stage, how):
    assert rank_pool(2).run(_second_backward_on_rank, stage, how, timeout=30) == [[], []]
