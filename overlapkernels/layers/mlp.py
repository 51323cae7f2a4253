"""SwiGLU MLP: gate and up projections share one all-gather, down is row-parallel."""
from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..ops._validate import check_flag
from ..ops.dispatch import check_method
from ..parallel import resolve_group
from .linear import (DefersWeightGrad, RowParallelLinear, _MegatronExtraState, check_input, check_size, column_parallel,
                     divide, redraw_sharded_, sharded_parameter)
from .tags import KeepsTags, remember_tensor_parallel


class ParallelMLP(KeepsTags, DefersWeightGrad, _MegatronExtraState, nn.Module):
    """down(silu(x W_gate^T) * (x W_up^T)); W_gate, W_up [ffn/P, hidden] per rank, W_down [hidden, ffn/P].
    x and the output are [S/P, B, hidden] with sequence parallelism, [S, B, hidden] without."""

    def __init__(self, hidden, ffn_hidden, group=None, *, sequence_parallel=False, method="auto", dtype=None,
                 device=None, init_method=None):
        super().__init__()
        self.group = resolve_group(group)
        hidden, ffn_hidden = check_size(hidden, "hidden"), check_size(ffn_hidden, "ffn_hidden")
        divide(ffn_hidden, dist.get_world_size(self.group), "ffn_hidden")
        self.sequence_parallel = sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
        self.method = check_method(method)
        self.init_method = init_method
        self.gate_weight = sharded_parameter((ffn_hidden, hidden), 0, self.group, init_method, dtype, device)
        self.up_weight = sharded_parameter((ffn_hidden, hidden), 0, self.group, init_method, dtype, device)
        self.down = RowParallelLinear(ffn_hidden, hidden, self.group, bias=False, sequence_parallel=sequence_parallel,
                                      method=method, dtype=dtype, device=device, init_method=init_method)
        remember_tensor_parallel(self)

    def reset_parameters(self) -> None:
        """Redraw as construction did (gate, up, then down): the same values for the same seed."""
        for weight in (self.gate_weight, self.up_weight):
            redraw_sharded_(weight, 0, self.group, self.init_method)
        self.down.reset_parameters()

    def forward(self, x):
        check_input(self, x, self.gate_weight.shape[1], "hidden")
        gate, up = column_parallel(x, [self.gate_weight, self.up_weight], [None, None], self.group,
                                   sequence_parallel=self.sequence_parallel, method=self.method,
                                   defer_weight_grad=self.defer_weight_grad)
        return self.down(F.silu(gate) * up)
