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


def test_linear_under_deferring_defers_a_3d_inputs_bias_grad_summed_over_every_token():
    """A [batch, seq, K] input: W's bias gradient sums grad_out over batch and sequence alike (plain
    autograd forgives a bias gradient summed over the first dim only: it reduces it to [N] itself)."""
    x, w, b = _randn(2, 3, 4, seed=0, dtype=torch.float64), _randn(5, 4, seed=1, dtype=torch.float64), \
        _randn(5, seed=2, dtype=torch.float64)
    g = _randn(2, 3, 5, seed=3, dtype=torch.float64)
    w.requires_grad_(), b.requires_grad_()
    store = WeightGradStore()
    with deferring(store):
        (linear(x, w, b) * g).sum().backward()
    assert w.grad is None and b.grad is None and len(store.closures) == 1
    store.run()
    assert b.grad.shape == (5,)
    torch.testing.assert_close(b.grad, g.sum((0, 1)), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(w.grad, g.reshape(-1, 5).T @ x.reshape(-1, 4), atol=1e-12, rtol=1e-12)


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_linear_under_deferring_and_create_graph_computes_differentiable_grads_at_once():
    """backward(create_graph=True) inside ``deferring`` (a gradient penalty on the weights): nothing is
    deferred; the weight and bias gradients arrive at once, as graphs a second backward differentiates."""
    x = _randn(6, 4, seed=0, dtype=torch.float64)
    got, want = ([_randn(5, 4, seed=1, dtype=torch.float64).requires_grad_(),
                  _randn(5, seed=2, dtype=torch.float64).requires_grad_()] for _ in range(2))
    store = WeightGradStore()
    with deferring(store):
        linear(x, *got).pow(2).sum().backward(create_graph=True)
    assert not store.closures
    assert got[0].grad is not None and got[0].grad.requires_grad and got[1].grad.requires_grad
    F.linear(x, *want).pow(2).sum().backward(create_graph=True)
    for p, q in zip(got, want):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-12)
    second = torch.autograd.grad(got[0].grad.pow(2).sum(), got[1])
    torch.testing.assert_close(second[0], torch.autograd.grad(want[0].grad.pow(2).sum(), want[1])[0],
                               atol=1e-12, rtol=1e-12)


def test_w_run_under_autocast_computes_in_the_backwards_precision():
    """A schedule may run W inside ``torch.autocast``: the deferred products stay fp32, as the
    backward that deferred them would have computed them (bf16 would be off by ~1e-2 here)."""
    x, w = _randn(6, 32, seed=0), _randn(5, 32, seed=1).requires_grad_()
    g = _randn(6, 5, seed=2)
    store = WeightGradStore()
    with deferring(store):
        (linear(x, w) * g).sum().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        store.run()
    assert w.grad.dtype == torch.float32
    torch.testing.assert_close(w.grad, (g.double().T @ x.double()).float(), atol=1e-5, rtol=1e-5)
