"""Interleaved pipelines with ZeRO over DP (as Megatron's interleaved schedule with its
distributed optimizer): each rank holds several model chunks, each sharded by fsdp.shard over the
DP group, run by one PipelineRunner; two optimizer steps against the unsharded model on the whole
batch (fp64, SGD with momentum: sensitive to the gradient's scale)."""
import pytest
import torch
import torch.nn.functional as F

import overlapkernels as ok
from overlapkernels.runtime import fsdp
from overlapkernels.runtime import pipeline as pp
from test_pipeline import WIDTH, _model, _stage


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _interleaved_zero_on_rank(kind, v, zero_stage, clip=None, scaled=False, poisoned_step=None):
    """``clip``: clip every step's gradients to this norm, the whole model's (all chunks of every
    rank), as torch clips the unsharded model's. ``scaled``: through fsdp.GradScaler, the loss scaled
    inside ``loss_fn`` (a power of two: exact in fp64, so the unscaled reference still holds, and a
    gradient left scaled shows under SGD). ``poisoned_step``: that step an inf lands in one element of
    the reduced gradient of one rank (pipeline stage 0, DP rank 0): every rank of the world must skip
    it, as the reference does."""
    dims = ok.init_parallel(pp=2, dp=2)
    p, m = dims.pp_size, 4
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, WIDTH, generator=g, dtype=torch.float64),
                torch.randn(8, WIDTH, generator=g, dtype=torch.float64)) for _ in range(2)]
    ref = _model(p * v)
    ref_opt, ref_norms, norms = _sgd(ref.parameters()), [], []
    for step, (x, y) in enumerate(batches):
        if step == poisoned_step:
            continue
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        if clip is not None:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
        ref_opt.step()

    model = _model(p * v)
    sched = pp.make_schedule(kind, p, m, num_virtual=v)
    stages = [sched.stage_of(dims.pp_rank, c) for c in range(v)]
    chunks = [fsdp.shard(_stage(model, s), dims.dp_group, stage=zero_stage, optimizer=_sgd) for s in stages]
    scaler = fsdp.GradScaler(init_scale=2.0 ** 10, enabled=scaled)
    runner = pp.PipelineRunner(chunks if v > 1 else chunks[0], dims.pp_group, schedule=sched,
                               loss_fn=lambda out, y: scaler.scale(F.mse_loss(out, y)))
    first, last = dims.pp_rank == 0, sched.rank_of(sched.num_stages - 1) == dims.pp_rank
    stepped = []
    for step, (x, y) in enumerate(batches):
        rows = slice(dims.dp_rank * 4, (dims.dp_rank + 1) * 4)  # this DP rank's half of the batch
        for chunk in chunks:
            chunk.zero_grad()
        runner.step(x[rows] if first else None, y[rows] if last else None)
        if clip is not None:
            scaler.unscale_(chunks, dims=dims)  # (a pass-through unless scaled)
            norms.append(fsdp.clip_grad_norm_(chunks, clip, dims=dims))
        if step == poisoned_step:
            for chunk in chunks:  # reduced (collective, every rank): the inf then is in one rank's shard only
                chunk._finish_gradients()
            if dims.pp_rank == 0 and dims.dp_rank == 0:
                chunks[0].all_units[0].master.grad[0] = float("inf")
        if scaled:  # every rank of the world decides alike (the stages' gradients are on other ranks)
            stepped.append(scaler.step(chunks, dims=dims))
            scaler.update()
        else:
            for chunk in chunks:
                chunk.step()
    for s, chunk in zip(stages, chunks):
        full = chunk.full_state_dict()
        for name, want in _stage(ref, s).state_dict().items():
            torch.testing.assert_close(full[name], want, atol=1e-12, rtol=1e-12,
                                       msg=lambda msg, n=name: f"stage {s} {n}: {msg}")
    for got, want in zip(norms, ref_norms):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    assert stepped == ([step != poisoned_step for step in range(len(batches))] if scaled else [])
    return True


@pytest.mark.parametrize("kind, v", [("interleaved-1f1b", 2), ("zb-h1", 1), ("zb-v", 2)])
@pytest.mark.parametrize("zero_stage", [1, 3])
def test_pipeline_chunks_sharded_over_dp_match_the_whole_model(rank_pool, kind, v, zero_stage):
    assert rank_pool(4).run(_interleaved_zero_on_rank, kind, v, zero_stage) == [True] * 4


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_clipping_spans_every_chunk_of_every_rank(rank_pool, zero_stage):
    """One call over this rank's chunks (fsdp.clip_grad_norm_): the norm of the whole model, and
    gradients clipped by it. Per chunk (ShardedModule.clip_grad_norm_) each chunk was clipped by
    its own chunk index's norm over the world: the first chunks went unclipped."""
    assert rank_pool(4).run(_interleaved_zero_on_rank, "interleaved-1f1b", 2, zero_stage, 0.05) == [True] * 4


def test_loss_scaling_with_chunks_of_a_pipeline(rank_pool):
    """fsdp.GradScaler over an interleaved pipeline's chunks: the loss scaled in loss_fn, the chunks
    unscaled before the clip and stepped together, as the unscaled whole model trains."""
    assert rank_pool(4).run(_interleaved_zero_on_rank, "interleaved-1f1b", 2, 3, 0.05, True) == [True] * 4


def test_an_overflow_on_one_stage_skips_the_step_of_every_stage(rank_pool):
    """The inf lands in one rank's shard of one stage: with dims=, the other stage's ranks (which
    never see it) skip too, as torch's scaler skips the whole model's step."""
    assert rank_pool(4).run(_interleaved_zero_on_rank, "interleaved-1f1b", 2, 1, None, True, 0) == [True] * 4
