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


def _uneven_on_rank(world_split, smoothing):
    """Vocabulary 7 split 4 + 3 (or 3 + 4) with tensor_split, as a vocabulary that does not divide
    by the TP size is: each rank took its own width for everyone's, so slices were misplaced (wrong
    losses), and a target id valid for 7 was refused on the rank that thought the vocabulary was 6
    while its peer waited in the first all-reduce."""
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(5)
    z = torch.randn(6, 7, generator=g, dtype=torch.float64)
    t = torch.tensor([0, 3, 4, 5, 6, -100])
    shard = torch.tensor_split(z, world_split, dim=-1)[rank].clone().requires_grad_()
    loss = ok.vocab_parallel_cross_entropy(shard, t, label_smoothing=smoothing)
    loss.sum().backward()
    return loss.detach(), shard.grad


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("split", [[4], [3]])
def test_uneven_vocabulary_slices_match_torch(rank_pool, split, smoothing):
    results = rank_pool(2).run(_uneven_on_rank, split, smoothing, timeout=30)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(6, 7, generator=g, dtype=torch.float64).requires_grad_()
    want = F.cross_entropy(full, torch.tensor([0, 3, 4, 5, 6, -100]), reduction="none", label_smoothing=smoothing)
    want.sum().backward()
    for loss, _ in results:
        torch.testing.assert_close(loss, want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(torch.cat([grad for _, grad in results], dim=-1), full.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_three_uneven_slices_match_torch(rank_pool, smoothing):
    """Vocabulary 7 split 2 + 3 + 2: rank 2's slice starts at 5, not at 2 x its own or rank 0's width
    (with two ranks the two coincide)."""
    results = rank_pool(3).run(_uneven_on_rank, [2, 5], smoothing, timeout=30)
    g = torch.Generator().manual_seed(5)
    full = torch.randn(6, 7, generator=g, dtype=torch.float64).requires_grad_()
    want = F.cross_entropy(full, torch.tensor([0, 3, 4, 5, 6, -100]), reduction="none", label_smoothing=smoothing)
    want.sum().backward()
    for loss, _ in results:
        torch.testing.assert_close(loss, want.detach(), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(torch.cat([grad for _, grad in results], dim=-1), full.grad, atol=1e-12, rtol=1e-12)


def _bad_logits_on_rank():
    from comm_guard import no_communication
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    t = torch.zeros(3, dtype=torch.long)
    errors = []
    for logits in (distribute_tensor(torch.randn(3, 8), mesh, [Shard(1)]), torch.zeros(3, 4, dtype=torch.long)):
        try:
            with no_communication():  # refused before the first all-reduce, not after it
                ok.vocab_parallel_cross_entropy(logits, t)
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:52])
    try:  # a target id past the whole vocabulary: refused on every rank alike, none left waiting
        ok.vocab_parallel_cross_entropy(torch.randn(3, 4), torch.tensor([0, 8, 1]))
    except ValueError as exc:
        errors.append(str(exc))
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    try:  # a second derivative: refused for the reason that holds (its backward does not communicate)
        loss = ok.vocab_parallel_cross_entropy(torch.tanh(x), torch.tensor([0, 5, 1]))
        torch.autograd.grad(loss.sum(), x, create_graph=True)
    except RuntimeError as exc:
        errors.append(str(exc).split(": ", 2)[-1][:60])
    return errors


def test_dtensor_and_integer_logits_and_bad_targets_are_refused_by_name(rank_pool):
    want = ["TypeError: logits_shard is a DTensor ((Shard(dim=1),", "ValueError: logits_shard.dtype=torch.int64: expected",
            "target holds ids outside [0, 8) that are not ignore_index=-100, e.g. 8",
            "its backward reads the softmax saved in forward, whose depen"]
    assert rank_pool(2).run(_bad_logits_on_rank, timeout=30) == [want, want]
