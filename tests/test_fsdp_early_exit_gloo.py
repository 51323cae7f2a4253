"""fsdp stage 3 after an early exit: a forward that skipped a unit leaves that unit's prefetch in
flight, carrying the masters of then; what runs next (a load, a step) must neither compute with it
nor let it read masters being updated."""
import torch
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_IN, _loss
from test_fsdp_units_gloo import BranchNet


def _load_after_an_early_exit_on_rank(path):
    """An eval forward that skipped a unit left that unit's prefetch in flight, carrying the masters of
    then; fsdp.load republished gathered units only, so the unit's next forward computed with the
    pre-load weights (and a forward's write then took them into the masters)."""
    torch.manual_seed(0)
    sharded = fsdp.shard(BranchNet().double(), stage=3, prefetch=1, units=(nn.Linear,),
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    x = torch.randn(2, D_IN, dtype=torch.float64)
    fsdp.save(sharded, path)
    with torch.no_grad():
        want = sharded(x)
    _loss(sharded(x), torch.zeros(2, 3, dtype=torch.float64)).backward()
    sharded.step()  # the weights move away from the checkpoint
    with torch.no_grad():
        sharded.module.blk.a(x)  # a unit alone: its neighbour's prefetch is left in flight
        fsdp.load(sharded, path)
        return torch.equal(sharded(x), want)


def test_a_load_after_an_early_exit_computes_with_the_loaded_weights(rank_pool, tmp_path):
    assert rank_pool(2).run(_load_after_an_early_exit_on_rank, str(tmp_path / "ckpt")) == [True, True]


def _step_after_an_early_exit_on_rank():
    """A forward that skipped a unit left that unit's prefetch in flight; its all-gather reads the
    unit's master (the master itself: no param_dtype), which the optimizer then updated in place
    while it was read (on NCCL, at once). step waits for it and drops it before the optimizer runs;
    the next forward gathers the stepped weights."""
    torch.manual_seed(0)
    sharded = fsdp.shard(BranchNet().double(), stage=3, prefetch=1, units=(nn.Linear,),
                         optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    x = torch.randn(2, D_IN, dtype=torch.float64)
    _loss(sharded(x), torch.zeros(2, 3, dtype=torch.float64)).backward()
    with torch.no_grad():
        sharded.module.blk.a(x)  # blk.b's prefetch is left in flight
    in_flight = [u.name for u in sharded.saved_units if u.pending_gather is not None]
    seen, step = [], sharded.optimizer.step

    def spied_step(*args, **kwargs):
        seen.extend(u.name for u in sharded.saved_units if u.pending_gather is not None)
        return step(*args, **kwargs)

    sharded.optimizer.step = spied_step
    sharded.step()
    stepped = BranchNet().double()
    stepped.load_state_dict(sharded.full_state_dict())
    with torch.no_grad():
        return in_flight, seen, torch.equal(sharded(x), stepped(x))


def test_a_step_after_an_early_exit_finishes_the_prefetch_before_the_optimizer(rank_pool):
    assert rank_pool(2).run(_step_after_an_early_exit_on_rank) == [(["blk.b"], [], True)] * 2
