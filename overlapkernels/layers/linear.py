"""Megatron-style tensor-parallel linears on the overlapped ops, [seq, batch, hidden] layout.

Weights follow ``megatron.core.tensor_parallel`` exactly (column: [out/P, in], partition dim 0;
row: [out, in/P], partition dim 1; same attributes and state-dict keys, ``_extra_state``
included), so per-rank state dicts interchange. Initialisation builds the full weight with
``init_method`` and keeps this rank's slice: every TP size starts from the same dense weights
(all ranks must share the RNG state, as with Megatron's CPU initialisation).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..ops._validate import check_flag, check_size
from ..ops.all_gather_matmul import all_gather_linear
from ..ops.dispatch import check_method
from ..ops.linear import linear
from ..ops.matmul_reduce_scatter import linear_reduce_scatter
from ..ops.tp_regions import copy_to_tp_region, gather_last_dim, reduce_from_tp_region, split_last_dim
from ..parallel import resolve_group
from .norm import mark_sequence_parallel
from .tags import KeepsTags, mark_tensor_parallel, remember_tensor_parallel


def default_init(weight: torch.Tensor) -> None:
    nn.init.normal_(weight, mean=0.0, std=0.02)  # Megatron's init_method_normal(0.02)


def divide(total: int, parts: int, what: str) -> int:
    total = check_size(total, what)
    if total % parts:
        raise ValueError(f"{what}={total} is not divisible by the tensor-parallel size {parts}")
    return total // parts


def check_input(layer: nn.Module, x, features: int, what: str) -> None:
    """The input's last dim, checked in the layer's own terms (the op would name its operands, or
    torch's matmul say only "mat1 and mat2 shapes cannot be multiplied"), before any communication."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{type(layer).__name__}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] != features:
        raise ValueError(f"{type(layer).__name__}: x.shape={tuple(x.shape)}, expected a last dim of {features} ({what})")


def sharded_parameter(full_shape, partition_dim: int, group, init_method, dtype, device) -> nn.Parameter:
    """This rank's slice of a full weight made by ``init_method``, tagged the way Megatron tags it.
    On the meta device only the slice's shape: no full weight drawn on the host (building on meta is
    for models too big to draw; their values come from a state dict after ``to_empty``)."""
    local_shape = list(full_shape)
    local_shape[partition_dim] //= dist.get_world_size(group)  # (divisibility checked by the layer)
    param = nn.Parameter(torch.empty(local_shape, dtype=dtype or torch.get_default_dtype(), device=device))
    if param.device.type != "meta":
        redraw_sharded_(param, partition_dim, group, init_method)
    mark_tensor_parallel(param, partition_dim)
    return param


def redraw_sharded_(param: torch.Tensor, partition_dim: int, group, init_method) -> None:
    """``param``, this rank's slice, drawn as construction draws it: the full weight by ``init_method``
    on the host in fp32, this rank's slice kept - so one seed gives one full weight at any TP size
    (Megatron's CPU initialisation)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    full_shape = list(param.shape)
    full_shape[partition_dim] *= world
    full = torch.empty(full_shape, dtype=torch.float32)
    (init_method or default_init)(full)
    with torch.no_grad():
        param.copy_(full.chunk(world, dim=partition_dim)[rank])


def local_matmul(x, weight, defer_weight_grad: bool):
    """``x @ weight.T`` on this rank: a plain matmul, or one whose weight gradient can wait for W."""
    return linear(x, weight) if defer_weight_grad else torch.matmul(x, weight.t())


def column_parallel(x, weights, biases, group, *, sequence_parallel: bool, method: str,
                    defer_weight_grad: bool = False):
    """``x @ w.T (+ b)`` for each weight of one column-parallel group sharing a single gather
    (QKV, gate/up). SP: x [S/P, B, in] through ``all_gather_linear``; else x [S, B, in] through
    Megatron's f (identity forward, all-reduce backward). ``defer_weight_grad``: see
    ``DefersWeightGrad``."""
    if sequence_parallel:
        # deferring, keep the gathered input for W: W then needs no all-gather of its own
        outs = all_gather_linear(x, weights, group, gather_dim=0, method=method, save_gathered=defer_weight_grad)
    else:
        x = copy_to_tp_region(x, group, grad_in_place=True)  # feeds only matmuls: their dgrads are fresh
        outs = [local_matmul(x, w, defer_weight_grad) for w in weights]
    # b.to(o.dtype): a no-op, except inside torch.autocast, where o is in its dtype (as F.linear's bias)
    return [o if b is None else o + b.to(o.dtype) for o, b in zip(outs, biases)]


class _MegatronExtraState:
    """Megatron modules carry an ``_extra_state`` entry (for TransformerEngine); accept and emit
    it so state dicts interchange both ways."""

    def get_extra_state(self):
        return None

    def set_extra_state(self, state):
        pass


class _MegatronSizes:
    """Megatron's names for the full sizes (``input_size``, ``output_size``), read by code written
    against its linears (adapters, checkpoint converters); torch's ``in_features``/``out_features``
    stay the stored ones. (``skip_bias_add`` is left out on purpose: forward returns a Tensor, where a
    Megatron linear returns ``(output, bias)`` whatever that flag says.)"""

    @property
    def input_size(self) -> int:
        return self.in_features

    @property
    def output_size(self) -> int:
        return self.out_features


class DefersWeightGrad:
    """A layer whose weight gradients a zero-bubble schedule's B can leave to its W.

    ``runtime.pipeline.enable_zero_bubble`` sets ``defer_weight_grad`` (the pipeline runner does,
    for schedules with W actions). Off, the default, the forward is the plain one. On, the matmuls
    without communication run as ``ops.linear``, and under sequence parallelism the all-gather
    keeps the gathered input [S, B, in] for W instead of the shard [S/P, B, in], per microbatch in
    flight: memory, so that W needs no communication. Inside ``deferring`` backward then computes
    the input gradients only and leaves the weight gradients (a local GEMM each) to W; biases get
    theirs in backward (a cheap sum). Under ``torch.autocast`` the matmuls see cast copies of the
    weights, whose gradients autograd must carry on: computed in backward, as without deferral."""

    defer_weight_grad = False


class ColumnParallelLinear(KeepsTags, DefersWeightGrad, _MegatronExtraState, _MegatronSizes, nn.Module):
    """Y = X A^T + b with A split by rows (output features) over the TP group."""

    def __init__(self, in_features, out_features, group=None, *, bias=True, gather_output=False,
                 sequence_parallel=False, method="auto", dtype=None, device=None, init_method=None):
        super().__init__()
        self.group = resolve_group(group)
        world = dist.get_world_size(self.group)
        self.in_features, self.out_features = check_size(in_features, "in_features"), out_features
        self.output_size_per_partition = divide(out_features, world, "out_features")
        bias = check_flag(bias, "bias")
        self.gather_output = check_flag(gather_output, "gather_output")
        self.sequence_parallel = sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
        self.method = check_method(method)
        if sequence_parallel and gather_output:
            raise ValueError("gather_output=True with sequence_parallel=True is not supported (as in Megatron)")
        self.init_method = init_method
        self.weight = sharded_parameter((out_features, in_features), 0, self.group, init_method, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition, dtype=self.weight.dtype,
                                                 device=self.weight.device))
            mark_tensor_parallel(self.bias, 0)
        else:
            self.register_parameter("bias", None)
        remember_tensor_parallel(self)

    def reset_parameters(self) -> None:
        """Redraw as construction did (after ``to_empty`` of a meta build): the same values for the
        same seed."""
        redraw_sharded_(self.weight, 0, self.group, self.init_method)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        check_input(self, x, self.in_features, "in_features")
        (out,) = column_parallel(x, [self.weight], [self.bias], self.group, sequence_parallel=self.sequence_parallel,
                                 method=self.method, defer_weight_grad=self.defer_weight_grad)
        return gather_last_dim(out, self.group) if self.gather_output else out

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.output_size_per_partition} per rank), sequence_parallel={self.sequence_parallel}, "
                f"method={self.method!r}")


class RowParallelLinear(KeepsTags, DefersWeightGrad, _MegatronExtraState, _MegatronSizes, nn.Module):
    """Y = X A^T + b with A split by columns (input features); b added once, after the reduction."""

    def __init__(self, in_features, out_features, group=None, *, bias=True, input_is_parallel=True,
                 sequence_parallel=False, method="auto", dtype=None, device=None, init_method=None):
        super().__init__()
        self.group = resolve_group(group)
        world = dist.get_world_size(self.group)
        self.in_features, self.out_features = in_features, check_size(out_features, "out_features")
        self.input_size_per_partition = divide(in_features, world, "in_features")
        bias = check_flag(bias, "bias")
        self.input_is_parallel = input_is_parallel = check_flag(input_is_parallel, "input_is_parallel")
        self.sequence_parallel = sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
        self.method = check_method(method)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True (as in Megatron)")
        self.init_method = init_method
        self.weight = sharded_parameter((out_features, in_features), 1, self.group, init_method, dtype, device)
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, dtype=self.weight.dtype, device=self.weight.device))
            # under SP each rank adds the bias to its own rows: its gradient is partial per rank
            mark_sequence_parallel(self.bias, sequence_parallel, self.group, owner=self)
        else:
            self.register_parameter("bias", None)
        remember_tensor_parallel(self)

    def reset_parameters(self) -> None:
        """As ``ColumnParallelLinear.reset_parameters``."""
        redraw_sharded_(self.weight, 1, self.group, self.init_method)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        if self.input_is_parallel:
            check_input(self, x, self.input_size_per_partition, "in_features / tensor-parallel size: input_is_parallel")
        else:
            check_input(self, x, self.in_features, "in_features")
            x = split_last_dim(x, self.group)
        if self.sequence_parallel:
            # the op checks x before communicating (inside its TORCH_DISTRIBUTED_DEBUG=DETAIL exchange, so
            # every rank hears of one rank's bad input); its errors are said here in the layer's terms
            try:
                out = linear_reduce_scatter(x, self.weight, self.group, scatter_dim=0, method=self.method)
            except ValueError as exc:
                raise ValueError(f"RowParallelLinear(sequence_parallel=True), which scatters x's dim 0 (the "
                                 f"sequence of [S, B, H]) over the tensor-parallel ranks: {exc}") from exc
        else:
            out = reduce_from_tp_region(local_matmul(x, self.weight, self.defer_weight_grad), self.group)
        return out if self.bias is None else out + self.bias.to(out.dtype)  # (autocast: see column_parallel)

    def extra_repr(self):
        return (f"in_features={self.in_features} ({self.input_size_per_partition} per rank), "
                f"out_features={self.out_features}, sequence_parallel={self.sequence_parallel}, method={self.method!r}")
