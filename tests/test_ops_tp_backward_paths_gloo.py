"""What the TP ops' backward runs and what their results alias, on gloo ranks: backward overlaps its
communication with the dual op of the forward's method (not a bare collective, which gives the same
numbers and would pass every numeric test), and a gathered input handed to the caller is never a
buffer a later call (or backward's re-gather) writes into. Each test here once passed every other
test with a plausible bug planted."""
import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok


def _ints(shape, seed):
    return torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(seed)).to(torch.float64)


def _dual_ops_on_rank():
    """Spies on the process-group methods: which of them the forward and the backward of each op
    run with method='decomposed'."""
    from overlapkernels.ops import _collective_methods as coll

    rank, world = dist.get_rank(), dist.get_world_size()
    ran, originals = [], {}
    names = ("ag_matmul_baseline", "ag_matmul_decomposed", "matmul_rs_baseline", "matmul_rs_decomposed", "ag_wgrad")
    for name in names:
        originals[name] = getattr(coll, name)

        def spy(*args, _name=name, **kwargs):
            ran.append(_name if _name != "ag_wgrad" else f"ag_wgrad[{args[-1]}]")
            return originals[_name](*args, **kwargs)

        setattr(coll, name, spy)
    try:
        # all_gather_matmul: the shard's gradient through matmul + reduce-scatter, b's by the ring re-gather
        a = _ints((3, 8), 10 + rank).requires_grad_()
        b = _ints((8, 5), 20 + rank).requires_grad_()
        out = ok.all_gather_matmul(a, b, method="decomposed")
        forward = list(ran)
        out.backward(_ints(out.shape, 30 + rank))
        ag_backward = ran[len(forward):]
        # matmul_reduce_scatter: a's gradient (and b's, reusing the gathered gradient) via all-gather + matmul
        a_rs = _ints((world * 3, 8), 40 + rank).requires_grad_()
        b_rs = _ints((8, 5), 50 + rank).requires_grad_()
        out_rs = ok.matmul_reduce_scatter(a_rs, b_rs, method="decomposed")
        mark = len(ran)
        out_rs.backward(_ints(out_rs.shape, 60 + rank))
        rs_backward = ran[mark:]
    finally:
        for name, fn in originals.items():
            setattr(coll, name, fn)
    return forward, ag_backward, rs_backward


def test_backward_overlaps_with_the_dual_op_of_the_forward_method(rank_pool):
    for forward, ag_backward, rs_backward in rank_pool(2).run(_dual_ops_on_rank):
        assert forward == ["ag_matmul_decomposed"], forward
        assert sorted(ag_backward) == ["ag_wgrad[decomposed]", "matmul_rs_decomposed"], ag_backward
        assert rs_backward == ["ag_matmul_decomposed"], rs_backward


def _gathered_kept_on_rank(method):
    """Two calls of one shape (two micro-batches, two layers) and a backward between them: the first
    call's gathered input must still hold what it gathered."""
    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [[_ints((4, 6), 100 * call + q) for q in range(world)] for call in range(3)]
    b = _ints((6, 2), 7)
    first, _ = ok.all_gather_matmul(shards[0][rank], b, return_gathered=True, method=method)
    x = shards[1][rank].clone().requires_grad_()
    w = b.clone().requires_grad_()
    second, out = ok.all_gather_matmul(x, w, return_gathered=True, method=method)
    out.sum().backward()  # w's gradient re-gathers x around the ring (save_gathered=False)
    third = ok.all_gather_matmul(shards[2][rank], [b], return_gathered=True, method=method)[0]
    for call, got in enumerate((first, second, third)):
        assert torch.equal(got, torch.cat(shards[call])), (method, call)
    assert torch.equal(w.grad, torch.cat(shards[1]).T @ torch.ones(world * 4, 2, dtype=torch.float64))
    return True


@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_a_gathered_input_is_never_overwritten_by_later_calls(rank_pool, method):
    assert rank_pool(2).run(_gathered_kept_on_rank, method) == [True, True]


def _deferred_linear_weights_on_rank(unused):
    """all_gather_linear with gate/up-like weights (one shape) keeping the gathered input: inside
    ``deferring`` each weight's gradient waits for W and must then reach that weight, not its twin."""
    from overlapkernels.ops.all_gather_matmul import all_gather_linear
    from overlapkernels.ops.weight_grad_store import WeightGradStore, deferring

    rank, world = dist.get_rank(), dist.get_world_size()
    shards = [_ints((4, 6), 200 + q) for q in range(world)]
    ws = [_ints((3, 6), 210 + i).requires_grad_() for i in range(3)]
    gs = [_ints((world * 4, 3), 220 + i) for i in range(3)]
    used = [i for i in range(3) if i != unused]
    store = WeightGradStore()
    with deferring(store):
        outs = all_gather_linear(shards[rank], ws, save_gathered=True, method="decomposed")
        torch.autograd.backward([outs[i] for i in used], [gs[i] for i in used])
    assert len(store.closures) == 1 and all(w.grad is None for w in ws)
    store.run()
    for i, w in enumerate(ws):
        want = None if i == unused else gs[i].T @ torch.cat(shards)
        assert (w.grad is None) if want is None else torch.equal(w.grad, want), (unused, i)
    return True


@pytest.mark.parametrize("unused", [None, 0])
def test_deferred_weight_grads_reach_their_own_weights(rank_pool, unused):
    assert rank_pool(2).run(_deferred_linear_weights_on_rank, unused) == [True, True]
