"""Which parameters had a gradient in a step - what ``step`` steps, and leaves alone where no rank
had one (as torch skips a parameter whose grad is None) - when their gradients came another way
than one synced backward: one dropped by ``zero_grad`` (a skipped non-finite loss), or only in a
``no_sync`` micro-batch, summed apart in reduce_dtype. Each vs single-process training."""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import _batches, _loss
from test_fsdp_units_gloo import BranchNet


def _dropped_backward_on_rank(stage):
    """Each step: a backward through ``blk.b``, dropped by zero_grad, then one that skips it. torch
    leaves ``blk.b`` as it was (its grad is None, so no weight decay or momentum); a "had a
    gradient" flag kept from the dropped backward let the optimizer step its zero gradient."""
    world, rank = dist.get_world_size(), dist.get_rank()
    make = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.1)  # noqa: E731
    torch.manual_seed(0)
    ref = BranchNet().double()
    sharded = fsdp.shard(copy.deepcopy(ref), stage=stage, optimizer=make)
    ref_opt = make(list(ref.parameters()))
    for x, y in _batches(3, 2, world):
        mine = slice(rank * 2, (rank + 1) * 2)
        _loss(sharded(3 * x[mine], True), y[mine]).backward()
        sharded.zero_grad()
        _loss(sharded(x[mine], False), y[mine]).backward()
        sharded.step()
        ref_opt.zero_grad()
        _loss(ref(x, False), y).backward()
        ref_opt.step()
    got = sharded.full_state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_grad_forgets_which_parameters_the_dropped_backward_reached(rank_pool, stage):
    assert rank_pool(2).run(_dropped_backward_on_rank, stage) == [True, True]


def _stashed_only_on_rank(stage):
    """bf16 compute, fp32 reductions: a first micro-batch (in no_sync at stages 2/3) goes through
    ``blk.b``, the last one does not, so ``blk.b``'s gradient exists only summed apart in fp32 - and
    must still be stepped. Against a reference kept by hand: bf16 gradients summed per rank in fp32,
    divided by N, summed over the 2 ranks, SGD on an fp32 master (as test_fsdp_precision_gloo.py)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    torch.manual_seed(0)
    ref = BranchNet()
    sharded = fsdp.shard(copy.deepcopy(ref), stage=stage, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                         optimizer=sgd)
    master = [nn.Parameter(p.detach().clone()) for p in ref.parameters()]
    master_opt, bf16 = sgd(master), copy.deepcopy(ref).bfloat16()
    for x, y in _batches(2, 2, world, torch.float32):
        micro = [(3 * x, True), (x, False)]
        mine = slice(rank * 2, (rank + 1) * 2)
        with sharded.no_sync() if stage > 1 else contextlib.nullcontext():
            _loss(sharded(micro[0][0][mine].bfloat16(), True).float(), y[mine]).backward()
        _loss(sharded(micro[1][0][mine].bfloat16(), False).float(), y[mine]).backward()
        sharded.step()
        with torch.no_grad():
            for p, m in zip(bf16.parameters(), master):
                p.copy_(m)
        sums = [[torch.zeros_like(m) for m in master] for _ in range(world)]
        for r in range(world):
            for xs, use_b in micro:
                bf16.zero_grad()
                _loss(bf16(xs[r * 2:(r + 1) * 2].bfloat16(), use_b).float(), y[r * 2:(r + 1) * 2]).backward()
                for s, p in zip(sums[r], bf16.parameters()):
                    if p.grad is not None:
                        s += p.grad.float()
        for i, m in enumerate(master):
            m.grad = torch.zeros_like(m)
            for r in range(world):
                m.grad += sums[r][i] / world
        master_opt.step()
    got = sharded.full_state_dict()
    for (name, _), m in zip(ref.named_parameters(), master):
        torch.testing.assert_close(got[name], m.detach(), atol=1e-7, rtol=1e-6, msg=lambda s, n=name: f"{n}: {s}")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_gradient_only_summed_apart_is_stepped(rank_pool, stage):
    assert rank_pool(2).run(_stashed_only_on_rank, stage) == [True, True]
