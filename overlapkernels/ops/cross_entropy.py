"""Cross-entropy over vocabulary-parallel logits, never materialising the full vocabulary.

Each rank holds logits for its slice of the vocabulary, in rank order; slices may be uneven (a
vocabulary that does not divide, split with ``torch.tensor_split``). Two collectives over the group:
the max (for a stable softmax; every rank's slice width rides along, so each knows where its slice
starts and how large the vocabulary is), then one all-reduce of [sum of exp, target logit, sum of
logits] per token.
All math in fp32 (fp64 for fp64 logits). Matches ``F.cross_entropy(full_logits, target, reduction="none",
ignore_index=..., label_smoothing=...)``.
"""
from __future__ import annotations

import numbers

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..parallel import resolve_group
from ._autograd import first_order_only
from ._opaque import opaque_under_compile
from ._validate import check_float_dtype, check_ids, check_not_dtensor


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """| tensor       | shape        | forward                                   | backward                          |
    |--------------|--------------|-------------------------------------------|-----------------------------------|
    | logits_shard | [..., V/P]   | lse - (1-e) z_t - e mean(z), in fp32      | softmax - (1-e) onehot - e/V      |
    | target       | [...]        | global ids; ignore_index -> loss 0        |                                   |
    """

    @staticmethod
    def forward(ctx, logits_shard, target, group, ignore_index, label_smoothing):
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        z = logits_shard.to(torch.float64 if logits_shard.dtype == torch.float64 else torch.float32)
        per_rank = z.shape[-1]
        zmax = z.max(dim=-1).values
        if world > 1:
            # every rank's slice width, each at its rank (widths >= 1, so MAX assembles them): taking
            # one's own width for everyone's, uneven slices gave wrong losses, or a target check that
            # raised on some ranks while the others waited in this all-reduce
            widths = torch.zeros(world, dtype=zmax.dtype, device=zmax.device)
            widths[rank] = per_rank
            both = torch.cat([zmax.reshape(-1), widths])
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
            zmax, widths = both[:-world].view_as(zmax), both[-world:]
            start, vocab = widths[:rank].sum().long(), widths.sum()
        else:
            start, vocab = 0, per_rank
        # every rank holds the same vocabulary size now: they raise alike (on CUDA a device assert)
        check_target_ids(target, vocab, ignore_index)
        z = z - zmax.unsqueeze(-1)
        ignored = target == ignore_index
        local_t = target - start
        mine = (local_t >= 0) & (local_t < per_rank) & ~ignored
        # where(), not "* mine": a masked (-inf) logit at the clamped index would give -inf * 0 = NaN
        picked = torch.gather(z, -1, local_t.clamp(0, per_rank - 1).unsqueeze(-1)).squeeze(-1)
        z_target = torch.where(mine, picked, torch.zeros_like(picked))
        exp = torch.exp(z)
        sums = torch.stack([exp.sum(-1), z_target, z.sum(-1)])
        if world > 1:
            C.all_reduce(sums, group)
        sum_exp, z_t, sum_z = sums
        lse = torch.log(sum_exp)
        # without smoothing the smoothing term is left out, as F.cross_entropy does: with masked
        # (-inf) logits it is infinite, and 0 * inf would make the loss NaN
        loss = (1 - label_smoothing) * (lse - z_t)
        if label_smoothing > 0:
            loss = loss + label_smoothing * (lse - sum_z / vocab)
        loss = loss.masked_fill(ignored, 0.0)
        ctx.save_for_backward(exp / sum_exp.unsqueeze(-1), local_t, mine, ignored)
        ctx.label_smoothing, ctx.vocab, ctx.dtype = label_smoothing, vocab, logits_shard.dtype
        return loss

    @staticmethod
    @first_order_only("vocab_parallel_cross_entropy",
                      "its backward reads the softmax saved in forward, whose dependence on the logits (through "
                      "the other ranks' max and sum) autograd never saw")
    def backward(ctx, grad_loss):
        softmax, local_t, mine, ignored = ctx.saved_tensors
        grad = softmax - ctx.label_smoothing / ctx.vocab
        onehot = torch.zeros_like(grad).scatter_(-1, local_t.clamp(0, grad.shape[-1] - 1).unsqueeze(-1),
                                                 mine.unsqueeze(-1).to(grad.dtype))
        grad = grad - (1 - ctx.label_smoothing) * onehot
        # where, not a product: an ignored row's incoming gradient may be inf or NaN (torch gives 0 there)
        grad = grad * torch.where(ignored, 0, grad_loss).unsqueeze(-1)
        return grad.to(ctx.dtype), None, None, None, None


def check_target_ids(target: torch.Tensor, vocab, ignore_index: int) -> None:
    """Target ids in [0, vocab), or ``ignore_index``; ``vocab`` an int or a 0-d tensor on the
    target's device (read on the host only to name it in an error, on CPU)."""
    bad = ((target < 0) | (target >= vocab)) & (target != ignore_index)
    if isinstance(vocab, torch.Tensor) and not target.is_cuda:
        vocab = int(vocab)
    check_ids(target, bad, lambda first: ValueError(f"target holds ids outside [0, {vocab}) that are not "
                                                    f"ignore_index={ignore_index}, e.g. {first}"),
              f"vocab_parallel_cross_entropy: target ids outside [0, {vocab}), not ignore_index={ignore_index}")


def check_ignore_index(value, name: str = "ignore_index") -> int:
    """An int, as ``F.cross_entropy`` takes (a float such as 5.0 would ignore class 5, 1.5 nothing)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r}: expected an int (a target id to ignore, -100 by default)")
    return int(value)


@opaque_under_compile(  # takes a ProcessGroup: see _opaque; the loss in fp32 (fp64 for fp64 logits)
    fake=lambda logits_shard, target, *args, **kwargs: target.new_empty(
        target.shape, dtype=torch.float64 if logits_shard.dtype == torch.float64 else torch.float32))
def vocab_parallel_cross_entropy(logits_shard, target, group=None, *, ignore_index=-100, label_smoothing=0.0):
    """Per-token loss [...] from vocabulary-parallel logits [..., V/P] and global target ids [...].
    ``label_smoothing`` as ``F.cross_entropy``'s (eps spread over all V classes), whatever the TP size.
    Megatron-core's (0.16) differs: eps * v / (v - 1) over the mean log-probability of each rank's own
    slice of v = V / P entries, so its smoothed loss depends on the TP size and differs between ranks."""
    for name, t in (("logits_shard", logits_shard), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        check_not_dtensor(name, t)
    check_float_dtype("logits_shard", logits_shard)  # (F.cross_entropy refuses integer logits too)
    if logits_shard.dim() < 1:
        raise ValueError("logits_shard.shape=(): expected [..., V/P] (a vocabulary dimension last)")
    ignore_index = check_ignore_index(ignore_index)
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"target shape {tuple(target.shape)} must equal logits_shard.shape[:-1] "
                         f"{tuple(logits_shard.shape[:-1])}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target must be an integer tensor, got {target.dtype}")
    try:  # a number, or a 0-d tensor holding one (float() takes both); never a string
        smoothing = None if isinstance(label_smoothing, (str, bytes)) else float(label_smoothing)
    except (TypeError, ValueError, RuntimeError):
        smoothing = None
    if smoothing is None:
        raise TypeError(f"label_smoothing must be a float in [0, 1], got {type(label_smoothing).__name__} "
                        f"{label_smoothing!r}")
    label_smoothing = smoothing
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing}: expected a value in [0, 1]")
    group = resolve_group(group)
    if logits_shard.shape[-1] < 1:
        raise ValueError(f"logits_shard.shape={tuple(logits_shard.shape)}: every rank needs at least one vocabulary "
                         "entry")
    # the target ids are checked in forward, once every rank knows the whole vocabulary's size
    return _VocabParallelCrossEntropy.apply(logits_shard, target.long(), group, ignore_index, label_smoothing)
