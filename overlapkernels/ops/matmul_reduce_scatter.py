"""Matmul + reduce-scatter: the row-parallel forward under sequence parallelism."""
from __future__ import annotations

import math
from functools import partial

import torch

from ..kernels.offsets import FUSED_DTYPES, fused_sizes_error
from ..parallel import resolve_group
from ..profiling.ranges import span
from . import _methods
from ._autocast import autocast_dtype, autocast_off, backward_without_autocast, cast_operands
from ._autograd import first_order_only, not_a_view
from ._collective_methods import accumulation_dtype
from ._opaque import opaque_under_compile
from ._validate import check_dim, check_float_dtype, check_tensor, check_weights, group_size, is_peer_world, same_call_on_every_rank
from .dispatch import check_method, choose, strict_active, strict_in_backward
from .measure import auto_mode, auto_setting, measured, wanted
from .weight_grad_store import defer

OP = "matmul_reduce_scatter"


def resolve(method: str, group, a2d: torch.Tensor, b: torch.Tensor, world: int, measurable: bool = False) -> str:
    """The method one matmul + reduce-scatter call runs (``auto`` resolved and recorded). One ring
    step computes a chunk [m, K] @ [K, N] and sends the running sum [m, N] (fp32 for 16-bit).
    ``measurable``: lets ``OVERLAPKERNELS_AUTO=measure`` time the candidates."""
    m, k, n = a2d.shape[0] // world, a2d.shape[1], b.shape[1]
    elem = torch.empty((), dtype=accumulation_dtype(a2d.dtype)).element_size()
    # (also what auto=measure may time: fused only where it can run)
    fused_fits = method != "auto" or (fused_sizes_error(m, k, n) is None and a2d.dtype in FUSED_DTYPES)
    measure = None
    if measurable and method == "auto" and auto_mode() == "measure" and not is_peer_world(group):
        key = (tuple(a2d.shape), tuple(b.shape), a2d.dtype, a2d.device)
        if wanted(OP, key, group):
            measure = partial(measured, OP, key, group, a2d.device,
                              lambda m_: _methods.matmul_rs(a2d.detach(), b.detach(), group, m_),
                              fused_fits=fused_fits)
    return choose(OP, method, world_size=world, rows_per_rank=m, step_bytes=m * n * elem, step_flops=2 * m * k * n,
                  device=a2d.device, peer_memory=is_peer_world(group), measure=measure, dtype=a2d.dtype,
                  fused_fits=fused_fits).method


class MatmulReduceScatter(torch.autograd.Function):
    """``out = RS_sum(a @ b)``: rank r keeps rows [r*m, (r+1)*m) of the sum over ranks (Megatron's
    reduce-scatter g-bar operator fused with the GEMM).

    | tensor | shape      | forward                  | dgrad (backward)                      | wgrad               |
    |--------|------------|--------------------------|---------------------------------------|---------------------|
    | a      | [W*m, K]   | partial a @ b per rank   | gather(grad_out) @ b.T: AG + GEMM     |                     |
    | b      | [K, N]     |                          |                                       | a.T @ gather(g_out) |
    | out    | [m, N]     | reduced chunk r          |                                       |                     |

    dgrad runs ``all_gather_matmul`` (the dual op, overlapped) and keeps the gathered gradient,
    which wgrad reuses, so backward communicates once. ``transposed``: the input is the weight
    w = b.T itself ([N, K], ``linear_reduce_scatter``), so that inside ``weight_grad_store.deferring``
    wgrad (local, given the gathered gradient) goes to W as a closure accumulating into it, keeping
    gather(grad_out) [W*m, N] alive until then.
    """

    @staticmethod
    def forward(ctx, a, w, group, method_requested, method, transposed):
        ctx.group, ctx.method_requested, ctx.strict, ctx.device = group, method_requested, strict_active(), a.device
        ctx.method, ctx.transposed = method, transposed  # method names backward's op range
        ctx.grad_targets = (w,)  # the weight itself: see weight_grad_store.defer
        ctx.save_for_backward(a, w)
        return _methods.matmul_rs(a, w.t() if transposed else w, group, method)

    @staticmethod
    @first_order_only("matmul_reduce_scatter")
    @backward_without_autocast
    def backward(ctx, grad_out):
        # an op window of its own, so `profile report` sees the dual op's overlap
        with span(f"ok/{OP}[{ctx.method}]/backward"):
            return MatmulReduceScatter._backward(ctx, grad_out)

    @staticmethod
    def _backward(ctx, grad_out):
        from .all_gather_matmul import resolve as ag_resolve

        a, w = ctx.saved_tensors
        b = w.t() if ctx.transposed else w
        group = ctx.group
        grad_out = grad_out.contiguous()
        with strict_in_backward(ctx.strict):
            # recorded too; measured (OVERLAPKERNELS_AUTO=measure) like a forward call
            # measured on the call that runs: with `a` frozen, a plain gather (no GEMM to overlap)
            weights = [b.T] if ctx.needs_input_grad[0] else []
            method = ag_resolve(ctx.method_requested, group, grad_out, b.shape[0], group_size(group), bs=weights)
        grad_full, outs = _methods.ag_matmul(grad_out, weights, group, method)
        grad_a = outs[0] if weights else None

        def wgrad():  # needs only a and the gathered gradient: no communication, may run at W
            grad_b = a.T @ grad_full
            return [grad_b.t() if ctx.transposed else grad_b]

        if not ctx.needs_input_grad[1] or defer(list(ctx.grad_targets), wgrad):
            return grad_a, None, None, None, None, None
        return grad_a, wgrad()[0], None, None, None, None


def _fake(a, b, group, scatter_dim, transposed):
    """The result's shape, for torch.compile (see ``_opaque``); the checks it rests on."""
    name = "x" if transposed else "a"
    check_tensor(name, a, min_dim=2)
    (b_kn,), _ = check_weights(b, a, name, linear=transposed, many=False)
    shape = [*a.shape[:-1], b_kn.shape[1]]
    dim = check_dim("scatter_dim", scatter_dim, a, name, last_ok=True)
    world = group_size(group)
    if shape[dim] % world:
        raise ValueError(f"the output's scatter_dim={scatter_dim} has size {shape[dim]}, not divisible by the "
                         f"group size {world}")
    shape[dim] //= world
    return a.new_empty(shape)


@opaque_under_compile(  # takes a ProcessGroup: see _opaque
    fake=lambda a, b, group=None, *, scatter_dim=0, method="auto": _fake(a, b, group, scatter_dim, False),
    casts=("a", "b"))
def matmul_reduce_scatter(a, b, group=None, *, scatter_dim=0, method="auto"):
    """``reduce_scatter_sum(a @ b, dim=scatter_dim)``: rank r keeps chunk r, with the reduction
    hidden behind the GEMM. ``a`` [..., K] (2+ dims); ``b`` [K, N]; ``scatter_dim`` any dim of
    the output [..., N] (the last: N), its size divisible by the group size."""
    return _matmul_reduce_scatter(a, b, group, scatter_dim, method, False)


@opaque_under_compile(  # takes a ProcessGroup: see _opaque
    fake=lambda x, weight, group=None, *, scatter_dim=0, method="auto": _fake(x, weight, group, scatter_dim, True),
    casts=("x", "weight"))
def linear_reduce_scatter(x, weight, group=None, *, scatter_dim=0, method="auto"):
    """``reduce_scatter_sum(x @ weight.T, dim=scatter_dim)`` (``F.linear``'s [N, K] layout, no
    bias): the row-parallel layer's op. Autograd sees the weight itself rather than a ``weight.T``
    view, so a zero-bubble B (``weight_grad_store.deferring``) leaves its gradient to W."""
    return _matmul_reduce_scatter(x, weight, group, scatter_dim, method, True)


def _matmul_reduce_scatter(a, b, group, scatter_dim, method, transposed):
    group = group if is_peer_world(group) else resolve_group(group)
    op = "linear_reduce_scatter" if transposed else "matmul_reduce_scatter"
    name = "x" if transposed else "a"  # as the public signature names it
    with same_call_on_every_rank(group, op, getattr(a, "device", None)) as call:
        check_tensor(name, a, min_dim=2)
        check_float_dtype(name, a)
        a, b = cast_operands(autocast_dtype(a.device), a, b)  # inside torch.autocast: its dtype, as a matmul
        (b_kn,), _ = check_weights(b, a, name, linear=transposed, many=False)  # [K, N]: what the methods multiply by
        dim = check_dim("scatter_dim", scatter_dim, a, name, last_ok=True)  # a dim of the output [..., N]
        method = check_method(method)
        world = group_size(group)
        over_n = dim == a.dim() - 1
        if over_n and b_kn.shape[1] % world:
            w_name, n_dim = ("weight", 0) if transposed else ("b", 1)
            raise ValueError(f"{w_name}.shape[{n_dim}]={b_kn.shape[1]} (N, the output's scatter_dim={scatter_dim}) is "
                             f"not divisible by the group size {world}")
        if not over_n and a.shape[dim] % world:
            raise ValueError(f"{name}.shape[scatter_dim={scatter_dim}]={a.shape[dim]} is not divisible by the group "
                             f"size {world}")
        _methods.check_available(method, group, a.device, a.dtype)
        rows = math.prod(a.shape[:-1])
        m, n = (b_kn.shape[1] // world, rows) if over_n else (rows // world, b_kn.shape[1])
        _methods.check_fused_sizes(method, m, a.shape[-1], n)
        call.args = dict(a=a, b=b_kn, scatter_dim=dim, method=method, **auto_setting(method))
    if over_n:
        return _scattered_over_n(a, b, b_kn, group, method, transposed)
    x = a.movedim(dim, 0)
    lead = x.shape[:-1]
    x2d = x.flatten(0, -2)  # [rows, K]; unlike reshape(-1, K) also for empty shards or K = 0
    with autocast_off(x2d.device):  # the methods choose their own precisions (fp32 partial sums)
        chosen = resolve(method, group, x2d, b_kn, world, measurable=True)
    with span(f"ok/matmul_reduce_scatter[{chosen}]"), autocast_off(x2d.device):
        out2d = MatmulReduceScatter.apply(x2d, b, group, method, chosen, transposed)
    out = out2d.view(lead[0] // world, *lead[1:], out2d.shape[-1]).movedim(0, dim).contiguous()
    return not_a_view(out)  # contiguous, like reduce_scatter's output


def _scattered_over_n(a, b, b_kn, group, method, transposed):
    """Scattered over N, the output's last dim: the same sum, transposed - ``(a @ b).T = b.T @ a.T``
    scattered over its rows - so every method runs as it does over M, with the weight as the
    rows' operand ([N, K]; ``linear_reduce_scatter``'s weight itself) and the activations'
    transpose as the [K, rows] one. Backward follows: the weight's gradient comes from the dual
    all-gather + GEMM, the activations' from the local GEMM (none is left to a zero-bubble W).
    The price of reusing the row-scatter path: transposed copies of the activations (saved for
    backward), of the output and, for ``matmul_reduce_scatter``, of ``b`` (no layer of ours
    scatters over N; the row-parallel one scatters the sequence)."""
    x2d = a.flatten(0, -2)
    w_nk = (b if transposed else b_kn.t()).contiguous()  # (linear: the leaf itself, contiguous already)
    x_kr = x2d.t().contiguous()  # the methods' kernels take the rows' operand [K, rows] contiguous
    with autocast_off(x2d.device):
        chosen = resolve(method, group, w_nk, x_kr, group_size(group), measurable=True)
    with span(f"ok/matmul_reduce_scatter[{chosen}]"), autocast_off(x2d.device):
        out_t = MatmulReduceScatter.apply(w_nk, x_kr, group, method, chosen, False)  # [N / world, rows]
    return not_a_view(out_t.t().reshape(*a.shape[:-1], out_t.shape[0]).contiguous())
