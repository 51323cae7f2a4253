"""The ops on a world of one, in the pytest process: what a single-GPU user (or a TP = 1 run) calls.
Precision contracts (fp32 softmax statistics, autocast leaving fp64 alone), strict mode where
nothing is eligible for overlap, the zero-bubble store reused across microbatches, and a gathered
input that is never the caller's shard itself. Each of these once passed every other test with a plausible bug planted."""
import pytest
import torch
import torch.nn.functional as F

import overlapkernels as ok
from overlapkernels.ops.linear import linear
from overlapkernels.ops.weight_grad_store import WeightGradStore, deferring

pytestmark = pytest.mark.usefixtures("world_of_one")


def _randn(*shape, seed, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_vocab_parallel_cross_entropy_of_bf16_logits_is_computed_in_fp32():
    logits = (_randn(64, 512, seed=0) * 4).bfloat16()
    target = torch.randint(0, 512, (64,), generator=torch.Generator().manual_seed(1))
    loss = ok.vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, F.cross_entropy(logits.float(), target, reduction="none"), atol=1e-5, rtol=1e-5)


def test_autocast_leaves_float64_alone():
    """As torch.matmul under autocast: fp64 operands are not cast down."""
    a, b = _randn(8, 16, seed=0, dtype=torch.float64), _randn(16, 4, seed=1, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gathered = ok.all_gather_matmul(a, b, method="baseline")
        scattered = ok.matmul_reduce_scatter(a, b, method="baseline")
        assert (a @ b).dtype == torch.float64
    assert gathered.dtype == scattered.dtype == torch.float64
    torch.testing.assert_close(gathered, a @ b, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(scattered, a @ b, atol=1e-12, rtol=1e-12)


def test_strict_overlap_does_not_police_a_world_of_one():
    """One rank has nothing to overlap: auto's plain matmul is not a fallback, strict mode lets it be."""
    ok.reset_overlap_stats()
    with ok.strict_overlap():
        out = ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3))
        out_rs = ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 3))
    assert torch.equal(out, torch.full((4, 3), 8.0)) and torch.equal(out_rs, torch.full((4, 3), 8.0))


def test_weight_grad_store_reused_across_microbatches_sums_them():
    """DualPipe-style: one store, B then W per microbatch; each W runs only what its B deferred."""
    w = _randn(4, 6, seed=0, dtype=torch.float64).requires_grad_()
    xs = [_randn(5, 6, seed=1 + i, dtype=torch.float64) for i in range(2)]
    store = WeightGradStore()
    for i, x in enumerate(xs):
        with deferring(store):
            linear(x, w).sum().backward()
        if i == 0:
            assert w.grad is None  # deferred: it waits in the store until W
        store.run()
    want = sum(torch.ones(5, 4, dtype=torch.float64).T @ x for x in xs)
    torch.testing.assert_close(w.grad, want, atol=1e-12, rtol=1e-12)


def test_minus_ndim_is_a_valid_dim():
    a, b = _randn(4, 8, seed=0), _randn(8, 3, seed=1)
    torch.testing.assert_close(ok.all_gather_matmul(a, b, gather_dim=-2, method="baseline"), a @ b)
    torch.testing.assert_close(ok.matmul_reduce_scatter(a, b, scatter_dim=-2, method="baseline"), a @ b)


def test_all_gather_linear_takes_its_weights_from_any_sequence():
    """A generator of weights (a module's parameters filtered on the fly) is read once, also under
    autocast, where each weight is cast like the input."""
    from overlapkernels.ops.all_gather_matmul import all_gather_linear

    x, w1, w2 = _randn(6, 8, seed=0), _randn(3, 8, seed=1), _randn(5, 8, seed=2)
    outs = all_gather_linear(x, (w for w in (w1, w2)))
    for out, w in zip(outs, (w1, w2)):
        torch.testing.assert_close(out, x @ w.T)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = all_gather_linear(x, (w for w in (w1, w2)))
    assert [o.dtype for o in outs] == [torch.bfloat16] * 2


@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_the_gathered_input_takes_a_gradient_only_when_the_shard_does(method):
    """As torch.cat(all_gather(a)): with a frozen a_shard and a trained b, gathered_a required grad,
    and a loss built from it alone ran a backward (a re-gather on every rank) for nothing."""
    b = torch.randn(8, 3, requires_grad=True)
    gathered, out = ok.all_gather_matmul(torch.randn(4, 8), b, return_gathered=True, method=method)
    assert not gathered.requires_grad and out.requires_grad
    a = torch.randn(4, 8, requires_grad=True)
    gathered, out = ok.all_gather_matmul(a, b, return_gathered=True, method=method)
    gathered.sum().backward()
    assert torch.equal(a.grad, torch.ones(4, 8))


@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_the_gathered_input_is_a_copy_of_the_shard(method):
    """As torch.cat(all_gather(a)): a new tensor even where the world has one rank - gathering one
    shard must not hand the caller its own input back, which an in-place change would then edit."""
    a, b = torch.ones(4, 8), torch.ones(8, 3)
    gathered, out = ok.all_gather_matmul(a, b, return_gathered=True, method=method)
    gathered.add_(1)
    assert torch.equal(a, torch.ones(4, 8)) and torch.equal(out, torch.full((4, 3), 8.0))
