"""vocab_parallel_cross_entropy on non-finite logits vs F.cross_entropy on the full logits (float64):
masked vocabulary entries (-inf, as for padded vocabularies) keep the loss finite, a masked target
gives inf, NaN or +inf gives NaN - on every rank alike, gradients included."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import overlapkernels as ok

V, N = 8, 5
NEG, NAN, POS = float("-inf"), float("nan"), float("inf")


def _logits(case):
    g = torch.Generator().manual_seed(3)
    z = torch.randn(N, V, generator=g, dtype=torch.float64)
    t = torch.randint(0, V - 2, (N,), generator=g)
    if case == "padded vocab masked":  # the last two ids (rank 1's shard) are padding
        z[:, V - 2:] = NEG
    elif case == "masked at every shard's first id":  # where a non-owner's clamped target index points
        z[:, 0] = z[:, V // 2] = NEG
        t = torch.tensor([1, 2, 5, 6, 7])
    elif case == "masked target":
        z[0, 1], t[0] = NEG, 1
    elif case == "nan on one shard":
        z[1, V - 1], t[1] = NAN, 0
    elif case == "+inf on one shard":
        z[2, V - 2] = POS
    return z, t


def _loss_on_rank(case, smoothing):
    world, rank = dist.get_world_size(), dist.get_rank()
    z, t = _logits(case)
    shard = z.chunk(world, -1)[rank].clone().requires_grad_()
    loss = ok.vocab_parallel_cross_entropy(shard, t, label_smoothing=smoothing)
    loss.sum().backward()
    return loss.detach(), shard.grad


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("case", ["padded vocab masked", "masked at every shard's first id", "masked target",
                                  "nan on one shard", "+inf on one shard"])
def test_non_finite_logits_match_torch(rank_pool, case, smoothing):
    results = rank_pool(2).run(_loss_on_rank, case, smoothing, timeout=30)
    z, t = _logits(case)
    full = z.clone().requires_grad_()
    want = F.cross_entropy(full, t, reduction="none", label_smoothing=smoothing)
    want.sum().backward()
    for loss, _ in results:
        torch.testing.assert_close(loss, want.detach(), atol=1e-12, rtol=1e-12, equal_nan=True)
    grad = torch.cat([g for _, g in results], dim=-1)
    torch.testing.assert_close(grad, full.grad, atol=1e-12, rtol=1e-12, equal_nan=True)
