"""fsdp's step helpers and guards where the other tests do not reach: parameters without a gradient
in a unit after the first (and a 1-element one), the gradient stash's switch to one buffer at
exactly half the unit and its copies of the gradients it is given, and the refused load of a
trained parameter under its second (tied) name. The first unit's gradless parameters:
test_fsdp_units_gloo.py; the stash's sums: test_fsdp_accumulation_gloo.py."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_IN, OPTIMIZERS, _batches, _loss


class _Blk(nn.Module):
    """The second unit: its branch (``b`` and the 1-element ``gate``) is not taken in the last
    steps, while ``a`` trains."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D_IN, D_IN), nn.Linear(D_IN, 3)
        self.gate = nn.Parameter(torch.tensor([0.5]))

    def forward(self, x, use_b):
        h = torch.tanh(self.a(x))
        return self.b(h) * self.gate if use_b else h[:, :3]


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.blk = nn.Linear(D_IN, D_IN), _Blk()

    def forward(self, x, use_b=True):
        return self.blk(torch.tanh(self.pre(x)), use_b)


def _gradless_in_a_later_unit_on_rank(stage):
    world, rank = dist.get_world_size(), dist.get_rank()
    make = lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1)  # noqa: E731
    torch.manual_seed(0)
    ref = _Net().double()
    sharded = fsdp.shard(copy.deepcopy(ref), stage=stage, optimizer=make)
    assert [u.name for u in sharded.all_units][:2] == ["pre", "blk"]
    ref_opt = make(list(ref.parameters()))
    for step, (x, y) in enumerate(_batches(4, 2, world)):
        ref_opt.zero_grad()
        _loss(ref(x, step < 2), y).backward()
        ref_opt.step()
        mine = slice(rank * 2, (rank + 1) * 2)
        _loss(sharded(x[mine], step < 2), y[mine]).backward()
        sharded.step()
    got = sharded.full_state_dict()
    return [k for k, want in ref.state_dict().items() if not torch.allclose(got[k], want, rtol=1e-12, atol=1e-12)]


@pytest.mark.parametrize("stage", [1, 3])
def test_a_parameter_without_gradient_in_a_later_unit_is_left_alone(rank_pool, stage):
    """Each unit reads its own parameters' flags (not the first unit's again), and a 1-element
    parameter is held like any other: weight decay does not move them while they get no gradient."""
    assert rank_pool(2).run(_gradless_in_a_later_unit_on_rank, stage) == [[], []]


def test_the_stash_takes_one_buffer_at_exactly_half_and_copies_what_it_is_given():
    from overlapkernels.runtime.fsdp.grad_stash import GradStash

    stash = GradStash([0, 1], [1, 6], 8, torch.float32, torch.device("cpu"))
    grad = torch.tensor([1.0])  # in the stash's dtype: a sum of its own all the same
    stash.add(0, grad)
    stash.add(0, torch.tensor([2.0]))
    assert grad.tolist() == [1.0] and stash.flat is None and stash.held_elements == 1
    assert stash.take()[0].tolist() == [3.0] + [0.0] * 7
    half = GradStash([0, 4], [4, 4], 8, torch.float32, torch.device("cpu"))
    half.add(1, torch.ones(4))  # 4 of 8 elements: half, one buffer
    assert half.flat is not None and half.held_elements == 8


class _Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x):
        return self.head(self.embed(x))


@pytest.mark.usefixtures("world_of_one")
def test_a_load_of_a_trained_parameter_under_its_tied_name_is_refused():
    """A tied weight has two state-dict names; a load through the second (``head.weight``) would reach
    the gathered copy only, and the next step would undo it, like one through the first."""
    sharded = fsdp.shard(_Tied().double(), stage=2, optimizer=OPTIMIZERS["sgd"])
    with pytest.raises(RuntimeError, match=r"of the trained parameters head\.weight: the optimizer trains"):
        sharded.module.load_state_dict({"head.weight": torch.zeros(4, 4, dtype=torch.float64)}, strict=False)
