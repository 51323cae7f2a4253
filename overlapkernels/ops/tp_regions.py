"""Megatron's tensor-parallel region operators (f, g and their sequence-parallel twins).

| op                        | forward                          | backward                         | Megatron name                              |
|---------------------------|----------------------------------|----------------------------------|--------------------------------------------|
| copy_to_tp_region         | identity                         | all-reduce                       | f, copy_to_tensor_model_parallel_region    |
| reduce_from_tp_region     | all-reduce                       | identity                         | g, reduce_from_tensor_model_parallel_region|
| gather_last_dim           | all-gather along the last dim    | keep this rank's slice           | gather_from_tensor_model_parallel_region   |
| split_last_dim            | keep this rank's slice           | all-gather along the last dim    | scatter_to_tensor_model_parallel_region    |
| reduce_scatter_first_dim  | reduce-scatter along dim 0       | all-gather along dim 0           | reduce_scatter_to_sequence_parallel_region |
| gather_first_dim          | all-gather along dim 0           | reduce-scatter along dim 0       | gather_from_sequence_parallel_region       |

Each backward applies its dual operator (the table's pairs are adjoint), so double backward
through a region is exact too.

The fused ops (all_gather_matmul, matmul_reduce_scatter) replace the last two wherever a GEMM
follows or precedes them; these stay for the places with no GEMM to hide behind.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ._autograd import not_a_view
from ._opaque import opaque_under_compile, resized


def _size(group) -> int:
    return dist.get_world_size(group)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_in_place):
        ctx.group, ctx.grad_in_place = group, grad_in_place
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if torch.is_grad_enabled() or not ctx.grad_in_place:  # create_graph: the dual op, so a second order is exact
            return _ReduceFromTP.apply(grad, ctx.group), None, None
        return C.all_reduce(grad.contiguous(), ctx.group)[0], None, None  # in place, as Megatron: no copy


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.all_reduce(x.contiguous().clone(), group)[0]

    @staticmethod
    def backward(ctx, grad):
        return _CopyToTP.apply(grad, ctx.group, False), None


def _gather_last(x, group):
    out, _ = C.all_gather(x.movedim(-1, 0).contiguous(), group)
    return out.movedim(0, -1).contiguous()  # laid out as Megatron's torch.cat is (callers .view() it)


def _split_last(x, group):
    part = x.chunk(_size(group), dim=-1)[dist.get_rank(group)]
    # a copy even where the part is contiguous already (leading dims of 1): .contiguous() would hand
    # back the caller's memory, and an in-place op on the result would change the caller's input
    return part.clone(memory_format=torch.contiguous_format)


class _GatherLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return not_a_view(_gather_last(x, group))  # (an in-place op on a Function's view output raises)

    @staticmethod
    def backward(ctx, grad):
        return _SplitLastDim.apply(grad, ctx.group), None


class _SplitLastDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return not_a_view(_split_last(x, group))

    @staticmethod
    def backward(ctx, grad):
        return _GatherLastDim.apply(grad, ctx.group), None


class _ReduceScatterFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return C.reduce_scatter(x, group)[0]

    @staticmethod
    def backward(ctx, grad):
        return _GatherFirstDim.apply(grad, ctx.group), None


class _GatherFirstDim(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return not_a_view(C.all_gather(x.contiguous(), group)[0])

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatterFirstDim.apply(grad, ctx.group), None


@opaque_under_compile(fake=lambda x, group, *, grad_in_place=False: x.new_empty(x.shape))  # takes a ProcessGroup: see _opaque
def copy_to_tp_region(x, group, *, grad_in_place=False):
    """``grad_in_place``: all-reduce the incoming gradient in place (Megatron's way, no copy). Only
    for outputs that feed ops whose input gradients are fresh tensors (a matmul): autograd hands the
    same gradient to every branch of a fan-out (``copy_to_tp_region(x) + r``), which would then see
    the sum over ranks too."""
    return _CopyToTP.apply(x, group, grad_in_place) if _size(group) > 1 else x


@opaque_under_compile(fake=lambda x, group: x.new_empty(x.shape))  # takes a ProcessGroup: see _opaque
def reduce_from_tp_region(x, group):
    return _ReduceFromTP.apply(x, group) if _size(group) > 1 else x


@opaque_under_compile(fake=lambda x, group: resized(x, -1, _size(group), True))  # takes a ProcessGroup: see _opaque
def gather_last_dim(x, group):
    return _GatherLastDim.apply(x, group) if _size(group) > 1 else x


@opaque_under_compile(fake=lambda x, group: resized(x, -1, _size(group), False))  # takes a ProcessGroup: see _opaque
def split_last_dim(x, group):
    size = _size(group)
    if size > 1 and (x.dim() == 0 or x.shape[-1] % size):  # same on every rank: refused before gathering
        raise ValueError(f"split_last_dim: x.shape={tuple(x.shape)}, whose last dim is not divisible by the group "
                         f"size {size}")
    return _SplitLastDim.apply(x, group) if size > 1 else x


@opaque_under_compile(fake=lambda x, group: resized(x, 0, _size(group), False))  # takes a ProcessGroup: see _opaque
def reduce_scatter_first_dim(x, group):
    return _ReduceScatterFirstDim.apply(x, group) if _size(group) > 1 else x


@opaque_under_compile(fake=lambda x, group: resized(x, 0, _size(group), True))  # takes a ProcessGroup: see _opaque
def gather_first_dim(x, group):
    return _GatherFirstDim.apply(x, group) if _size(group) > 1 else x
