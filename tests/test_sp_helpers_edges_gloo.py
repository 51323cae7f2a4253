"""Edges of the SP/CP helpers found by a hunt (2 gloo ranks unless said): outputs that must not be
marked views (in-place ops on them raised), a split that must not share the caller's memory, the
vocab-parallel cross entropy's gradient at ignored rows, the weight-gradient store after a closure
raised, and the SP embedding's token shape."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import overlapkernels as ok
from overlapkernels.ops import tp_regions
from overlapkernels.ops.weight_grad_store import WeightGradStore


def _in_place_on_outputs_on_rank():
    """Shapes where .contiguous() hands back its input (dim 0, batch 1, [1, 1, H]): the results are
    still plain tensors, in-place ops work, and they match the unsharded reference. Inputs require
    grad: autograd refuses an in-place op on a Function's view output only when it tracks it."""
    r, w, g = dist.get_rank(), dist.get_world_size(), dist.group.WORLD
    full = torch.arange(1 * 8 * 4, dtype=torch.float64).reshape(1, 8, 4).requires_grad_()  # batch 1, [B, S, H]
    for dim, x in ((1, full), (0, full[0])):  # (the [S, H] layout gathers along dim 0)
        part = ok.shard_sequence(x, dim=dim) * 1
        y = ok.unshard_sequence(part, dim=dim)
        y.mul_(2)
        assert torch.equal(y, 2 * x)
    x = (torch.arange(4.0, dtype=torch.float64).reshape(1, 1, 4) + 10 * r).requires_grad_()
    y = tp_regions.gather_last_dim(x * 1, g)
    y.add_(1)
    assert torch.equal(y, torch.cat([torch.arange(4.0, dtype=torch.float64).reshape(1, 1, 4) + 10 * q + 1
                                     for q in range(w)], -1))
    y = tp_regions.gather_first_dim(x * 1, g)
    y.add_(1)
    x_before = x.clone()
    s = tp_regions.split_last_dim(x, g)
    s.zero_()  # the caller's input must not change
    assert torch.equal(x, x_before) and s.shape == (1, 1, 4 // w)
    x = torch.arange(8.0, dtype=torch.float64).reshape(8, 1)
    for layout in ("contiguous", "zigzag"):  # nor does a shard (a view would also keep the whole sequence alive)
        ok.shard_sequence(x, dim=0, layout=layout).zero_()
    assert torch.equal(x, torch.arange(8.0, dtype=torch.float64).reshape(8, 1))
    return True


def test_outputs_take_in_place_ops_and_a_split_never_shares_the_callers_memory(rank_pool):
    assert rank_pool(2).run(_in_place_on_outputs_on_rank) == [True, True]


def _ce_grad_at_ignored_rows_on_rank():
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(5)
    z = torch.randn(4, 8, generator=g, dtype=torch.float64)
    t = torch.tensor([1, -100, 6, -100])
    incoming = torch.tensor([1.0, float("inf"), 2.0, float("nan")], dtype=torch.float64)  # ignored rows: non-finite
    shard = z.chunk(world, -1)[rank].clone().requires_grad_()
    ok.vocab_parallel_cross_entropy(shard, t).backward(incoming)
    full = z.clone().requires_grad_()
    F.cross_entropy(full, t, reduction="none").backward(incoming)
    torch.testing.assert_close(shard.grad, full.grad.chunk(world, -1)[rank], rtol=1e-12, atol=1e-12)
    return True


def test_cross_entropy_gradient_is_zero_at_ignored_rows_whatever_flows_in(rank_pool):
    assert rank_pool(2).run(_ce_grad_at_ignored_rows_on_rank) == [True, True]


def test_the_weight_grad_store_never_applies_a_closure_twice():
    store, ran = WeightGradStore(), []

    def failing():
        ran.append("failing")
        raise RuntimeError("out of memory")

    store.closures = [lambda: ran.append(0), failing, lambda: ran.append(2)]
    with pytest.raises(RuntimeError, match="out of memory"):
        store.run()
    store.run()  # the rest only
    assert ran == [0, "failing", 2] and store.closures == []


def _sp_embedding_with_1d_tokens_on_rank():
    from comm_guard import no_communication
    from overlapkernels.layers.embedding import VocabParallelEmbedding

    emb = VocabParallelEmbedding(16, 4, sequence_parallel=True)
    try:
        with no_communication():  # refused before the reduce-scatter, not after it
            emb(torch.arange(6))
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_sequence_parallel_embedding_refuses_tokens_that_are_not_batch_by_sequence(rank_pool):
    for message in rank_pool(2).run(_sp_embedding_with_1d_tokens_on_rank):
        assert message.startswith("tokens of shape (6,): expected [batch, sequence] with sequence_parallel=True")


class _DeferringLinear(torch.autograd.Function):
    """x @ w whose weight gradient goes to the store inside ``deferring`` (as our layers' do)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x)
        ctx.w = w
        return x @ w

    @staticmethod
    def backward(ctx, grad):
        from overlapkernels.ops.weight_grad_store import defer

        (x,) = ctx.saved_tensors
        if defer([ctx.w], lambda: [x.T @ grad]):
            return grad @ ctx.w.T, None
        return grad @ ctx.w.T, x.T @ grad


def test_a_weight_the_caller_excluded_from_backward_gets_no_deferred_gradient():
    from overlapkernels.ops.weight_grad_store import deferring

    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    store = WeightGradStore()
    with deferring(store):
        (gx,) = torch.autograd.grad(_DeferringLinear.apply(x, w).sum(), x)  # x only
        _DeferringLinear.apply(x, w).sum().backward(inputs=[x])
    store.run()
    assert w.grad is None and torch.equal(gx, torch.ones(3, 2, dtype=torch.float64) @ w.detach().T)
    with deferring(store):
        _DeferringLinear.apply(x, w).sum().backward()  # w included: deferred to W
    assert w.grad is None and len(store.closures) == 1
    store.run()
    torch.testing.assert_close(w.grad, x.detach().T @ torch.ones(3, 2, dtype=torch.float64), rtol=0, atol=0)


def test_deferring_ends_with_its_block_when_the_block_raises():
    """A B step that raised (an out-of-memory) inside ``deferring`` must not leave the store active:
    every later backward would push its weight gradients to a store no W ever runs."""
    from overlapkernels.ops.weight_grad_store import deferring

    store = WeightGradStore()
    with pytest.raises(RuntimeError, match="out of memory"), deferring(store):
        raise RuntimeError("out of memory")
    x = torch.randn(3, 4, dtype=torch.float64)
    w = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    _DeferringLinear.apply(x, w).sum().backward()  # outside deferring: at once
    assert store.closures == []
    torch.testing.assert_close(w.grad, x.T @ torch.ones(3, 2, dtype=torch.float64), rtol=0, atol=0)
