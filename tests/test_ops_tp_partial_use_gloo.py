"""all_gather_matmul when the ranks' losses use different parts of its result: the forward call is
the same on every rank, but rank 0's loss may use one weight's output (and the gathered input),
rank 1's another. Backward must run the same traffic on every rank - a missing gradient is zeros -
or one rank waits alone in a collective (a hang) and the other's gradients miss its terms."""
import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok

# what each rank's loss uses: output indices (weights of widths 2 and 5), and the gathered input
USES = {
    "different outputs, gathered on rank 0": [((0,), True), ((1,), False)],
    "only the gathered input on rank 1": [((0, 1), False), ((), True)],
}


def _partial_use_on_rank(method, uses, save_gathered):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(3, 8, generator=g, dtype=torch.float64) for _ in range(world)]
    weights = [[torch.randn(8, n, generator=g, dtype=torch.float64) for n in (2, 5)] for _ in range(world)]
    # each rank's gradient of each output: random, so a row or chunk out of order shows
    upstream = [[torch.randn(3 * world, n, generator=g, dtype=torch.float64) for n in (2, 5)] for _ in range(world)]
    a = shards[rank].clone().requires_grad_()
    bs = [b.clone().requires_grad_() for b in weights[rank]]
    gathered, outs = ok.all_gather_matmul(a, bs, return_gathered=True, method=method, save_gathered=save_gathered)
    used, uses_gathered = uses[rank]
    loss = sum((outs[i] * upstream[rank][i]).sum() for i in used) + (gathered.pow(2).sum() if uses_gathered else 0)
    loss.backward()

    a_full = torch.cat(shards)  # dense: d loss_r / d a_full, summed over ranks r
    grad_full = torch.zeros_like(a_full)
    for r, (used_r, gathered_r) in enumerate(uses):
        for i in used_r:
            grad_full += upstream[r][i] @ weights[r][i].T
        if gathered_r:
            grad_full += 2 * a_full
    torch.testing.assert_close(a.grad, grad_full.chunk(world)[rank], atol=1e-12, rtol=1e-12)
    for i, b in enumerate(bs):
        if i in used:  # a weight whose output this rank did not use keeps grad None, as in torch
            torch.testing.assert_close(b.grad, a_full.T @ upstream[rank][i], atol=1e-12, rtol=1e-12)
        else:
            assert b.grad is None
    return True


@pytest.mark.parametrize("save_gathered", [False, True])
@pytest.mark.parametrize("uses", list(USES))
@pytest.mark.parametrize("method", ["baseline", "decomposed", "auto"])
def test_ranks_using_different_parts_of_the_result(rank_pool, method, uses, save_gathered):
    assert rank_pool(2).run(_partial_use_on_rank, method, USES[uses], save_gathered, timeout=30) == [True, True]


def _auto_with_different_used_widths_on_rank():
    """Under 'auto' the dgrad's choice must not depend on which outputs this rank used: at this
    shape the gloo rules pick differently for a width of 64 and one of 2048, so choosing from the
    used widths paired one rank's P2P ring with the other's collective (a hang)."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    a = torch.randn(512, 256, generator=g).requires_grad_()
    bs = [torch.randn(256, n, generator=g) for n in (64, 2048)]
    ok.reset_overlap_stats()
    o1, o2 = ok.all_gather_matmul(a, bs, method="auto")
    (o1.sum() if rank == 0 else o2.sum()).backward()
    return sorted(key for key in ok.overlap_stats() if key[0] == "matmul_reduce_scatter")


def test_auto_backward_chooses_alike_whatever_each_rank_used(rank_pool):
    choices = rank_pool(2).run(_auto_with_different_used_widths_on_rank, timeout=30)
    assert choices[0] == choices[1] and len(choices[0]) == 1, choices
