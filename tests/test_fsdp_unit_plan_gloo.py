"""What fsdp.shard makes units of (unit_plan.py), on gloo ranks: ``units=`` classes that match both a
module and modules inside it, a module at a second path outside the units, and the tags a frozen
parameter needs. Default units, tied weights and frozen parameters:
test_fsdp_units_gloo.py."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_HID, D_IN, OPTIMIZERS, Block, _batches, _loss, _train_on_rank


def test_a_unit_class_inside_a_matched_unit_makes_no_unit_of_its_own(rank_pool):
    """units=(Block, nn.Linear): each Block is a unit, and so are the Linears outside every Block;
    the Linear inside a Block stays in its Block's unit (a unit inside a unit would hold its
    parameters twice). Trains as the single process does."""
    for stage in (2, 3):
        _, units, _ = rank_pool(2).run(_train_on_rank, stage, 1, (Block, nn.Linear))[0]
        # inp (6 x 10 + 10), three blocks (10 x 10 + 10 + LayerNorm's 20), out (10 x 3 + 3), the root's scale
        assert units == [(70, False), (130, False), (130, False), (130, False), (33, False), (1, True)], units


class _AliasNet(nn.Module):
    """The first block's LayerNorm is also the model's final norm: one module at two paths, one
    inside a unit (units=Block) and one outside every unit."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D_HID)
        self.blocks = nn.Sequential(Block(D_HID), Block(D_HID))
        self.out = nn.Linear(D_HID, 3)
        self.final_norm = self.blocks[0].norm

    def forward(self, x):
        return self.out(self.final_norm(self.blocks(self.inp(x))))


class _TiedNet(nn.Module):
    """A root Linear whose name begins like the unit's (``enc_head``, ``enc``) and whose weight is the
    unit's: shared with the root, though no path of it lies inside ``enc``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D_HID)
        self.enc = Block(D_HID)
        self.enc_head = nn.Linear(D_HID, D_HID)
        self.enc_head.weight = self.enc.fc.weight
        self.out = nn.Linear(D_HID, 3)

    def forward(self, x):
        return self.out(self.enc_head(self.enc(self.inp(x))))


def _shared_with_the_root_on_rank(make):
    """Stage 3 and one process, trained alike (a parameter of the unit freed under the root's use
    would raise, or train from a size-0 tensor)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    dense = make().double()
    torch.manual_seed(0)
    sharded = fsdp.shard(make().double(), stage=3, units=(Block,), optimizer=OPTIMIZERS["sgd"])
    opt = OPTIMIZERS["sgd"](dense.parameters())
    for x, y in _batches(2, 2, world):
        opt.zero_grad()
        _loss(dense(x), y).backward()
        opt.step()
        _loss(sharded(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2]).backward()
        sharded.step()
    got, want = sharded.full_state_dict(), dense.state_dict()
    return [k for k in want if not torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-12)]


@pytest.mark.parametrize("make", [_AliasNet, _TiedNet], ids=["second_path", "name_prefix"])
def test_a_parameter_of_a_unit_used_outside_it_goes_to_the_root(rank_pool, make):
    """Stage 3 frees a unit's parameters after its forward: a module of the unit called again through
    a path outside every unit (counted through every path, not the first only), or a root module
    tied to the unit's weight whose name merely begins with the unit's, must find them gathered:
    their parameters go to the root unit."""
    assert rank_pool(2).run(_shared_with_the_root_on_rank, make) == [[], []]


@pytest.mark.usefixtures("world_of_one")
def test_a_frozen_sequence_parallel_parameter_needs_no_group():
    """Only a gradient is partial over TP: a frozen parameter tagged sequence_parallel (a norm of a
    base model under adapters) is not refused for lacking its group."""
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)).double()
    model[1].weight.sequence_parallel = True
    model[1].requires_grad_(False)
    sharded = fsdp.shard(model, stage=2, optimizer=OPTIMIZERS["sgd"])
    sharded(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    sharded.step()
    model[1].requires_grad_(True)
    with pytest.raises(ValueError, match=r"^parameter '1.weight' has sequence_parallel=True but no"):
        fsdp.shard(nn.Sequential(nn.Linear(4, 4), model[1]).double(), stage=2, optimizer=OPTIMIZERS["sgd"])
