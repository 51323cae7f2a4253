"""Clipping and loss scaling with dims=None (the norm or overflow flag agreed over the DP group
only) on models split over TP or PP: refused by name on every rank before any collective; CP and TP
groups of one pass."""
import pytest
import torch
from torch import nn

import overlapkernels as ok
from overlapkernels.runtime import fsdp


def _dims_none_on_split_models_on_rank():
    """dims=None agrees the norm / the overflow flag over the DP group alone: a model split over TP
    or PP gets one value per part (each TP rank clips its replicated norm weights by another
    factor, and they drift apart). Refused by name where our layers or the GPT say so, before any
    collective; CP (its ranks hold the same reduced gradients) and a TP group of one pass."""
    from comm_guard import no_communication
    from overlapkernels.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=16, hidden=8, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden=16,
                       max_seq_len=8, method="decomposed")
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(4))
    said = []
    for layout in (dict(tp=2, dp=2), dict(pp=2, dp=2)):
        dims = ok.init_parallel(**layout)
        stage = (dims.pp_rank, dims.pp_size)
        sharded = fsdp.shard(GPT(config, dims, dtype=torch.float64, pipeline_stage=stage), dims.dp_group, stage=2)
        scaler = fsdp.GradScaler()
        for call in (lambda: sharded.clip_grad_norm_(1.0), lambda: scaler.unscale_(sharded),
                     lambda: scaler.step(sharded)):
            try:
                with no_communication():
                    call()
            except ValueError as exc:
                said.append(str(exc))
    tp = ok.init_parallel(tp=2, dp=2)
    layer = fsdp.shard(nn.Sequential(ok.layers.ColumnParallelLinear(4, 4, tp.tp_group, dtype=torch.float64)), tp.dp_group)
    try:
        with no_communication():
            layer.clip_grad_norm_(1.0)
    except ValueError as exc:
        said.append(str(exc))
    # passed: a TP group of one rank (pure DP over the world), and CP
    alone = ok.init_parallel(dp=4)
    layer = fsdp.shard(nn.Sequential(ok.layers.ColumnParallelLinear(4, 4, alone.tp_group, dtype=torch.float64)))
    layer(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    layer.clip_grad_norm_(1.0)
    cp = ok.init_parallel(cp=2, dp=2)
    gpt = GPT(config, cp, dtype=torch.float64)
    sharded = fsdp.shard(gpt, cp.dp_group)
    gpt.loss(tokens, tokens).backward()
    norm = sharded.clip_grad_norm_(1e9)
    said.append(float(norm) == pytest.approx(float(sharded.clip_grad_norm_(1e9, dims=cp)), rel=1e-12))
    try:  # not sharded: dims=None takes every rank for a replica (refused after the norm's all-reduce)
        ok.clip_grad_norm_(GPT(config, tp, dtype=torch.float64), 1.0, dims=None)
    except ValueError as exc:
        said.append(str(exc))
    return said


def test_dims_none_on_a_model_split_over_tp_or_pp_is_refused(rank_pool):
    for rank, said in enumerate(rank_pool(4).run(_dims_none_on_split_models_on_rank)):
        stage = rank % 2  # dp=2 x pp=2 (dp the outer axis): ranks 0, 2 hold stage 0
        tp_pp = [(f"{op} with dims=None: {split}, so {quantity} over the data-parallel group alone "
                  f"would differ between its parts; pass dims= (the ParallelDims) so it spans the world")
                 for split in ("VocabParallelEmbedding 'embed' is split over a TP group of 2 ranks",
                               f"GPT is stage {stage} of a pipeline of 2")
                 for op, quantity in (("clip_grad_norm_", "the norm"), ("GradScaler.unscale_", "the overflow check"),
                                      ("GradScaler.step", "the overflow check"))]
        assert said[:6] == tp_pp, (rank, said)
        assert said[6] == ("clip_grad_norm_ with dims=None: ColumnParallelLinear '0' is split over a TP group of 2 "
                           "ranks, so the norm over the data-parallel group alone would differ between its parts; "
                           "pass dims= (the ParallelDims) so it spans the world"), said[6]
        assert said[7:] == [True, "clip_grad_norm_ with dims=None: VocabParallelEmbedding 'embed' is split over a TP "
                            "group of 2 ranks, but dims=None takes "
                            "every rank's gradients for data-parallel replicas, so the norm would be wrong; pass "
                            "dims= (the ParallelDims)"], said


def test_the_norm_is_summed_in_fp64_whatever_the_gradients_dtype(world_of_one):
    """A float16 gradient of norm 120000 (past float16's 65504): summed in fp64 the norm is finite,
    returned in float32 (at least), and clips by its true value; in float16 it was inf, and every
    gradient was scaled to 0."""
    p = nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    norm = ok.clip_grad_norm_([p], 60000.0, dims=None)
    assert norm.dtype == torch.float32 and float(norm) == 120000.0
    assert torch.equal(p.grad, torch.full((4,), 30000.0, dtype=torch.float16))  # halved
    wide = nn.Parameter(torch.zeros(2, dtype=torch.float64))
    wide.grad = torch.full((2,), 1.0 + 2.0 ** -40, dtype=torch.float64)  # (fp32 would round it to 1)
    p.grad = torch.zeros(4, dtype=torch.float16)
    norm = ok.clip_grad_norm_([p, wide], 1e9, dims=None)  # the widest dtype: float64
    assert norm.dtype == torch.float64 and float(norm) > 2 ** 0.5
    empty = nn.Parameter(torch.zeros(0))
    empty.grad = torch.zeros(0)  # a parameter with no elements: nothing to take the max of
    assert float(ok.clip_grad_norm_([empty, wide], 1e9, float("inf"), dims=None)) == 1.0 + 2.0 ** -40
