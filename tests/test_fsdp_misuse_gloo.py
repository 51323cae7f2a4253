"""fsdp.shard refuses the uses that trained wrong without a word - a group that holds the model's
tensor-, context- or pipeline-parallel peers (the default, the world, under tp=2), a model attending
over a CP group whose parameters say nothing of it, a load into the wrapped model that the next
step undid, a shard inside a shard - each before any rank communicates; and at stages 1/2 ranks that
drew different initial weights compute their first step from what the optimizer trains."""
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import overlapkernels as ok
from comm_guard import no_communication
from overlapkernels.runtime import fsdp

SGD = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
CONFIG = dict(vocab_size=16, hidden=8, num_layers=1, num_heads=2, num_kv_heads=2, ffn_hidden=16, max_seq_len=8)


def _refusal(make):
    try:
        with no_communication():
            make()
    except (ValueError, RuntimeError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


@contextlib.contextmanager
def _agreement_as_a_local_raise():
    from overlapkernels.runtime.pipeline import runner

    def local(error, group, what, device):
        if error is not None:
            raise error

    real, runner.refuse_together = runner.refuse_together, local
    try:
        yield
    finally:
        runner.refuse_together = real


def _groups_holding_peers_on_rank():
    from overlapkernels.models import GPT, GPTConfig
    from overlapkernels.runtime import pipeline as pp

    said = []
    for layout in (dict(tp=2), dict(cp=2)):
        dims = ok.init_parallel(**layout)
        model = GPT(GPTConfig(**CONFIG), dims, dtype=torch.float64)
        said.append(_refusal(lambda: fsdp.shard(model, stage=1)))  # group=None: the world
        said.append(_refusal(lambda: fsdp.shard(model, dims.dp_group, stage=1)))  # the right group: accepted
    class ContrastiveLoss(nn.Module):  # a group of its own - the data-parallel one - is no TP group
        def __init__(self):
            super().__init__()
            self.proj, self.group = nn.Linear(4, 4), dist.group.WORLD

    said.append(_refusal(lambda: fsdp.shard(nn.Sequential(ContrastiveLoss()), stage=1)))
    dims = ok.init_parallel(pp=2)  # two stages alike in shape: nothing in the model tells them apart
    stage = fsdp.shard(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).double(), stage=2, optimizer=SGD)
    # a check of the rank's own stage: the ranks agree on it in one all-reduce (a rank that refused
    # alone would leave the others waiting in their first step), tested in test_pipeline.py; here
    # both refuse, each its own error: the agreement as a local raise, nothing else communicates
    with _agreement_as_a_local_raise():
        said.append(_refusal(lambda: pp.PipelineRunner(stage, dims.pp_group, schedule=pp.make_schedule("1f1b", 2, 2),
                                                       loss_fn=F.mse_loss)))
    return said


def test_groups_holding_model_parallel_peers_are_refused(rank_pool):
    for said in rank_pool(2).run(_groups_holding_peers_on_rank):
        tp, tp_ok, cp, cp_ok, own_group, pipe = said
        assert tp.startswith("ValueError: fsdp.shard: its group (global ranks [0, 1]) also holds ranks ") and \
            "of the tensor-parallel group of VocabParallelEmbedding 'embed'" in tp and "dims.dp_group" in tp, tp
        assert "of the context-parallel group of GPT '<model>'" in cp, cp
        assert tp_ok is None and cp_ok is None and own_group is None
        assert pipe.startswith("ValueError: PipelineRunner: a stage is fsdp-sharded over a group that holds ranks "), pipe


class CPNet(nn.Module):
    """A model of the layers with ring attention over a CP group - not the GPT, which tags itself."""

    def __init__(self, tp_group, cp_group):
        super().__init__()
        from overlapkernels.layers import TransformerBlock

        self.block = TransformerBlock(8, 2, 2, 16, tp_group, cp_group=cp_group, method="decomposed",
                                      dtype=torch.float64)

    def forward(self, x):
        return self.block(x)


def _context_parallel_layers_on_rank(stage):
    """Untagged: refused by name. Tagged with mark_context_parallel: one step equals the dense
    model's, on both CP ranks (the gradients were summed over CP)."""
    from overlapkernels.layers import mark_context_parallel
    from overlapkernels.ops.sequence_shard import shard_sequence

    g = torch.Generator().manual_seed(3)
    x, w = (torch.randn(8, 2, 8, generator=g, dtype=torch.float64) for _ in range(2))  # [S, B, H]
    one = ok.init_parallel()
    torch.manual_seed(0)
    dense = CPNet(one.tp_group, None)
    start = {k: v.clone() if torch.is_tensor(v) else v for k, v in dense.state_dict().items()}
    opt = SGD(dense.parameters())
    (dense(x) * w).sum().backward()
    opt.step()
    dims = ok.init_parallel(cp=2)
    model = CPNet(dims.tp_group, dims.cp_group)
    model.load_state_dict(start)
    untagged = _refusal(lambda: fsdp.shard(model, dims.dp_group, stage=stage, optimizer=SGD))
    with pytest.raises(TypeError, match="cp_group=ParallelDims.*expected the torch.distributed ProcessGroup"):
        mark_context_parallel(model, dims)
    mark_context_parallel(model, dims.cp_group)
    sharded = fsdp.shard(model, dims.dp_group, stage=stage, optimizer=SGD)
    x_local, w_local = (shard_sequence(t, dims.cp_group, dim=0, layout="zigzag") for t in (x, w))
    (sharded(x_local) * w_local).sum().backward()
    sharded.step()
    full = sharded.full_state_dict()
    same = all(torch.allclose(full[k], v, rtol=1e-12, atol=1e-12) for k, v in dense.state_dict().items()
               if torch.is_tensor(v))
    return untagged, same


@pytest.mark.parametrize("stage", [1, 3])
def test_context_parallel_layers_need_their_tags(rank_pool, stage):
    for untagged, same in rank_pool(2).run(_context_parallel_layers_on_rank, stage):
        assert untagged.startswith("ValueError: ParallelSelfAttention 'block.attn' attends over a "
                                   "context-parallel group of 2 ranks") and \
            "mark_context_parallel(model, cp_group)" in untagged, untagged
        assert same


def _load_and_nesting_on_rank(stage):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2).requires_grad_(False)).double()
    saved = {k: v + 1 for k, v in model.state_dict().items()}
    sharded = fsdp.shard(model, stage=stage, optimizer=SGD)
    load = _refusal(lambda: model.load_state_dict(saved))
    unit = _refusal(lambda: model[1].load_state_dict({k[2:]: v for k, v in saved.items() if k.startswith("1.")}))
    untouched = torch.equal(model[2].weight, saved["2.weight"] - 1)  # refused before anything loaded
    frozen = _refusal(lambda: model.load_state_dict({"2.weight": saved["2.weight"]}, strict=False))  # not trained
    untouched = untouched and torch.equal(model[2].weight, saved["2.weight"])
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    inner[1] = fsdp.shard(inner[1], stage=stage, optimizer=SGD)
    nested = _refusal(lambda: fsdp.shard(inner, stage=stage, optimizer=SGD))
    sharded(torch.ones(2, 4, dtype=torch.float64)).sum().backward()  # still in step on every rank
    sharded.step()
    return load, unit, frozen, untouched, nested


@pytest.mark.parametrize("stage", [1, 2])
def test_a_load_into_the_wrapped_model_and_a_shard_inside_a_shard_are_refused(rank_pool, stage):
    """Before, at stages 1/2 the load reached the gathered copy only and the next step put the old
    weights back (stage 3 refused it already); the outer shard took the inner one's parameters and
    its block never trained."""
    for load, unit, frozen, untouched, nested in rank_pool(2).run(_load_and_nesting_on_rank, stage):
        assert load == ("RuntimeError: load_state_dict() into Sequential after fsdp.shard, of the trained parameters "
                        f"0.bias, 0.weight, 1.bias ...: the optimizer trains master shards of them (stage {stage}), "
                        "which a load would not reach, so the next step would undo it. Load before fsdp.shard, or "
                        "use fsdp.load (frozen parameters and buffers load)"), load
        assert unit.startswith("RuntimeError: load_state_dict() into Linear after fsdp.shard, of the trained "
                               "parameters bias, weight:"), unit
        assert frozen is None and untouched
        assert nested == ("ValueError: fsdp.shard: Sequential already holds a ShardedModule at '1'; shard the whole "
                          "model once, and pick its units with units= (FSDP2's per-block fully_shard is "
                          "units=TransformerBlock here)"), nested


def _direct_step_and_cast_on_rank(stage):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    sharded = fsdp.shard(model, stage=stage, optimizer=SGD)
    schedule = torch.optim.lr_scheduler.StepLR(sharded.optimizer, step_size=1, gamma=0.5)
    sharded(torch.ones(2, 4, dtype=torch.float64)).sum().backward()
    direct = _refusal(lambda: sharded.optimizer.step())
    casts = [_refusal(cast) for cast in (lambda: sharded.to(torch.float32), lambda: sharded.half(),
                                         lambda: sharded.to(torch.float64), lambda: sharded.to("cpu"))]
    before = sharded.full_state_dict()
    sharded.step()  # the way to step: still in step on every rank, the scheduler too
    schedule.step()
    trained = not torch.equal(sharded.full_state_dict()["1.bias"], before["1.bias"])
    dtypes = {p.dtype for p in model.parameters()}
    return direct, casts, trained, sharded.optimizer.param_groups[0]["lr"], dtypes


@pytest.mark.parametrize("stage", [1, 3])
def test_stepping_the_optimizer_directly_and_casting_the_sharded_model_are_refused(rank_pool, stage):
    """Stepped directly (as GradScaler.step(opt) or a training framework does), the optimizer stepped
    gradients that only sharded.step() reduces, and at stages 1-2 the model never changed; a cast
    of the wrapped model replaced parameters that view the flat buffers (stages 1-2: trained
    nothing; stage 3: undone at the next gather). Both silently; now refused by name."""
    for direct, casts, trained, lr, dtypes in rank_pool(2).run(_direct_step_and_cast_on_rank, stage):
        assert direct.startswith("RuntimeError: SGD.step() called directly on an fsdp-sharded model's optimizer: "
                                 "it steps the master shards"), direct
        cast = ("RuntimeError: fsdp: moving or casting a sharded model (.to(), .half(), .cuda(), ...) would replace "
                "its parameters (the first: '0.weight'), which view fsdp's flat buffers")
        assert casts[0].startswith(cast) and casts[1].startswith(cast) and casts[2:] == [None, None], casts
        assert trained and lr == 0.05 and dtypes == {torch.float64}


def _different_initial_weights_on_rank(stage):
    """Each rank seeded differently: the optimizer trains a mixture (each rank's slice of its own
    draw); every stage's first training forward must compute with that mixture, as single-process
    training from it does (stages 1/2 used each rank's own draw for the first step)."""
    r = dist.get_rank()
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 3, generator=g, dtype=torch.float64))
            for _ in range(2)]
    torch.manual_seed(100 + r)
    sharded = fsdp.shard(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double(), stage=stage,
                         optimizer=SGD)
    ref = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    ref.load_state_dict(sharded.full_state_dict())
    opt = SGD(ref.parameters())
    if stage < 3 and r == 0:  # an eval on rank 0 alone before training: no collective, so no hang
        with torch.no_grad(), no_communication():
            sharded(data[0][0])
    for x, y in data:
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
        F.mse_loss(sharded(x[r * 4:(r + 1) * 4]), y[r * 4:(r + 1) * 4]).backward()
        sharded.step()
    full = sharded.full_state_dict()
    return all(torch.allclose(full[k], v, rtol=1e-12, atol=1e-12) for k, v in ref.state_dict().items())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_ranks_with_different_initial_weights_train_what_the_optimizer_holds(rank_pool, stage):
    assert rank_pool(2).run(_different_initial_weights_on_rank, stage) == [True, True]


def _clip_through_the_library_function_on_rank():
    """ok.clip_grad_norm_ given the ShardedModule clips as sharded.clip_grad_norm_ does (it returned 0
    at stage 3, where no parameter holds a gradient after backward, and clipped nothing); given the
    wrapped model's parameters (unreduced gradients at stage 1, none at 2/3) it refuses on every rank."""
    r = dist.get_rank()
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    F.mse_loss(ref(x), y).backward()
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
    results = []
    for stage in (1, 3):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        sharded = fsdp.shard(model, stage=stage, optimizer=SGD)
        F.mse_loss(sharded(x[r * 2:(r + 1) * 2]), y[r * 2:(r + 1) * 2]).backward()
        try:
            ok.clip_grad_norm_(model.parameters(), 0.01, dims=None)
            refused = None
        except TypeError as exc:
            refused = str(exc)
        norm = ok.clip_grad_norm_(sharded, 0.01, dims=None)
        torch.testing.assert_close(norm, want, atol=1e-12, rtol=1e-12)
        sharded.step()
        clipped = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
        clipped.load_state_dict({k: v - 0.1 * ref.state_dict(keep_vars=True)[k].grad for k, v in
                                 ref.state_dict().items()})  # SGD's first step (momentum starts from the gradient)
        full = sharded.full_state_dict()
        results.append((refused, all(torch.allclose(full[k], v, rtol=1e-12, atol=1e-12)
                                     for k, v in clipped.state_dict().items())))
    return results


def test_the_library_clip_takes_the_sharded_module_and_refuses_its_parameters(rank_pool):
    for results in rank_pool(2).run(_clip_through_the_library_function_on_rank):
        for refused, stepped_clipped in results:
            assert refused is not None and refused.startswith(
                "clip_grad_norm_: a parameter of a ShardedModule (fsdp.shard) was passed"), refused
            assert stepped_clipped
