"""Gradients kept for a later reduction (stage 1, any stage under no_sync) are summed over the
backward passes in reduce_dtype where it is wider than the gradients, as FSDP2 does: bf16 compute
with fp32 reductions must not sum m microbatches in bf16 first. Checked exactly against the fp64
sum of the same bf16 per-microbatch gradients (fp32 sums of 16 such values are exact here)."""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkernels as ok
from overlapkernels.runtime import fsdp

MICRO = 16


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _full_master_grads(sharded) -> dict:
    """{unit name: the unit's reduced gradient, unsharded} (a collective over the unit's group)."""
    out = {}
    for unit in sharded.all_units:
        shards = [torch.empty_like(unit.master.grad) for _ in range(unit.world)]
        dist.all_gather(shards, unit.master.grad.contiguous(), group=unit.group)
        out[unit.name] = torch.cat(shards)[:unit.numel].double()
    return out


def _want(reference, grads_of, name) -> torch.Tensor:
    return torch.cat([grads_of[f"{name}.{k}"].reshape(-1) for k, _ in reference[int(name)].named_parameters()])


def _accumulate_on_rank(stage, planted_bf16_sum=False):
    r, w = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))
    reference.load_state_dict(net.state_dict())
    reference = reference.to(torch.bfloat16)  # what param_dtype computes with: the same bf16 gradients
    sharded = fsdp.shard(net, stage=stage, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, optimizer=_sgd)
    if planted_bf16_sum:  # the old behaviour: .grad sums the microbatches in bf16
        for unit in sharded.all_units:
            unit.stashes = lambda grad: False
    want = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in reference.named_parameters()}
    # the last microbatch alone, as after zero_grad
    last = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in reference.named_parameters()}
    stashed_between = []
    for k in range(MICRO):
        for q in range(w):  # every rank's data, for the reference (the mean over ranks)
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * k + q)).bfloat16()
            if q == r:  # stages 2/3: the last backward synced, reducing the stash and its own .grad together
                with sharded.no_sync() if stage > 1 and k < MICRO - 1 else contextlib.nullcontext():
                    sharded(x).float().pow(2).mean().backward()
                stashed_between.append(all(p.grad is None for p in net.parameters()))
            reference.zero_grad()
            reference(x).float().pow(2).mean().backward()
            for n, p in reference.named_parameters():
                want[n] += p.grad.double() / w
                if k == MICRO - 1:
                    last[n] += p.grad.double() / w
    sharded._finish_gradients()
    got = _full_master_grads(sharded)
    errors = {name: float((got[name] - _want(reference, want, name)).abs().max()) for name in got}
    # zero_grad forgets what was summed apart: one more microbatch, and only it is reduced
    sharded.zero_grad()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(100 * (MICRO - 1) + r)).bfloat16()
    with sharded.no_sync() if stage > 1 else contextlib.nullcontext():
        sharded(x).float().pow(2).mean().backward()
    sharded._finish_gradients()
    got = _full_master_grads(sharded)
    after_zero_grad = {name: float((got[name] - _want(reference, last, name)).abs().max()) for name in got}
    return errors, after_zero_grad, all(stashed_between) and not planted_bf16_sum


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unsynced_gradients_sum_in_the_reduce_dtype(rank_pool, stage):
    for errors, after_zero_grad, left_grad in rank_pool(2).run(_accumulate_on_rank, stage):
        assert errors == {"0": 0.0, "2": 0.0} and after_zero_grad == {"0": 0.0, "2": 0.0}, (errors, after_zero_grad)
        assert left_grad  # moved out of .grad, which held them in bf16


def test_the_planted_bf16_sum_is_caught(rank_pool):
    errors, _, _ = rank_pool(2).run(_accumulate_on_rank, 1, True)[0]
    assert min(errors.values()) > 1e-4, errors  # ~1e-3 off: 16 bf16 additions


def _sequence_parallel_on_rank():
    """A parameter tagged sequence-parallel (each TP rank holds a partial gradient, summed over the
    TP group before the DP reduction) whose gradients were summed apart: the TP sum covers them."""
    dims = ok.init_parallel(tp=2)  # 4 ranks: tp=2 x dp=2
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 4))
    reference = nn.Sequential(nn.Linear(8, 4))
    reference.load_state_dict(net.state_dict())
    reference = reference.to(torch.bfloat16)
    for p in net.parameters():
        p.sequence_parallel, p.sequence_parallel_group = True, dims.tp_group
    sharded = fsdp.shard(net, dims.dp_group, stage=1, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                         optimizer=_sgd)
    want = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in reference.named_parameters()}
    for k in range(4):
        for d in range(dims.dp_size):
            for t in range(dims.tp_size):
                x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * k + 10 * d + t)).bfloat16()
                if (d, t) == (dims.dp_rank, dims.tp_rank):
                    sharded(x).float().pow(2).sum().backward()
                reference.zero_grad()
                reference(x).float().pow(2).sum().backward()
                for n, p in reference.named_parameters():
                    want[n] += p.grad.double() / dims.dp_size  # summed over TP, averaged over DP
    assert all(p.grad is None for p in net.parameters())
    sharded._finish_gradients()
    got = _full_master_grads(sharded)
    return float((got["0"] - _want(reference, want, "0")).abs().max())


def test_sequence_parallel_gradients_summed_apart_are_summed_over_tp(rank_pool):
    assert rank_pool(4).run(_sequence_parallel_on_rank) == [0.0] * 4


def _zero_bubble_on_rank(stage, outer_no_sync=False, planted=False):
    """Pipeline ranks (pp=2, ZB-H1): what each W adds after its B's backward joins the reduce_dtype
    sum (``accumulate_grads``, called by the runner after each W); at stages 2/3 in the runner's
    own hold it is reduced after W (``reduce_grads``). Either way no bf16 sum over microbatches:
    exact against the fp64 sum of the same bf16 per-microbatch gradients."""
    from overlapkernels.runtime import pipeline as pp

    dims = ok.init_parallel(pp=2)
    torch.manual_seed(0)
    stages = lambda: nn.Sequential(nn.Sequential(nn.Linear(16, 32), nn.Tanh()),  # noqa: E731
                                   nn.Sequential(nn.Linear(32, 4), nn.LayerNorm(4)))
    dense, reference = stages(), stages().to(torch.bfloat16)
    reference.load_state_dict(dense.state_dict())
    # one unit per stage (a linear and the norm after it share one on stage 1)
    mine = nn.Sequential(dense[dims.pp_rank])
    sharded = fsdp.shard(mine, dims.dp_group, stage=stage, param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                         optimizer=_sgd, units=(nn.Sequential,))
    if planted:  # W's gradients left in .grad, summed there in bf16
        sharded.accumulate_grads = lambda: None
    stashed = []  # after each stash: the elements every unit holds apart

    def recording(stash):
        def recording_stash(i):
            stash(i)
            stashed.append(sum(u.stash.held_elements for u in sharded.all_units))
        return recording_stash
    for unit in sharded.all_units:
        unit.stash_grad = recording(unit.stash_grad)
    schedule = pp.make_schedule("zb-h1", 2, MICRO)
    runner = pp.PipelineRunner(sharded, dims.pp_group, schedule=schedule, loss_fn=lambda out, y: out.float().pow(2).mean())
    x = torch.randn(8 * MICRO, 16, generator=torch.Generator().manual_seed(3)).bfloat16()
    with sharded.no_sync() if outer_no_sync else contextlib.nullcontext():
        runner.step(x if dims.pp_rank == 0 else None, torch.zeros(8 * MICRO) if dims.pp_rank == 1 else None)
    want = [torch.zeros_like(p, dtype=torch.float64) for p in reference[dims.pp_rank].parameters()]
    for xs in x.chunk(MICRO):
        reference.zero_grad()
        (reference(xs).float().pow(2).mean() / MICRO).backward()
        for w, p in zip(want, reference[dims.pp_rank].parameters()):
            w += p.grad.double()
    want = torch.cat([w.reshape(-1) for w in want])
    deferred = sum(p.grad is not None for p in mine.parameters())  # what W left in .grad (none)
    # ZB-H1's closing Ws: one set of full gradients in flight, not one per W
    in_flight = max(len(u.pending_reduce) for u in sharded.all_units)
    sharded._finish_gradients()
    (got,) = _full_master_grads(sharded).values()
    error = float((got - want).abs().max() / want.abs().max())  # relative
    norm = sum(p.numel() for m in mine.modules() if isinstance(m, nn.LayerNorm) for p in m.parameters())
    # held through B (ZeRO-2/3 without a caller's no_sync): B stashes the norm's gradients only (the
    # linears leave theirs to W, reduced from .grad) - a whole-unit stash buffer would hold theirs too
    held_stash = max(stashed, default=0) == norm if stage > 1 and not outer_no_sync else True
    # in_flight: none under the caller's own no_sync (the runner holds and reduces only what it synced)
    return error, deferred, in_flight == 0 if outer_no_sync else in_flight <= 1, held_stash


@pytest.mark.parametrize("stage, outer_no_sync", [(1, False), (2, False), (3, False), (3, True)])
def test_zero_bubble_weight_gradients_sum_in_the_reduce_dtype(rank_pool, stage, outer_no_sync):
    assert rank_pool(2).run(_zero_bubble_on_rank, stage, outer_no_sync) == [(0.0, 0, True, True)] * 2


def test_a_planted_bf16_sum_of_zero_bubble_gradients_is_caught(rank_pool):
    """Only the last stage's, and small (3e-6 relative: two bf16 terms): stage 0 runs each W right
    after its B, and the next B's hooks stash what that W left; the last stage runs microbatch 0's
    W at the end, after the others' B and W, so two Ws' gradients meet in .grad. The exact tests
    above admit no error at all."""
    errors = [error for error, *_ in rank_pool(2).run(_zero_bubble_on_rank, 1, False, True)]
    assert errors[1] > 1e-7, errors


def test_the_stash_is_per_parameter_until_half_the_unit_waits_then_one_buffer_the_reduction_takes():
    """Few elements waiting (a held B's norms): per parameter, no buffer of the whole unit. Half or
    more (stage 1, no_sync): one padded buffer, handed to the reduce-scatter as its input - not a
    second full copy. Sums in the reduce dtype, exact either way."""
    from overlapkernels.runtime.fsdp.grad_stash import GradStash

    stash = GradStash([0, 2, 8], [2, 6, 1], 10, torch.float32, torch.device("cpu"))
    tiny = torch.tensor([2.0 ** -9, 1.0], dtype=torch.bfloat16)  # 1 + 2^-9 rounds to 1 in bf16, not in fp32
    stash.add(0, torch.ones(2, dtype=torch.bfloat16))
    stash.add(0, tiny)
    assert stash.flat is None and stash.held_elements == 2 and 0 in stash and 1 not in stash
    flat, indices = stash.take()
    assert indices == {0} and not stash and flat.tolist() == [1 + 2.0 ** -9, 2.0] + [0.0] * 8
    stash.add(2, torch.ones(1, dtype=torch.bfloat16))
    copies = []  # per-parameter copies made from here: the one that crosses half must not make one
    to = torch.Tensor.to
    torch.Tensor.to = lambda t, *a, **k: copies.append(t.shape) or to(t, *a, **k)
    try:
        stash.add(1, torch.full((6,), 3.0, dtype=torch.bfloat16))  # 7 of 9 elements: one buffer from here
    finally:
        torch.Tensor.to = to
    buffer = stash.flat
    assert buffer is not None and stash.held_elements == 10 and copies == [], copies
    stash.add(0, tiny)  # a later parameter's sum goes straight into the buffer
    stash.add(1, torch.ones(6, dtype=torch.bfloat16))
    flat, indices = stash.take()
    assert flat is buffer and indices == {0, 1, 2} and stash.flat is None
    assert flat.tolist() == [2.0 ** -9, 1.0] + [4.0] * 6 + [1.0, 0.0]
