"""fsdp.shard with the optimizer's param groups (fp64, 2 gloo ranks) vs the same optimizer on the
unsharded model: weight decay by shape or by name, an lr per group, a parameter in no group, the
model's frozen parameters in a group, state an optimizer makes in its constructor (Adagrad), and a
checkpoint resume."""
import pytest
import torch
import torch.distributed as dist

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import _batches, _loss, _net

STEPS, PER_RANK = 3, 4


def by_shape(model):
    """nanoGPT's recipe, over the parameters the factory is given: decay matrices only."""
    return lambda ps: torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.5},
                                         {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0,
                                          "lr": 3e-2}], lr=1e-2)


def by_name(model):
    """Hugging Face's recipe, over the model's own named parameters (frozen ones included, as
    ``model.parameters()`` would pass them; torch skips them): no decay for biases and norms, and
    ``out.bias`` in no group at all (torch leaves it as it is)."""
    def make(ps):
        named = [(n, p) for n, p in model.named_parameters() if n != "out.bias"]
        plain = [p for n, p in named if "bias" in n or "norm" in n]
        return torch.optim.AdamW([{"params": [p for n, p in named if not ("bias" in n or "norm" in n)]},
                                  {"params": plain, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.5)
    return make


def adagrad(model):
    """State made in the constructor (a nonzero initial sum per element), by shape per group, over
    ``model.parameters()``: the frozen ``inp.bias`` gets state too, which fsdp must drop."""
    return lambda ps: torch.optim.Adagrad([{"params": [p for p in model.parameters() if p.dim() >= 2]},
                                           {"params": [p for p in model.parameters() if p.dim() < 2], "lr": 0.2}],
                                          lr=0.1, initial_accumulator_value=0.3)


FACTORIES = {"by_shape": by_shape, "by_name": by_name, "adagrad": adagrad}


def _model():
    model = _net()
    model.inp.bias.requires_grad_(False)
    return model


def _reference(factory_name):
    model = _model()
    opt = FACTORIES[factory_name](model)(list(p for p in model.parameters() if p.requires_grad))
    for x, y in _batches(STEPS, PER_RANK, 2):
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _train(sharded, batches):
    rank = dist.get_rank()
    for x, y in batches:
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        _loss(sharded(x[mine]), y[mine]).backward()
        sharded.step()


def _grouped_on_rank(stage, factory_name):
    model = _model()
    sharded = fsdp.shard(model, stage=stage, optimizer=FACTORIES[factory_name](model))
    _train(sharded, _batches(STEPS, PER_RANK, 2))
    sharded.optimizer.state_dict()  # what fsdp.save reads: every state entry's key in a group
    return sharded.full_state_dict(), [u.name for u in sharded.all_units]


@pytest.mark.parametrize("factory_name", list(FACTORIES))
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_param_groups_train_as_without_fsdp(rank_pool, stage, factory_name):
    want = _reference(factory_name)
    for got, names in rank_pool(2).run(_grouped_on_rank, stage, factory_name):
        assert list(got) == list(want)
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
        if factory_name == "by_name":  # blocks hold weights, biases and norms; out.bias is in no group
            assert names == ["inp", "blocks#group0", "blocks#group1", "out#group0", "out#unoptimized", "<root>"], names
            assert torch.equal(got["out.bias"], _model().out.bias.detach())
        else:  # the root unit (scale, 0-d) sits in one group: no split
            assert names == ["inp", "blocks#group0", "blocks#group1", "out#group0", "out#group1", "<root>"], names
    # the groups matter: one group for all (the flat shards' old fate under a dim() test) trains otherwise
    model = _model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)
    for x, y in _batches(STEPS, PER_RANK, 2):
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    assert max((model.state_dict()[n] - want[n]).abs().max() for n in want) > 1e-4


def _resume_on_rank(path):
    batches = _batches(STEPS, PER_RANK, 2)
    model = _model()
    sharded = fsdp.shard(model, stage=2, optimizer=by_name(model))
    _train(sharded, batches[:1])
    fsdp.save(sharded, path)
    _train(sharded, batches[1:])
    model = _model()
    resumed = fsdp.shard(model, stage=2, optimizer=by_name(model))
    fsdp.load(resumed, path)
    _train(resumed, batches[1:])
    return sharded.full_state_dict(), resumed.full_state_dict(), resumed.optimizer.param_groups[1]["weight_decay"]


def _resume_alone_on_rank(path):
    """The 2 ranks' checkpoint on 1: the groups put the units in another order than the optimizer's
    indices (blocks#group1 last), so the moments reshard only if each index finds its own unit."""
    model = _model()
    resumed = fsdp.shard(model, stage=2, optimizer=by_name(model))
    fsdp.load(resumed, path)
    for x, y in _batches(STEPS, PER_RANK, 2)[1:]:  # the same global batches, on one rank
        _loss(resumed(x), y).backward()
        resumed.step()
    return resumed.full_state_dict()


def test_param_groups_survive_a_checkpoint(rank_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    for straight, resumed, decay in rank_pool(2).run(_resume_on_rank, path):
        assert decay == 0.0
        for name in straight:
            torch.testing.assert_close(resumed[name], straight[name], atol=0, rtol=0)
    (alone,) = rank_pool(1).run(_resume_alone_on_rank, path)
    for name in straight:
        torch.testing.assert_close(alone[name], straight[name], atol=1e-12, rtol=1e-12)


def _gather_order_on_rank():
    """Stage 3 with a block split into two param-group units: the order gathers are posted in."""
    import overlapkernels.runtime.fsdp.flat_unit as flat_unit
    from test_fsdp_gloo import Block

    model = _model()
    sharded = fsdp.shard(model, stage=3, units=(Block,), prefetch=1, optimizer=by_shape(model))
    names, posted, real = {id(u.flat): u.name for u in sharded.all_units}, [], flat_unit.all_gather_single

    def spy(out, inp, group=None, async_op=False):
        posted.append(names[id(out)] + " async" * async_op)
        return real(out, inp, group=group, async_op=async_op)

    flat_unit.all_gather_single = spy
    try:
        x, y = _batches(1, PER_RANK, 2)[0]
        out = sharded(x[:PER_RANK])
        forward, posted[:] = list(posted), []
        _loss(out, y[:PER_RANK]).backward()
    finally:
        flat_unit.all_gather_single = real
    return forward, posted


def test_stage_3_gathers_a_split_module_whole_before_prefetching(rank_pool):
    """Collectives of one group run in order: a module's second unit gathered behind the next
    module's prefetch would wait for it, and the prefetch would overlap nothing. (The root unit,
    the parameters outside the blocks, stays gathered.)"""
    def block(i, how=""):
        return [f"blocks.{i}#group0{how}", f"blocks.{i}#group1{how}"]

    for forward, backward in rank_pool(2).run(_gather_order_on_rank):
        assert forward == block(0) + block(1, " async") + block(2, " async"), forward
        assert backward == block(2) + block(1, " async") + block(0, " async"), backward


class _MatrixStateSGD(torch.optim.SGD):
    """Makes state in its constructor for matrices only, and some of its own (not per parameter)."""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self.state["global"] = {"count": 7}
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() >= 2:
                    self.state[p]["pre"] = torch.ones_like(p)


def _optimizer_edges_on_rank():
    """A refused shard() leaves the optimizer as built (one made outside the factory, to attach a
    scheduler first, still trains the model); state not keyed by a parameter is kept; named param
    groups get the units' names; Muon (2-D matrices only) is refused before training."""
    said = []
    model = _model()
    built = _MatrixStateSGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    params_before, state_before = list(built.param_groups[0]["params"]), dict(built.state)
    try:  # the blocks unit mixes matrices (with state) and vectors (without): one flat shard cannot hold it
        fsdp.shard(model, stage=2, optimizer=lambda ps: built)
    except ValueError as exc:
        said.append(str(exc).split(":")[1].strip())
    untouched = built.param_groups[0]["params"] == params_before and dict(built.state) == state_before
    weight = model.out.weight.detach().clone()
    _loss(model(torch.ones(2, 6, dtype=torch.float64)), torch.zeros(2, 3, dtype=torch.float64)).backward()
    built.step()
    untouched = untouched and not torch.equal(model.out.weight, weight)

    model = _model()
    kept = fsdp.shard(model, stage=2, optimizer=lambda ps: _MatrixStateSGD([p for p in ps if p.dim() >= 2], lr=0.1))
    kept = kept.optimizer.state["global"]

    model = _model()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    sharded = fsdp.shard(model, stage=2, optimizer=lambda ps: torch.optim.AdamW(
        [{"params": [(n, p) for n, p in named if p.dim() >= 2]},
         {"params": [(n, p) for n, p in named if p.dim() < 2], "weight_decay": 0.0}], lr=1e-2))
    names = [(g["param_names"], len(g["params"])) for g in sharded.optimizer.state_dict()["param_groups"]]

    if hasattr(torch.optim, "Muon"):
        try:
            fsdp.shard(_model(), stage=2, optimizer=lambda ps: torch.optim.Muon([p for p in ps if p.dim() == 2]))
        except ValueError as exc:
            said.append(str(exc)[:40])
    return said, untouched, kept, names


def test_optimizer_edge_cases(rank_pool):
    for said, untouched, kept, names in rank_pool(2).run(_optimizer_edges_on_rank):
        assert said[0] == "the optimizer made state for only some parameters of unit 'blocks' (or different keys)", said
        if hasattr(torch.optim, "Muon"):
            assert said[1] == "fsdp.shard: torch.optim.Muon steps 2-D m", said
        assert untouched, "a refused shard() changed the optimizer it was given"
        assert kept == {"count": 7}
        assert names == [(["inp", "blocks#group0", "out#group0"], 3), (["blocks#group1", "out#group1", "<root>"], 3)], \
            names


def _bf16_adagrad_on_rank(stage):
    model = _model().bfloat16()
    sharded = fsdp.shard(model, stage=stage, optimizer=adagrad(model))

    def dtypes():
        return {t.dtype for s in sharded.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()}
    made = dtypes()
    _train(sharded, _batches(2, PER_RANK, 2, torch.bfloat16))
    return made, dtypes()


@pytest.mark.parametrize("stage", [1, 3])
def test_state_made_in_the_constructor_of_a_bf16_model_is_kept_as_the_master(rank_pool, stage):
    """A bf16 model trains fp32 master shards: Adagrad's sums, made over the bf16 parameters, are
    sharded into fp32 too (kept bf16, they accumulated the squared gradients in bf16)."""
    assert rank_pool(2).run(_bf16_adagrad_on_rank, stage) == [({torch.float32}, {torch.float32})] * 2
