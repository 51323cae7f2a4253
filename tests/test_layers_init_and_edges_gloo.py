"""What the dense-twin tests cannot see: the initial weights (the twins load the same dense weights),
Megatron's tags in full, the bias under autocast, batches whose every target is ignored, and the
sequence lengths the GPT accepts or refuses under sequence parallelism."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkernels as ok
from comm_guard import no_communication
from overlapkernels.layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear,
                                   TransformerBlock, VocabParallelEmbedding)
from overlapkernels.models import GPT, GPTConfig, gather_dense_state_dict, shard_dense_state_dict
from overlapkernels.models.train import Trainer
from test_layers_gloo import F64, _groups

CONFIG = dict(vocab_size=16, hidden=16, num_layers=1, num_heads=4, num_kv_heads=2, ffn_hidden=32, max_seq_len=16)


def _init_on_rank():
    """One seed, one full weight at any TP size and dtype: the dense draw made in fp32 on the host,
    each rank keeping its own slice (Megatron's CPU initialisation), init_method applied to the
    whole weight, Megatron's init_method_normal(0.02) by default."""
    tp, one, world, rank = _groups()
    uniform = lambda w: nn.init.uniform_(w, -1.0, 1.0)  # noqa: E731
    makers = {
        "column": lambda grp, dt: ColumnParallelLinear(128, 32 * world, grp, dtype=dt),
        "row": lambda grp, dt: RowParallelLinear(32 * world, 128, grp, dtype=dt),
        "column, init_method": lambda grp, dt: ColumnParallelLinear(6, 4 * world, grp, dtype=dt, init_method=uniform),
        "embedding": lambda grp, dt: VocabParallelEmbedding(4 * world, 6, grp, dtype=dt),
        "mlp": lambda grp, dt: ParallelMLP(8, 4 * world, grp, dtype=dt),
        "attention": lambda grp, dt: ParallelSelfAttention(8 * world, 2 * world, world, grp, dtype=dt),
        "block": lambda grp, dt: TransformerBlock(8 * world, 2 * world, world, 4 * world, grp, dtype=dt),
    }
    for name, make in makers.items():
        torch.manual_seed(3)
        dense = make(one, torch.float32)
        torch.manual_seed(3)
        par = make(tp, F64)
        got = gather_dense_state_dict(par, tp)
        for key, want in dense.state_dict().items():
            if torch.is_tensor(want):
                assert torch.equal(got[key], want.to(F64)), f"{name}: {key} differs from the TP=1 fp32 draw"
    for name in ("column", "row"):
        torch.manual_seed(3)
        w = makers[name](tp, F64).weight
        full = torch.cat([t for t in _all_gather(w.detach())], dim=0 if name == "column" else 1)
        assert abs(float(full.std()) - 0.02) < 1e-3 and abs(float(full.mean())) < 1e-3, (name, float(full.std()))
    # the GPT: the same dense weights at TP=1 and TP=world (sequence parallel or not)
    config = GPTConfig(**CONFIG, method="baseline")
    torch.manual_seed(5)
    dense = GPT(config, ok.init_parallel(), dtype=F64).state_dict()
    torch.manual_seed(5)
    got = gather_dense_state_dict(GPT(config, ok.init_parallel(tp=world), dtype=F64))
    assert all(torch.equal(got[k], v) for k, v in dense.items() if torch.is_tensor(v))
    # pipeline stage 1 of 2 of a 4-layer GPT holds layers 2 and 3, drawn as the whole model's
    config = GPTConfig(**{**CONFIG, "num_layers": 4}, method="baseline")
    torch.manual_seed(5)
    dense = GPT(config, ok.init_parallel(), dtype=F64).state_dict()
    torch.manual_seed(5)
    stage = GPT(config, ok.init_parallel(tp=world), dtype=F64, pipeline_stage=(1, 2))
    assert list(stage.blocks) == ["2", "3"]
    got = gather_dense_state_dict(stage)
    assert all(torch.equal(v, dense[k]) for k, v in got.items() if torch.is_tensor(v))
    return True


def _all_gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return parts


def test_initial_weights_are_one_dense_draw_at_any_tp_size(rank_pool):
    assert rank_pool(2).run(_init_on_rank) == [True, True]


def _tags_and_autocast_on_rank():
    tp, one, world, rank = _groups()
    # Megatron's three tags on every TP-split parameter (its checkpoint and attribute-copy helpers
    # read partition_stride), on weights and the column-parallel bias alike
    col, row = ColumnParallelLinear(8, 4 * world, tp), RowParallelLinear(4 * world, 8, tp)
    for p, dim in ((col.weight, 0), (col.bias, 0), (row.weight, 1)):
        assert (p.tensor_model_parallel, p.partition_dim, p.partition_stride) == (True, dim, 1)
    assert not getattr(row.bias, "tensor_model_parallel", False)
    # a sequence-parallel embedding refuses, in its own terms and before communicating, a sequence
    # the TP size does not divide
    embed = VocabParallelEmbedding(4 * world, 6, tp, sequence_parallel=True)
    with no_communication(), pytest.raises(ValueError, match=rf"^sequence length 3 is not divisible by the "
                                                             rf"tensor-parallel size {world} \(sequence_parallel=True\)$"):
        embed(torch.zeros(2, 3, dtype=torch.long))
    # on a group of one rank every layout is the same: a layout tag that differs is no error there
    x = torch.arange(8.0).reshape(4, 2)
    part = ok.shard_sequence(x, one, dim=0, layout="zigzag")
    assert torch.equal(ok.unshard_sequence(part, one, dim=0, layout="contiguous"), x)
    # autocast: the output in the autocast dtype, as F.linear's (whose bias is cast too), bias included
    for sp in (False, True):
        torch.manual_seed(0)
        dense_col, par_col = (ColumnParallelLinear(8, 4 * world, g, sequence_parallel=sp and g is tp) for g in (one, tp))
        dense_row, par_row = (RowParallelLinear(4 * world, 8, g, sequence_parallel=sp and g is tp) for g in (one, tp))
        for dense, par in ((dense_col, par_col), (dense_row, par_row)):
            with torch.no_grad():
                dense.bias.copy_(torch.linspace(-1, 1, dense.bias.numel()))
            par.load_state_dict(shard_dense_state_dict(par, dense.state_dict(), tp))
        x = torch.randn(2 * world, 2, 8, generator=torch.Generator().manual_seed(1))
        rows = slice(rank * 2, rank * 2 + 2)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = par_col(x[rows] if sp else x)
            want = nn.functional.linear(x, dense_col.weight, dense_col.bias)
            z = par_row(y)
            want_z = nn.functional.linear(want, dense_row.weight, dense_row.bias)
        cols = slice(rank * 4, rank * 4 + 4)
        assert y.dtype == torch.bfloat16 and z.dtype == torch.bfloat16, (sp, y.dtype, z.dtype)
        torch.testing.assert_close(y.float(), want[..., cols].float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(z.float(), want_z[rows if sp else slice(None)].float(), atol=5e-2, rtol=5e-2)
    return True


def test_megatron_tags_and_the_bias_under_autocast(rank_pool):
    assert rank_pool(2).run(_tags_and_autocast_on_rank) == [True, True]


def _all_ignored_on_rank(layout):
    """A batch whose every target is ignore_index (all padding): loss 0 and zero gradients, not the
    NaN that 0/0 gives (which would reach every weight through the optimizer)."""
    config = GPTConfig(**CONFIG, method="baseline")
    tokens = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(2))
    targets = torch.full_like(tokens, config.ignore_index)
    torch.manual_seed(0)
    model = GPT(config, ok.init_parallel(**layout), dtype=F64)
    loss = model.loss(tokens, targets)
    loss.backward()
    model.sync_grads()
    assert float(loss) == 0.0, float(loss)
    assert all(torch.equal(p.grad, torch.zeros_like(p)) for p in model.parameters())
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    trainer = Trainer(config, ok.init_parallel(**layout), dtype=F64, optimizer=sgd, num_microbatches=1)
    before = {k: v.clone() for k, v in trainer.sharded.full_state_dict().items() if torch.is_tensor(v)}
    assert trainer.step(tokens, targets) == 0.0
    after = trainer.sharded.full_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    return True


@pytest.mark.parametrize("layout", [dict(tp=2), dict(cp=2)])
def test_a_batch_of_ignored_targets_has_zero_loss_and_gradient(rank_pool, layout):
    assert rank_pool(2).run(_all_ignored_on_rank, layout) == [True, True]


def _sp_lengths_on_rank():
    """tp=2 x cp=2 with SP, zigzag (and contiguous): 12 tokens give each CP rank 6 (two chunks of 3), each TP rank 3
    rows - odd, but the attention's halves are cut after the gather (6 rows): accepted, and equal to
    the dense GPT. 5 tokens at tp=2 (no CP) do not split over TP: refused by the GPT, naming the split,
    before any communication."""
    g = torch.Generator().manual_seed(4)
    tokens, targets = (torch.randint(0, 16, (2, 12), generator=g) for _ in range(2))
    for layout in ("zigzag", "contiguous"):
        config = GPTConfig(**CONFIG, method="baseline", cp_layout=layout)
        torch.manual_seed(0)
        dense = GPT(config, ok.init_parallel(), dtype=F64)
        want = dense.loss(tokens, targets)
        want.backward()
        model = GPT(config, ok.init_parallel(tp=2, cp=2), dtype=F64)
        model.load_state_dict(shard_dense_state_dict(model, dense.state_dict()))
        loss = model.loss(tokens, targets)
        loss.backward()
        model.sync_grads()
        torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-12, msg=lambda m: f"{layout}: {m}")
        grads = gather_dense_state_dict(model, grads=True)
        for name, p in dense.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, atol=1e-11, rtol=1e-10,
                                       msg=lambda m, n=name: f"{layout} {n}: {m}")
    sp_only = GPT(config, ok.init_parallel(tp=2), dtype=F64)
    with no_communication(), pytest.raises(ValueError, match=r"^sequence length 5 cannot be split: .* the per-rank "
                                                             r"length 5 by the TP size 2 under sequence parallelism$"):
        sp_only.loss(tokens[:, :5], targets[:, :5])
    return True


def test_sequence_parallel_lengths_under_zigzag_cp(rank_pool):
    assert rank_pool(4).run(_sp_lengths_on_rank) == [True] * 4


def _interleaved_schedule_on_rank():
    """interleaved 1F1B, two chunks per pipeline rank, each with its own optimizer: the lr schedule
    steps every chunk's optimizer, not only the first's."""
    config = GPTConfig(**{**CONFIG, "num_layers": 4}, method="baseline")
    halving = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)  # noqa: E731
    trainer = Trainer(config, ok.init_parallel(pp=2), schedule="interleaved-1f1b", num_virtual=2, dtype=F64,
                      lr_scheduler=halving)
    tokens = torch.randint(0, 16, (4, 8), generator=torch.Generator().manual_seed(1))
    trainer.step(tokens, tokens.roll(-1, 1))
    return [[group["lr"] for group in chunk.optimizer.param_groups] for chunk in trainer.chunks]


def test_the_lr_schedule_steps_every_chunks_optimizer(rank_pool):
    for lrs in rank_pool(2).run(_interleaved_schedule_on_rank):
        assert len(lrs) == 2 and all(lr == pytest.approx(5e-3) for chunk in lrs for lr in chunk), lrs


def test_a_second_derivative_inside_deferring_is_not_deferred():
    """backward(create_graph=True) inside ``deferring`` (a gradient penalty): ops.linear computes its
    weight and bias gradients now, as a graph, so the penalty differentiates them; none go to W."""
    from overlapkernels.ops.linear import linear
    from overlapkernels.ops.weight_grad_store import WeightGradStore, deferring

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*shape, generator=g, dtype=F64, requires_grad=True) for shape in ((3, 4), (5, 4), (5,)))
    store = WeightGradStore()
    with deferring(store):
        grads = torch.autograd.grad((linear(x, w, b) ** 2).sum(), (w, b), create_graph=True, allow_unused=True)
    assert not store.closures and all(gr is not None and gr.requires_grad for gr in grads)
    want = torch.autograd.grad((nn.functional.linear(x, w, b) ** 2).sum(), (w, b), create_graph=True)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=1e-12, rtol=1e-12)
    (gx,) = torch.autograd.grad(sum(gr.square().sum() for gr in grads), x)
    (want_gx,) = torch.autograd.grad(sum(gr.square().sum() for gr in want), x)
    torch.testing.assert_close(gx, want_gx, atol=1e-12, rtol=1e-12)


def _ignore_index_on_rank():
    """GPTConfig.ignore_index other than -100 (here 3, a real class id): those targets, and only they,
    leave the loss's mean - in GPT.loss (tp=2) and in the Trainer's step (dp=2)."""
    config = GPTConfig(**CONFIG, method="baseline", ignore_index=3)
    g = torch.Generator().manual_seed(6)
    tokens, targets = (torch.randint(0, 16, (2, 8), generator=g) for _ in range(2))
    targets[0, :3] = 3
    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=F64)
    with torch.no_grad():
        want = nn.functional.cross_entropy(dense(tokens).transpose(0, 1).reshape(-1, 16), targets.reshape(-1),
                                           ignore_index=3)
    model = GPT(config, ok.init_parallel(tp=2), dtype=F64)
    model.load_state_dict(shard_dense_state_dict(model, dense.state_dict()))
    torch.testing.assert_close(model.loss(tokens, targets), want, atol=1e-12, rtol=1e-12)
    trainer = Trainer(config, ok.init_parallel(dp=2), dtype=F64, dense_state_dict=dense.state_dict(),
                      num_microbatches=1)
    assert trainer.step(tokens, targets) == pytest.approx(float(want), rel=1e-12)
    return True


def test_a_configured_ignore_index_leaves_the_mean(rank_pool):
    assert rank_pool(2).run(_ignore_index_on_rank) == [True, True]
