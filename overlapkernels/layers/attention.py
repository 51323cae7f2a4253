"""Self-attention with heads split over TP, optional ring attention over a CP group, RoPE."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..kernels.ids import integer_ids
from ..ops._validate import check_flag
from ..ops.dispatch import check_method
from ..ops.local_attention import local_attention
from ..ops.ring_attention import ring_attention
from ..ops.ulysses_attention import check_heads, ulysses_attention
from ..ops.sequence_shard import check_layout, check_layout_tag, segments
from ..parallel import resolve_group
from .linear import (DefersWeightGrad, RowParallelLinear, _MegatronExtraState, check_input, check_size, column_parallel,
                     redraw_sharded_,
                     divide, sharded_parameter)
from .tags import KeepsTags, remember_tensor_parallel


def rope(x, positions, base: float = 10000.0):
    """Rotary embedding (Llama's rotate-half form) of x [S, B, H, D] at global ``positions`` [S]."""
    d = x.shape[-1]
    inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float64) / d))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None, None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None, None, :].to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


CP_ATTENTION = ("ring", "ulysses")


def check_cp_attention(value, name: str) -> str:
    if value not in CP_ATTENTION:
        raise ValueError(f"{name}={value!r}: expected one of {list(CP_ATTENTION)}")
    return value


class ParallelSelfAttention(KeepsTags, DefersWeightGrad, _MegatronExtraState, nn.Module):
    """Causal self-attention. QKV is column-parallel with one shared gather (H/P query heads and
    H_kv/P key/value heads per rank), the output projection row-parallel. With ``cp_group`` the
    sequence is also split over context-parallel ranks (laid out as ``cp_layout``) and attention
    runs as ``ring_attention``, or with ``cp_attention="ulysses"`` as ``ulysses_attention`` (the
    H/TP heads of a rank then split over CP, checked here); RoPE uses global positions either way. ``segment_ids`` (forward):
    packed documents, attention within each (RoPE's positions stay those of the packed row: its
    scores depend on distances only, so a document attends as it would alone); without CP through
    ``local_attention`` (on CUDA our flash kernels, which skip the tiles between documents)."""

    def __init__(self, hidden, num_heads, num_kv_heads=None, group=None, *, cp_group=None, cp_layout="zigzag",
                 sequence_parallel=False, method="auto", rope_base=10000.0, dtype=None, device=None,
                 init_method=None, cp_attention="ring"):
        super().__init__()
        self.group = resolve_group(group)
        tp = dist.get_world_size(self.group)
        hidden, num_heads = check_size(hidden, "hidden"), check_size(num_heads, "num_heads")
        num_kv_heads = num_heads if num_kv_heads is None else check_size(num_kv_heads, "num_kv_heads")
        if hidden % num_heads:
            raise ValueError(f"hidden={hidden} is not divisible by num_heads={num_heads}")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
        if (hidden // num_heads) % 2:
            raise ValueError(f"hidden={hidden} / num_heads={num_heads} gives an odd head dim {hidden // num_heads}: "
                             "rotary embeddings (RoPE) rotate pairs of dims, so the head dim must be even")
        self.heads = divide(num_heads, tp, "num_heads")
        self.kv_heads = divide(num_kv_heads, tp, "num_kv_heads")
        self.head_dim = hidden // num_heads
        # checked here, not at the first forward (after the QKV gather); a CP group of one rank splits
        # nothing: attention as without one (zigzag would otherwise refuse odd lengths for nothing)
        cp_group = None if cp_group is None else resolve_group(cp_group, "cp_group")
        self.cp_group = None if cp_group is None or dist.get_world_size(cp_group) == 1 else cp_group
        self.cp_layout = check_layout(cp_layout, "cp_layout")
        self.cp_attention = check_cp_attention(cp_attention, "cp_attention")
        if self.cp_group is not None and cp_attention == "ulysses":  # this rank's TP heads split over CP
            check_heads(self.heads, self.kv_heads, dist.get_world_size(self.cp_group),
                        f"each TP rank ({num_heads} heads / TP {tp})")
        self.sequence_parallel = sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
        self.method, self.rope_base = check_method(method), rope_base
        d = self.head_dim
        self.init_method = init_method
        self.q_weight = sharded_parameter((num_heads * d, hidden), 0, self.group, init_method, dtype, device)
        self.k_weight = sharded_parameter((num_kv_heads * d, hidden), 0, self.group, init_method, dtype, device)
        self.v_weight = sharded_parameter((num_kv_heads * d, hidden), 0, self.group, init_method, dtype, device)
        self.out = RowParallelLinear(hidden, hidden, self.group, bias=False, sequence_parallel=sequence_parallel,
                                     method=method, dtype=dtype, device=device, init_method=init_method)
        remember_tensor_parallel(self)

    def reset_parameters(self) -> None:
        """Redraw as construction did (q, k, v, then the output projection): the same values for the
        same seed, called on this layer."""
        for weight in (self.q_weight, self.k_weight, self.v_weight):
            redraw_sharded_(weight, 0, self.group, self.init_method)
        self.out.reset_parameters()

    def _check_length(self, x) -> None:
        """x's width (hidden) and, under zigzag CP, its length: two equal segments per rank, so an
        odd local length would only fail inside RoPE or the ring, after communicating. Checked here,
        before the QKV gather."""
        check_input(self, x, self.q_weight.shape[1], "hidden")
        if x.dim() != 3:
            raise ValueError(f"x must be [S, B, hidden], got shape {tuple(x.shape)}")
        if self.cp_group is not None:  # x straight from shard_sequence in another layout: wrong positions and masks
            check_layout_tag(x, "x", 0, self.cp_group, self.cp_layout, type(self).__name__)
        if self.cp_group is None or self.cp_layout != "zigzag":
            return
        tp = dist.get_world_size(self.group) if self.sequence_parallel else 1
        local = x.shape[0] * tp
        if local % 2:
            raise ValueError(f"local sequence length {local} (x.shape[0]={x.shape[0]}"
                             + (f" x TP size {tp} under sequence parallelism" if tp > 1 else "")
                             + f") is odd: cp_layout='zigzag' over a CP group of "
                             f"{dist.get_world_size(self.cp_group)} needs an even length per rank (two equal "
                             "segments; the global sequence divisible by 2 x CP size)")

    def positions(self, local_len: int, device) -> torch.Tensor:
        """Global positions of this rank's tokens (two segments each under zigzag CP)."""
        if self.cp_group is None:
            return torch.arange(local_len, device=device)
        world, rank = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        return torch.cat([torch.arange(start, start + n, device=device)
                          for _, start, n in segments(self.cp_layout, world, rank, local_len)])

    def _check_segments(self, x, segment_ids):
        """[B, S_local]: the batch and the sequence this rank attends over (the CP-local one; under
        sequence parallelism x holds 1/TP of it), before the QKV gather communicates."""
        if segment_ids is None:
            return
        if not isinstance(segment_ids, torch.Tensor):
            raise TypeError(f"{type(self).__name__}: segment_ids must be a torch.Tensor, got "
                            f"{type(segment_ids).__name__}")
        tp = dist.get_world_size(self.group) if self.sequence_parallel else 1
        want = (x.shape[1], x.shape[0] * tp)
        if tuple(segment_ids.shape) != want:
            raise ValueError(f"{type(self).__name__}: segment_ids.shape={tuple(segment_ids.shape)}, expected "
                             f"[B, S_local] = {list(want)} (x is [S, B, hidden]"
                             + (", S a TP share of S_local under sequence parallelism" if tp > 1 else "") + ")")
        if not integer_ids(segment_ids):
            raise TypeError(f"{type(self).__name__}: segment_ids.dtype={segment_ids.dtype}: expected integer ids")
        if segment_ids.device != x.device:  # (a copy per layer and forward, were it moved here)
            raise ValueError(f"{type(self).__name__}: segment_ids is on {segment_ids.device} but x is on {x.device}")
        if self.cp_group is not None:  # sharded in another layout: a wrong mask, refused before the gather
            check_layout_tag(segment_ids, "segment_ids", 1, self.cp_group, self.cp_layout, type(self).__name__)

    def forward(self, x, segment_ids=None):
        self._check_length(x)
        self._check_segments(x, segment_ids)
        q, k, v = column_parallel(x, [self.q_weight, self.k_weight, self.v_weight], [None] * 3, self.group,
                                  sequence_parallel=self.sequence_parallel, method=self.method,
                                  defer_weight_grad=self.defer_weight_grad)
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads, self.head_dim)
        k = k.view(s, b, self.kv_heads, self.head_dim)
        v = v.view(s, b, self.kv_heads, self.head_dim)
        pos = self.positions(s, x.device)
        q, k = rope(q, pos, self.rope_base), rope(k, pos, self.rope_base)
        if self.cp_group is not None:
            attend = ring_attention if self.cp_attention == "ring" else ulysses_attention
            ctx = attend(q, k, v, self.cp_group, causal=True, layout=self.cp_layout, qkv_format="sbhd",
                         segment_ids=segment_ids)
        elif segment_ids is not None:  # packed documents: no dense [B, 1, S, S] mask (see local_attention)
            ctx = local_attention(q, k, v, causal=True, qkv_format="sbhd", segment_ids=segment_ids)
        else:
            group = self.heads // self.kv_heads
            qt, kt, vt = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
            kt, vt = kt.repeat_interleave(group, 1), vt.repeat_interleave(group, 1)
            ctx = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).permute(2, 0, 1, 3)
        return self.out(ctx.reshape(s, b, self.heads * self.head_dim))
