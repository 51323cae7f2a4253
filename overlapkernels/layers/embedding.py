"""Vocabulary-parallel embedding (Megatron's VocabParallelEmbedding, same weight layout)."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..ops._validate import check_flag, check_ids
from ..ops.tp_regions import reduce_from_tp_region, reduce_scatter_first_dim
from ..parallel import resolve_group
from .linear import check_size, divide, redraw_sharded_, sharded_parameter
from .tags import KeepsTags, remember_tensor_parallel


def check_token_ids(tokens, num_embeddings: int) -> None:
    """What VocabParallelEmbedding takes: an integer tensor of ids in [0, num_embeddings)."""
    if not isinstance(tokens, torch.Tensor):
        raise TypeError(f"tokens must be a torch.Tensor of token ids, got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"tokens must be an integer tensor, got {tokens.dtype}")
    bad = (tokens < 0) | (tokens >= num_embeddings)  # nn.Embedding raises IndexError for these
    check_ids(tokens, bad, lambda first: IndexError(f"tokens hold ids outside [0, {num_embeddings}), e.g. {first}"),
              f"VocabParallelEmbedding: token ids outside [0, {num_embeddings})")


class VocabParallelEmbedding(KeepsTags, nn.Module):
    """weight [V/P, E]: rank r holds token ids [r V/P, (r+1) V/P). tokens [B, S] -> [B, S, E], or with
    ``sequence_parallel`` [S/P, B, E] (reduce-scattered along the sequence, as Megatron does).

    State dict: ``weight`` only, as Megatron's (unlike its linears, it has no ``_extra_state``)."""

    def __init__(self, num_embeddings, embedding_dim, group=None, *, sequence_parallel=False, dtype=None,
                 device=None, init_method=None):
        super().__init__()
        self.group = resolve_group(group)
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.num_embeddings, self.embedding_dim = num_embeddings, check_size(embedding_dim, "embedding_dim")
        per_rank = divide(num_embeddings, world, "num_embeddings")
        self.vocab_start_index, self.vocab_end_index = rank * per_rank, (rank + 1) * per_rank
        self.sequence_parallel = check_flag(sequence_parallel, "sequence_parallel")
        self.init_method = init_method
        self.weight = sharded_parameter((num_embeddings, embedding_dim), 0, self.group, init_method, dtype, device)
        remember_tensor_parallel(self)

    def reset_parameters(self) -> None:
        """Redraw as construction did: the same values for the same seed."""
        redraw_sharded_(self.weight, 0, self.group, self.init_method)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # our releases before 2026-11-30 saved an ``_extra_state`` (None) here: still load them strictly
        if prefix + "_extra_state" in state_dict:  # a copy: the caller's dict stays as it was
            state_dict = {k: v for k, v in state_dict.items() if k != prefix + "_extra_state"}
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, tokens):
        check_token_ids(tokens, self.num_embeddings)
        outside = (tokens < self.vocab_start_index) | (tokens >= self.vocab_end_index)
        local_ids = (tokens - self.vocab_start_index).masked_fill(outside, 0)
        out = self.weight[local_ids].masked_fill(outside.unsqueeze(-1), 0.0)  # other ranks own these rows
        if self.sequence_parallel:
            if tokens.dim() != 2:  # (alike on every rank: the ranks take the same tokens)
                raise ValueError(f"tokens of shape {tuple(tokens.shape)}: expected [batch, sequence] with "
                                 "sequence_parallel=True (the output is scattered along the sequence)")
            seq_first = out.transpose(0, 1).contiguous()
            if seq_first.shape[0] % dist.get_world_size(self.group):
                raise ValueError(f"sequence length {seq_first.shape[0]} is not divisible by the tensor-parallel size "
                                 f"{dist.get_world_size(self.group)} (sequence_parallel=True)")
            return reduce_scatter_first_dim(seq_first, self.group)
        return reduce_from_tp_region(out, self.group)
