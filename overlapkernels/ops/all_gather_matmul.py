"""All-gather + matmul: the column-parallel forward under sequence parallelism."""
from __future__ import annotations

import math
from functools import partial

import torch

from ..kernels.offsets import FUSED_DTYPES, fused_sizes_error
from ..parallel import resolve_group
from ..profiling.ranges import span
from . import _methods
from ._autocast import autocast_dtype, autocast_off, backward_without_autocast, cast_operands, cast_weights
from ._autograd import first_order_only, not_a_view
from ._opaque import opaque_under_compile
from ._validate import check_dim, check_flag, check_float_dtype, check_tensor, check_weights, group_size, is_peer_world, same_call_on_every_rank
from .dispatch import check_method, choose, strict_active, strict_in_backward
from .measure import auto_mode, auto_setting, measured, wanted
from .weight_grad_store import defer

OP = "all_gather_matmul"


def resolve(method: str, group, x2d: torch.Tensor, n_total: int, world: int, bs=None) -> str:
    """The method one all-gather + matmul call runs (``auto`` resolved and recorded). One ring step
    moves a chunk [m, K] and multiplies it by [K, n_total]. ``bs`` (the operands): lets
    ``OVERLAPKERNELS_AUTO=measure`` time the candidates on these operands."""
    m, k = x2d.shape
    # (also what auto=measure may time: fused only where it can run)
    fused_fits = method != "auto" or (fused_sizes_error(m, k, n_total) is None and x2d.dtype in FUSED_DTYPES)
    measure = None
    if bs is not None and method == "auto" and auto_mode() == "measure" and not is_peer_world(group):
        key = (tuple(x2d.shape), tuple(tuple(b.shape) for b in bs), x2d.dtype, x2d.device)
        if wanted(OP, key, group):
            measure = partial(measured, OP, key, group, x2d.device,
                              lambda m_: _methods.ag_matmul(x2d.detach(), [b.detach() for b in bs], group, m_),
                              fused_fits=fused_fits)
    return choose(OP, method, world_size=world, rows_per_rank=m, step_bytes=m * k * x2d.element_size(),
                  step_flops=2 * m * k * n_total, device=x2d.device, peer_memory=is_peer_world(group),
                  measure=measure, dtype=x2d.dtype, fused_fits=fused_fits,
                  # an empty bs: backward's gather of a frozen input's dual op (alike on every rank)
                  gemm=bs is None or len(bs) > 0).method


class AllGatherMatmul(torch.autograd.Function):
    """``a_full = gather(a_shard)``; ``out_i = a_full @ b_i`` (Megatron's g operator fused with the GEMM).

    | tensor     | shape        | forward            | dgrad (backward)                          | wgrad                      |
    |------------|--------------|--------------------|-------------------------------------------|----------------------------|
    | a_shard    | [m, K]       | gathered, W ranks  | RS(sum_i grad_out_i @ b_i.T): GEMM + RS   |                            |
    | b_i        | [K, N_i]     | out_i = a_full@b_i |                                           | a_full.T @ grad_out_i      |
    | a_full     | [W*m, K]     | returned           | its grad is reduce-scattered too          |                            |
    | out_i      | [W*m, N_i]   |                    |                                           |                            |

    dgrad runs ``matmul_reduce_scatter`` (the dual op, overlapped); wgrad re-gathers the shard
    around the ring with per-chunk accumulation unless ``save_gathered`` kept ``a_full``.
    ``transposed``: the inputs are the weights w_i = b_i.T themselves ([N_i, K], ``all_gather_linear``),
    so that inside ``weight_grad_store.deferring`` with ``a_full`` kept, wgrad (a local GEMM then)
    goes to W as a closure accumulating into them; dgrad stays in backward, the critical path.
    """

    @staticmethod
    def forward(ctx, a_shard, group, method_requested, method, save_gathered, transposed, gathered_returned, *ws):
        bs = [w.t() for w in ws] if transposed else list(ws)
        a_full, outs = _methods.ag_matmul(a_shard, bs, group, method)
        ctx.group, ctx.method_requested, ctx.method = group, method_requested, method
        ctx.gathered_returned = gathered_returned
        ctx.save_gathered, ctx.strict, ctx.device = save_gathered, strict_active(), a_shard.device
        ctx.transposed, ctx.grad_targets = transposed, ws  # the weights themselves: see weight_grad_store.defer
        ctx.save_for_backward(a_full if save_gathered else a_shard, *ws)
        ctx.set_materialize_grads(False)
        if not ctx.needs_input_grad[0]:  # as torch.cat(all_gather(a)) of an a without gradient
            ctx.mark_non_differentiable(a_full)
        return (a_full, *outs)

    @staticmethod
    @first_order_only("all_gather_matmul")
    @backward_without_autocast
    def backward(ctx, grad_a_full, *grad_outs):
        # an op window of its own, so `profile report` sees the dual op's and wgrad's overlap
        with span(f"ok/{OP}[{ctx.method}]/backward"):
            return AllGatherMatmul._backward(ctx, grad_a_full, *grad_outs)

    @staticmethod
    def _backward(ctx, grad_a_full, *grad_outs):
        saved, *ws = ctx.saved_tensors
        bs = [w.t() for w in ws] if ctx.transposed else ws
        group, world = ctx.group, group_size(ctx.group)
        used = [i for i, g in enumerate(grad_outs) if g is not None]
        rows = saved.shape[0] * (1 if ctx.save_gathered else world)
        # Every rank runs the same traffic whichever outputs its own loss used (one rank's loss may
        # use only some of the outputs, or the gathered input besides): a missing gradient is zeros
        # here, as in ring_attention. Skipping by local use, or choosing 'auto' from the used
        # widths, would leave a peer alone in a collective, or pair its collective with our P2P.
        grad_a = None
        if ctx.needs_input_grad[0]:
            from .matmul_reduce_scatter import resolve as rs_resolve

            full = [g if g is not None else saved.new_zeros(rows, b.shape[1]) for g, b in zip(grad_outs, bs)]
            g = torch.cat(full, dim=1) if len(full) > 1 else full[0]
            bt = torch.cat([b.T for b in bs], dim=0) if len(bs) > 1 else bs[0].T
            with strict_in_backward(ctx.strict):
                # recorded in overlap_stats too; measured (OVERLAPKERNELS_AUTO=measure) like a forward call
                method = rs_resolve(ctx.method_requested, group, g, bt, world, measurable=True)
            grad_a = _methods.matmul_rs(g, bt, group, method)
            if ctx.gathered_returned:  # the caller had the gathered input: its gradient is reduce-scattered
                grad_a = grad_a + _methods.reduce_scatter(
                    grad_a_full if grad_a_full is not None else saved.new_zeros(rows, saved.shape[1]), group)
        wanted = [i for i in used if ctx.needs_input_grad[7 + i]]
        grad_ws = [None] * len(ws)

        def local_wgrads():  # needs only the kept a_full and grad_out: no communication, may run at W
            grads = [saved.T @ grad_outs[i] for i in wanted]
            return [g.t() for g in grads] if ctx.transposed else grads

        # The ring wgrad communicates: it runs on every rank where a weight needs a gradient, even
        # with no used output here (it then gathers and multiplies nothing), and never waits for W.
        # A weight whose output this rank's loss did not use keeps grad None, as in torch.
        if ctx.save_gathered:
            if wanted and not defer([ctx.grad_targets[i] for i in wanted], local_wgrads):
                for i, grad in zip(wanted, local_wgrads()):
                    grad_ws[i] = grad
        elif any(ctx.needs_input_grad[7:]):
            results = _methods.ag_wgrad(saved, [grad_outs[i] for i in wanted], group, ctx.method)
            for i, grad in zip(wanted, [r.t() for r in results] if ctx.transposed else results):
                grad_ws[i] = grad
        return (grad_a, None, None, None, None, None, None, *grad_ws)


def _fake(a_shard, b, group, gather_dim, return_gathered, transposed):
    """The results' shapes, for torch.compile (see ``_opaque``); the checks they rest on."""
    name = "x_shard" if transposed else "a_shard"
    check_tensor(name, a_shard, min_dim=2)
    bs, single = check_weights(b, a_shard, name, linear=transposed, many=True if transposed else None)
    shape = list(a_shard.shape)
    shape[check_dim("gather_dim", gather_dim, a_shard, name)] *= group_size(group)
    outs = [a_shard.new_empty([*shape[:-1], w.shape[1]]) for w in bs]
    result = outs[0] if single else outs
    return (a_shard.new_empty(shape), result) if return_gathered else result


def _unflatten(flat, a_shard, b, *args, return_gathered=False, **kwargs):
    outs = flat[1:] if return_gathered else flat
    result = outs[0] if isinstance(b, torch.Tensor) else list(outs)
    return (flat[0], result) if return_gathered else result


@opaque_under_compile(  # takes a ProcessGroup: see _opaque
    fake=lambda a_shard, b, group=None, *, gather_dim=0, return_gathered=False, method="auto", save_gathered=False:
    _fake(a_shard, b, group, gather_dim, return_gathered, False), unflatten=_unflatten, casts=("a_shard", "b"))
def all_gather_matmul(a_shard, b, group=None, *, gather_dim=0, return_gathered=False, method="auto",
                      save_gathered=False):
    """``torch.cat(all_gather(a_shard), dim=gather_dim) @ b``, with the gather hidden behind the GEMM.

    ``a_shard`` [..., K] (2+ dims, same shape on every rank); ``b`` a [K, N] tensor or a list of
    them sharing one gather (QKV, gate/up) -> a tensor or a list. ``return_gathered=True`` returns
    ``(gathered_a, out)``. ``save_gathered=True`` keeps the gathered input for the weight gradient
    instead of re-gathering it in backward (more memory, less communication).
    """
    return _all_gather_matmul(a_shard, b, group, gather_dim, return_gathered, method, save_gathered, False)


@opaque_under_compile(  # takes a ProcessGroup: see _opaque
    fake=lambda x_shard, weights, group=None, *, gather_dim=0, method="auto", save_gathered=False:
    _fake(x_shard, weights, group, gather_dim, False, True),
    unflatten=lambda flat, *args, **kwargs: list(flat), casts=("x_shard", "weights"))
def all_gather_linear(x_shard, weights, group=None, *, gather_dim=0, method="auto", save_gathered=False):
    """``[all_gather(x_shard) @ w.T for w in weights]`` (``F.linear``'s [N, K] layout, no bias): the
    column-parallel layers' op. Autograd sees the weights themselves rather than ``w.T`` views, so
    with ``save_gathered=True`` a zero-bubble B (``weight_grad_store.deferring``) leaves their
    gradients to W."""
    return _all_gather_matmul(x_shard, weights, group, gather_dim, False, method, save_gathered, True)


def _all_gather_matmul(a_shard, b, group, gather_dim, return_gathered, method, save_gathered, transposed):
    group = group if is_peer_world(group) else resolve_group(group)
    op = "all_gather_linear" if transposed else "all_gather_matmul"
    name = "x_shard" if transposed else "a_shard"  # as the public signature names it
    with same_call_on_every_rank(group, op, getattr(a_shard, "device", None)) as call:
        check_tensor(name, a_shard, min_dim=2)
        check_float_dtype(name, a_shard)
        # inside torch.autocast: run in its dtype, as a matmul would; the shard is cast before the
        # gather (half the traffic), so return_gathered gives the gathered input in that dtype too -
        # the tensor the GEMMs consumed, not torch.cat of the fp32 shards
        amp = autocast_dtype(a_shard.device)
        a_shard, b = cast_operands(amp, a_shard)[0], cast_weights(amp, b)
        bs, single = check_weights(b, a_shard, name, linear=transposed, many=True if transposed else None)
        gather_dim = check_dim("gather_dim", gather_dim, a_shard, name)
        method = check_method(method)
        if not isinstance(return_gathered, bool):
            raise TypeError(f"return_gathered={return_gathered!r}: expected a bool")
        save_gathered = check_flag(save_gathered, "save_gathered")  # ("no" is truthy: it saved)
        _methods.check_available(method, group, a_shard.device, a_shard.dtype)
        # the weights' total width: backward multiplies by all of them concatenated ([sum N, K])
        _methods.check_fused_sizes(method, math.prod(a_shard.shape[:-1]), a_shard.shape[-1],
                                   sum(w.shape[1] for w in bs))
        # save_gathered decides whether backward gathers again, return_gathered whether it reduce-
        # scatters the gathered tensor's gradient; gradients decide whether it runs at all
        call.args = dict(a_shard=a_shard, b=bs, gather_dim=gather_dim, method=method, save_gathered=save_gathered,
                         return_gathered=return_gathered, **auto_setting(method))
    world = group_size(group)

    x = a_shard.movedim(gather_dim, 0)
    lead = x.shape[:-1]
    x2d = x.flatten(0, -2)  # [rows, K]; unlike reshape(-1, K) also for empty shards or K = 0
    with autocast_off(x2d.device):  # the methods choose their own precisions (fp32 partial sums)
        chosen = resolve(method, group, x2d, sum(w.shape[1] for w in bs), world, bs=bs)
    with span(f"ok/all_gather_matmul[{chosen}]"), autocast_off(x2d.device):
        a_full, *outs = AllGatherMatmul.apply(x2d, group, method, chosen, save_gathered, transposed,
                                              return_gathered, *(b if transposed else bs))

    def restore(t2d):  # [W*m, n] -> the layout of a_shard, gathered along gather_dim (contiguous, like torch.cat)
        return t2d.view(world * lead[0], *lead[1:], t2d.shape[-1]).movedim(0, gather_dim).contiguous()

    # the products are not views (see not_a_view); the gathered input stays one, since backward
    # may have saved it and only a view shares its version counter (an in-place change then raises)
    outs = [not_a_view(restore(o)) for o in outs]
    result = outs[0] if single else outs
    return (restore(a_full), result) if return_gathered else result
