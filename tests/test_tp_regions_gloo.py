"""Megatron's region operators (f/g and their sequence-parallel twins) on gloo ranks: first and
second derivatives against closed forms of the dense computation (fp64).

Each pair is used as a tensor-parallel model uses it: enter the region, a per-rank elementwise
cube times a per-rank weight, leave the region. The second order only comes out right when each
backward applies its dual operator differentiably (a raw collective in backward drops it).
"""
import pytest
import torch
import torch.distributed as dist

from comm_guard import no_communication
from overlapkernels.ops import tp_regions as R

TOL = dict(atol=1e-12, rtol=1e-12)


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


class _RawGatherFirstDim(torch.autograd.Function):
    """The planted error: the sequence-parallel gather with Megatron's backward, a raw
    reduce-scatter. First order is right; the second order misses its dual (an all-gather)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.new_empty(dist.get_world_size(group) * x.shape[0], *x.shape[1:])
        dist.all_gather_into_tensor(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(grad.shape[0] // dist.get_world_size(ctx.group), *grad.shape[1:])
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def _mixing_loss(y, c):
    """Quadratic in y and mixing its columns (other ranks' ones under split/gather last)."""
    return (c * y * y.flip(-1)).sum()


def _second_order_on_rank(pair, halves=False, quadratic=False):
    """y = x^3 W through the region pair; L = sum(c y), or with ``quadratic`` ``_mixing_loss``, whose
    second backward runs through the leaving op's backward too (checked against autograd on the
    dense maths)."""
    group = dist.group.WORLD
    if halves:  # two groups of 2 ranks (both created on every rank): each op must stay within its own
        group = [dist.new_group([0, 1]), dist.new_group([2, 3])][dist.get_rank() // 2]
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    m, d = 3, 2
    w = [_rand(10 + r, world * m, world * d) for r in range(world)]  # rank r's weight
    c, v = _rand(20, world * m, world * d), _rand(21, world * m, world * d)  # dL/dy and the 2nd-order probe
    x_full = _rand(22, world * m, world * d)
    rows, cols = slice(rank * m, (rank + 1) * m), slice(rank * d, (rank + 1) * d)
    if pair == "copy/reduce":  # x replicated; y = g(f(x)^3 * w_r) = x^3 * sum_r w_r, replicated
        x, c_mine, v_mine = x_full.clone().requires_grad_(), c, v
        y = R.reduce_from_tp_region(R.copy_to_tp_region(x, group) ** 3 * w[rank], group)
        w_full = sum(w)
    elif pair == "split/gather last":  # x replicated; each rank takes its columns
        x, c_mine, v_mine = x_full.clone().requires_grad_(), c, v
        y = R.gather_last_dim(R.split_last_dim(x, group) ** 3 * w[rank][:, cols], group)
        w_full = torch.cat([w[r][:, r * d:(r + 1) * d] for r in range(world)], dim=1)
    else:  # "gather/reduce-scatter first": x is this rank's rows (sequence parallel); y its rows too
        x, c_mine, v_mine = x_full[rows].clone().requires_grad_(), c[rows], v[rows]
        gather = R.gather_first_dim if pair == "gather/reduce-scatter first" else _RawGatherFirstDim.apply
        y = R.reduce_scatter_first_dim(gather(x, group) ** 3 * w[rank], group)
        w_full = sum(w)
    mine = rows if x.shape[0] < x_full.shape[0] else slice(None)
    w_seen = w_full[mine]
    (gx,) = torch.autograd.grad(_mixing_loss(y, c_mine) if quadratic else (y * c_mine).sum(), x, create_graph=True)
    (gx * v_mine).sum().backward()
    x_mine = x.detach()
    torch.testing.assert_close(y, x_mine ** 3 * w_seen, **TOL)
    if quadratic:  # the loss of the whole y is the sum of the ranks' (rows) or any rank's (replicated)
        x_dense = x_full.clone().requires_grad_()
        (g_dense,) = torch.autograd.grad(_mixing_loss(x_dense ** 3 * w_full, c), x_dense, create_graph=True)
        (g_dense * v).sum().backward()
        torch.testing.assert_close(gx, g_dense[mine], **TOL)
        torch.testing.assert_close(x.grad, x_dense.grad[mine], **TOL)
        return True
    torch.testing.assert_close(gx, 3 * x_mine ** 2 * w_seen * c_mine, **TOL)
    torch.testing.assert_close(x.grad, 6 * x_mine * w_seen * c_mine * v_mine, **TOL)
    return True


@pytest.mark.parametrize("ranks", [2, 4])
@pytest.mark.parametrize("pair", ["copy/reduce", "split/gather last", "gather/reduce-scatter first"])
def test_second_order_through_regions(rank_pool, pair, ranks):
    assert rank_pool(ranks).run(_second_order_on_rank, pair, ranks == 4) == [True] * ranks


def _planted_on_rank():
    with pytest.raises(AssertionError, match="Tensor-likes are not close"):
        _second_order_on_rank("planted raw reduce-scatter")
    return True


def test_planted_raw_collective_in_backward_is_caught(rank_pool):
    assert rank_pool(2).run(_planted_on_rank) == [True, True]


def _fan_out_on_rank():
    """Autograd hands one gradient tensor to both branches of an add: the region's all-reduce must
    not write into it, or the other branch sees the sum over ranks too."""
    h = torch.ones(3, dtype=torch.float64, requires_grad=True)
    x = torch.ones(3, dtype=torch.float64, requires_grad=True)
    r = h * 3  # recorded first, so its branch's backward runs after the region's
    z = R.copy_to_tp_region(x, dist.group.WORLD) + r
    (2 * z).sum().backward()
    return h.grad.tolist(), x.grad.tolist()


def test_copy_to_region_leaves_other_branches_gradients_alone(rank_pool):
    assert rank_pool(2).run(_fan_out_on_rank) == [([6.0] * 3, [4.0] * 3)] * 2


def _uneven_split_on_rank():
    """A last dim the group size does not divide: chunk() would give ranks different widths (or
    none), and the gather in backward would hang or abort a rank. Refused before communicating."""
    said = []
    for width in (1, 3):
        with no_communication(), pytest.raises(ValueError) as info:
            R.split_last_dim(torch.ones(2, width, requires_grad=True), dist.group.WORLD)
        said.append(str(info.value))
    return said


def test_split_last_dim_refuses_a_width_the_group_does_not_divide(rank_pool):
    want = [f"split_last_dim: x.shape=(2, {w}), whose last dim is not divisible by the group size 2" for w in (1, 3)]
    assert rank_pool(2).run(_uneven_split_on_rank) == [want, want]


@pytest.mark.parametrize("pair", ["copy/reduce", "split/gather last", "gather/reduce-scatter first"])
def test_second_order_through_the_leaving_ops_backward(rank_pool, pair):
    """The leaving op's backward (reduce's copy, gather_last_dim's split, reduce_scatter_first_dim's
    all-gather) must be its differentiable dual: a loss quadratic in the region's output makes the
    second backward differentiate through it, which the linear loss above never does (with a raw
    collective there, the second derivative silently loses every term through y)."""
    assert rank_pool(2).run(_second_order_on_rank, pair, False, True) == [True, True]


def _refused_splits_on_rank():
    said = []
    for x in (torch.tensor(1.0, requires_grad=True), torch.ones(2, 3)):
        with no_communication(), pytest.raises(ValueError) as info:
            R.split_last_dim(x, dist.group.WORLD)
        said.append(str(info.value))
    return said


def test_split_last_dim_refuses_a_scalar_by_name(rank_pool):
    """A 0-dim tensor has no last dim to split: the same ValueError as an uneven width, not torch's
    chunk() error from inside the autograd Function."""
    want = ["split_last_dim: x.shape=(), whose last dim is not divisible by the group size 2",
            "split_last_dim: x.shape=(2, 3), whose last dim is not divisible by the group size 2"]
    assert rank_pool(2).run(_refused_splits_on_rank) == [want, want]
