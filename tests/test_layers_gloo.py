"""Parallel layers vs their dense twins (the same class on a 1-rank group, same dense weights):
outputs, input gradients and (gathered) weight gradients, with and without sequence parallelism,
for every collective method. fp64 throughout."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import overlapkernels as ok
from overlapkernels.layers import (ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear,
                                   TransformerBlock, VocabParallelEmbedding, allreduce_sequence_parallel_grads)
from overlapkernels.models import gather_dense_state_dict, shard_dense_state_dict

TOL = dict(atol=1e-11, rtol=1e-11)
F64 = torch.float64


def _close(name, got, want):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _twins(make, tp_group, one_group):
    """(dense module on a 1-rank group, parallel module with the dense weights sharded in)."""
    torch.manual_seed(0)
    dense = make(one_group)
    with torch.no_grad():
        for p in dense.parameters():  # biases start at 0: randomise everything so every term is tested
            p.copy_(_randn(*p.shape, seed=p.numel()) * 0.3)
    par = make(tp_group)
    par.load_state_dict(shard_dense_state_dict(par, dense.state_dict(), tp_group), strict=True)
    return dense, par


def _run_pair(dense, par, x_full, x_local, g_full, g_local, *, out_local_of, x_grad_local_of, tp_group):
    xd = x_full.clone().requires_grad_()
    xp = x_local.clone().requires_grad_()
    yd, yp = dense(xd), par(xp)
    _close("out", yp, out_local_of(yd.detach()))
    (yd * g_full).sum().backward()
    (yp * g_local).sum().backward()
    allreduce_sequence_parallel_grads(par, tp_group)
    _close("input grad", xp.grad, x_grad_local_of(xd.grad))
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    for name, grad in gather_dense_state_dict(par, tp_group, grads=True).items():
        _close(f"grad {name}", grad, dense_grads[name])


def _groups():
    world = dist.get_world_size()
    return ok.init_parallel(tp=world).tp_group, ok.init_parallel().tp_group, world, dist.get_rank()


def _linears_on_rank(method):
    tp, one, world, rank = _groups()
    s, b, n_in, n_out = 3 * world, 2, 10, 4 * world
    x, g_col = _randn(s, b, n_in, seed=1), _randn(s, b, n_out, seed=2)
    rows = slice(rank * s // world, (rank + 1) * s // world)
    cols = slice(rank * n_out // world, (rank + 1) * n_out // world)
    for sp in (False, True):
        dense, par = _twins(lambda grp: ColumnParallelLinear(n_in, n_out, grp, sequence_parallel=sp and grp is tp,
                                                             method=method, dtype=F64), tp, one)
        _run_pair(dense, par, x, x[rows] if sp else x, g_col, g_col[..., cols], tp_group=tp,
                  out_local_of=lambda y: y[..., cols], x_grad_local_of=lambda gx: gx[rows] if sp else gx)
        dense, par = _twins(lambda grp: RowParallelLinear(n_out, n_in, grp, sequence_parallel=sp and grp is tp,
                                                          method=method, dtype=F64), tp, one)
        xr = _randn(s, b, n_out, seed=4)
        gr = _randn(s, b, n_in, seed=5)
        _run_pair(dense, par, xr, xr[..., cols], gr, gr[rows] if sp else gr, tp_group=tp,
                  out_local_of=lambda y: y[rows] if sp else y, x_grad_local_of=lambda gx: gx[..., cols])
    # gather_output and input_is_parallel=False (Megatron's other two modes)
    dense, par = _twins(lambda grp: ColumnParallelLinear(n_in, n_out, grp, gather_output=True, method=method,
                                                         dtype=F64), tp, one)
    _run_pair(dense, par, x, x, g_col, g_col, tp_group=tp, out_local_of=lambda y: y, x_grad_local_of=lambda gx: gx)
    dense, par = _twins(lambda grp: RowParallelLinear(n_out, n_in, grp, input_is_parallel=False, method=method,
                                                      dtype=F64), tp, one)
    xr, gr = _randn(s, b, n_out, seed=6), _randn(s, b, n_in, seed=7)
    _run_pair(dense, par, xr, xr, gr, gr, tp_group=tp, out_local_of=lambda y: y, x_grad_local_of=lambda gx: gx)
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["baseline", "decomposed", "auto"])
def test_linears_match_dense(rank_pool, world, method):
    assert rank_pool(world).run(_linears_on_rank, method) == [True] * world


def _blocks_on_rank(method):
    tp, one, world, rank = _groups()
    s, b, hidden = 2 * world, 2, 8 * world
    rows = slice(rank * s // world, (rank + 1) * s // world)
    x, g = _randn(s, b, hidden, seed=11), _randn(s, b, hidden, seed=12)
    makers = {
        "mlp": lambda grp, sp: ParallelMLP(hidden, 4 * world, grp, sequence_parallel=sp, method=method, dtype=F64),
        "attention": lambda grp, sp: ParallelSelfAttention(hidden, 2 * world, world, grp, sequence_parallel=sp,
                                                           method=method, dtype=F64),
        "block": lambda grp, sp: TransformerBlock(hidden, 2 * world, world, 4 * world, grp, sequence_parallel=sp,
                                                  method=method, dtype=F64),
    }
    for name, make in makers.items():
        for sp in (False, True):
            dense, par = _twins(lambda grp: make(grp, sp and grp is tp), tp, one)
            try:
                _run_pair(dense, par, x, x[rows] if sp else x, g, g[rows] if sp else g, tp_group=tp,
                          out_local_of=lambda y: y[rows] if sp else y,
                          x_grad_local_of=lambda gx: gx[rows] if sp else gx)
            except AssertionError as exc:
                raise AssertionError(f"{name}, sequence_parallel={sp}: {exc}") from None
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_mlp_attention_block_match_dense(rank_pool, world, method):
    assert rank_pool(world).run(_blocks_on_rank, method) == [True] * world


def _embedding_and_loss_on_rank():
    tp, one, world, rank = _groups()
    vocab, dim, b, s = 6 * world, 5, 2, 2 * world
    tokens = torch.randint(0, vocab, (b, s), generator=torch.Generator().manual_seed(3))
    for sp in (False, True):
        dense, par = _twins(lambda grp: VocabParallelEmbedding(vocab, dim, grp, sequence_parallel=sp and grp is tp,
                                                               dtype=F64), tp, one)
        for bad_id in (vocab, -1):  # as nn.Embedding: an IndexError, on every rank before communicating
            with pytest.raises(IndexError, match=rf"tokens hold ids outside \[0, {vocab}\), e.g. {bad_id}"):
                par(tokens.masked_fill(tokens == tokens[0, 0], bad_id))
        yd, yp = dense(tokens), par(tokens)
        want = F.embedding(tokens, dense.weight)
        _close("dense twin", yd, want)
        _close("embedding", yp, want.transpose(0, 1).chunk(world)[rank] if sp else want)
        g = _randn(*yp.shape, seed=4)
        yp.backward(g)
        full_g = (ok.unshard_sequence(g, tp, dim=0, layout="contiguous").transpose(0, 1) if sp else g)
        want_grad = torch.zeros(vocab, dim, dtype=F64).index_add_(0, tokens.reshape(-1), full_g.reshape(-1, dim))
        _close("embedding grad", par.weight.grad, want_grad.chunk(world)[rank])
    # vocabulary-parallel cross-entropy vs F.cross_entropy, ignore_index and label smoothing
    logits = _randn(3, 4, vocab, seed=5)
    target = torch.randint(0, vocab, (3, 4), generator=torch.Generator().manual_seed(6))
    target[0, 1] = target[2, 3] = -100
    for smoothing in (0.0, 0.1):
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full.reshape(-1, vocab), target.reshape(-1), reduction="none",
                               label_smoothing=smoothing).reshape(3, 4)
        shard = logits.chunk(world, -1)[rank].clone().requires_grad_()
        got = ok.vocab_parallel_cross_entropy(shard, target, tp, label_smoothing=smoothing)
        _close(f"loss (smoothing {smoothing})", got, want)
        w = _randn(3, 4, seed=7)
        (want * w).sum().backward()
        (got * w).sum().backward()
        _close(f"logits grad (smoothing {smoothing})", shard.grad, full.grad.chunk(world, -1)[rank])
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_embedding_and_cross_entropy_match_dense(rank_pool, world):
    assert rank_pool(world).run(_embedding_and_loss_on_rank) == [True] * world


def _bad_layers_on_rank():
    import re

    tp, _, world, _ = _groups()
    cases = [
        (lambda: ColumnParallelLinear(4, 3, tp), r"out_features=3 is not divisible by the tensor-parallel size 2"),
        (lambda: RowParallelLinear(3, 4, tp), r"in_features=3 is not divisible by the tensor-parallel size 2"),
        (lambda: ColumnParallelLinear(4, 4, tp, gather_output=True, sequence_parallel=True), r"gather_output=True"),
        (lambda: RowParallelLinear(4, 4, tp, input_is_parallel=False, sequence_parallel=True),
         r"needs input_is_parallel=True"),
        (lambda: VocabParallelEmbedding(7, 4, tp), r"num_embeddings=7 is not divisible"),
        (lambda: ParallelSelfAttention(8, 2, 1, tp), r"num_kv_heads=1 is not divisible by the tensor-parallel size 2"),
        (lambda: ParallelSelfAttention(8, 3, 1, tp), r"hidden=8 is not divisible by num_heads=3"),
        (lambda: ParallelMLP(8, 5, tp), r"ffn_hidden=5 is not divisible"),
        (lambda: ColumnParallelLinear(4, 4, tp, method="fast"), r"method='fast'"),
        (lambda: ok.vocab_parallel_cross_entropy(torch.ones(2, 3), torch.zeros(3, dtype=torch.long), tp),
         r"target shape \(3,\) must equal logits_shard.shape\[:-1\] \(2,\)"),
        (lambda: RowParallelLinear(4, 4, tp, sequence_parallel=True)(torch.ones(3, 1, 2)),
         r"a.shape\[scatter_dim=0\]=3 is not divisible by the group size 2"),
    ]
    for i, (make, pattern) in enumerate(cases):
        try:
            make()
        except ValueError as exc:
            assert re.search(pattern, str(exc)), (i, str(exc))
        else:
            raise AssertionError(f"case {i}: no ValueError")
    total = torch.ones(1)
    dist.all_reduce(total)
    return int(total)


def test_bad_layer_arguments(rank_pool):
    assert rank_pool(2).run(_bad_layers_on_rank) == [2, 2]


def _sp_tags_on_rank():
    """Layers tag their sequence-parallel parameters with the TP group, and the helper sums over
    that group by default (over the world, in TP=2 x DP=2, it would also sum over DP)."""
    from overlapkernels.layers import LayerNorm, RMSNorm

    dims = ok.init_parallel(tp=2)
    tp = dims.tp_group
    row = RowParallelLinear(4, 4, tp, sequence_parallel=True, dtype=F64)
    norms = [RMSNorm(4, sequence_parallel=True, group=tp, dtype=F64),
             LayerNorm(4, sequence_parallel=True, group=tp, dtype=F64)]
    tagged = [row.bias] + [p for n in norms for p in n.parameters()]
    assert all(p.sequence_parallel and p.sequence_parallel_group is tp for p in tagged)
    assert not hasattr(row.weight, "sequence_parallel_group")
    assert not hasattr(RMSNorm(4, sequence_parallel=True).weight, "sequence_parallel_group")  # no group given
    assert not hasattr(RMSNorm(4, group=tp).weight, "sequence_parallel_group")  # not sequence parallel
    module = torch.nn.ModuleList([row, *norms])
    for p in module.parameters():
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    assert allreduce_sequence_parallel_grads(module) == len(tagged)
    tp_sum = sum(r + 1 for r in dist.get_process_group_ranks(tp))
    assert all(torch.equal(p.grad, torch.full_like(p, float(tp_sum))) for p in tagged)
    assert torch.equal(row.weight.grad, torch.full_like(row.weight, float(dist.get_rank() + 1)))  # untouched
    return True


def test_sequence_parallel_tags_and_helper_group(rank_pool):
    assert rank_pool(4).run(_sp_tags_on_rank) == [True] * 4


def _tp_sum(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _block_under_fsdp2_on_rank(reshard_after_backward):
    """Our TP + SP block composed with torch's FSDP2 over DP (tp=2 x dp=2), as torchtitan-style
    clients do. FSDP2 swaps in DTensor parameters, dropping the attributes that tag the norms'
    partial gradients; the helper still finds them by name and sums each rank's local shard over
    TP, also when the module holds FSDP2's unsharded parameters after backward (no gradient there).
    ``ok.clip_grad_norm_(model)`` and ``gather_dense_state_dict`` likewise find the TP-split weights'
    dropped tags by name: the block's norm, each weight counted once, and its dense weights and
    gradients. Reference: the same block unwrapped, fed the whole batch."""
    from torch.distributed.fsdp import fully_shard

    from overlapkernels.layers import TransformerBlock

    dims = ok.init_parallel(tp=2, dp=2)
    tp, dp = dims.tp_group, dims.dp_size

    def make():
        torch.manual_seed(0)
        block = TransformerBlock(16, 4, 2, 32, tp, sequence_parallel=True, dtype=F64)
        with torch.no_grad():
            for p in block.parameters():  # norms start at 1: randomise so every term is tested
                p.copy_(p + 0.1 * _randn(*p.shape, seed=p.numel()))
        return block

    x = _randn(8, 4, 16, seed=3).chunk(2, dim=0)[dims.tp_rank]  # [S/tp, B, H]: SP splits the sequence
    ref, wrapped = make(), make()
    ref(x).sum().backward()
    allreduce_sequence_parallel_grads(ref)
    fully_shard(wrapped, mesh=dims.mesh["dp"])
    wrapped.set_reshard_after_backward(reshard_after_backward)
    wrapped(x.chunk(dp, dim=1)[dims.dp_rank]).sum().backward()  # DP splits the batch; FSDP2 averages
    partial = None
    if reshard_after_backward:  # the module holds the sharded parameters: their gradients before the sum
        partial = {n: p.grad.full_tensor() * dp for n, p in wrapped.named_parameters()}
    touched = allreduce_sequence_parallel_grads(wrapped)
    # the block's whole gradient norm, by hand: TP-split weights summed over TP, the rest counted once
    want = dict(ref.named_parameters())
    squares = sum((p.grad.double() ** 2).sum() if not getattr(p, "tensor_model_parallel", False)
                  else _tp_sum((p.grad.double() ** 2).sum(), tp) for p in want.values())
    ref_norm = squares.sqrt() / dp  # FSDP2 averages the DP ranks' gradients of their halves of the batch
    # our clip finds the TP tags FSDP2 dropped (by name) and the gradients on its sharded parameters
    norm = ok.clip_grad_norm_(wrapped, ref_norm.item() / 4, dims=dims)
    _close("norm", norm, ref_norm)
    coef = (ref_norm / 4) / (ref_norm + 1e-6)  # torch's clip coefficient: every gradient scaled by it
    # the dense export: DTensors gathered over DP, then TP-split weights (tags found by name) over TP
    want_dense, want_grads = gather_dense_state_dict(ref, tp), gather_dense_state_dict(ref, tp, grads=True)
    got_dense, got_grads = gather_dense_state_dict(wrapped, tp), gather_dense_state_dict(wrapped, tp, grads=True)
    assert list(got_dense) == list(want_dense) and list(got_grads) == list(want_grads)
    for name, want_value in want_dense.items():  # weights, and Megatron's _extra_state (None) as they are
        assert torch.equal(got_dense[name], want_value) if torch.is_tensor(want_value) else got_dense[name] is None
    for name in want_grads:
        _close(f"dense grad {name}", got_grads[name] * dp, want_grads[name] * coef)
    wrapped.reshard()  # (a no-op when already resharded) the sharded parameters, with their gradients
    summed = {n: p.grad.full_tensor() * dp for n, p in wrapped.named_parameters()}
    for name in summed:
        _close(f"grad {name}", summed[name], want[name].grad * coef)
    norms = [n for n in summed if "norm" in n]
    # the planted bug (tags lost, nothing summed) is what the comparison catches
    stale = partial and [n for n in norms if not torch.allclose(partial[n], want[n].grad, **TOL)]
    refused = []  # the wrapper dropped the TP tags these need: refused, not silently wrong
    for call in (lambda: ok.clip_grad_norm_(wrapped.parameters(), 1.0, dims=dims),
                 lambda: shard_dense_state_dict(wrapped, {}, tp)):
        try:
            call()
            refused.append(None)
        except TypeError as exc:
            refused.append(str(exc).split(":")[0])
    return touched, norms, stale, refused


@pytest.mark.parametrize("reshard_after_backward", [True, False])
def test_sequence_parallel_grads_under_torch_fsdp2(rank_pool, reshard_after_backward):
    for touched, norms, stale, refused in rank_pool(4).run(_block_under_fsdp2_on_rank, reshard_after_backward):
        assert touched == 2 and norms == ["attn_norm.weight", "mlp_norm.weight"]
        assert stale == (norms if reshard_after_backward else None)
        assert refused == ["clip_grad_norm_", "shard_dense_state_dict"]


def _tied_under_fsdp2_on_rank():
    """A weight two modules share (a tied embedding and head): FSDP2 keeps one sharded parameter for
    it, and both names must find it, whichever module remembers its tags."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from overlapkernels import _compat

    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    fully_shard(model, mesh=ok.init_parallel().mesh["dp"])
    model.set_reshard_after_backward(False)
    model(torch.ones(2, 4)).sum().backward()
    found = _compat.fsdp2_sharded_params(model)
    # after backward the modules hold the unsharded parameter; the gradient is on the sharded one
    return (found[(id(first), "weight")] is found[(id(second), "weight")], first.weight.grad is None,
            hasattr(found[(id(second), "weight")].grad, "to_local"))


def test_tied_parameters_under_torch_fsdp2_are_found_by_every_name(rank_pool):
    assert rank_pool(2).run(_tied_under_fsdp2_on_rank) == [(True, True, True)] * 2


def _tied_dense_export_on_rank():
    """A TP weight two layers share: the dense dict holds the whole weight under both names."""
    from torch import nn

    tp, one, world, rank = _groups()
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": ColumnParallelLinear(4, 2 * world, tp, bias=False, dtype=F64),
                           "b": ColumnParallelLinear(4, 2 * world, tp, bias=False, dtype=F64)})
    model["b"].weight = model["a"].weight
    dense = gather_dense_state_dict(model, tp)
    shards = [torch.empty_like(model["a"].weight) for _ in range(world)]
    dist.all_gather(shards, model["a"].weight.detach(), group=tp)
    return sorted(dense), dense["a.weight"] is dense["b.weight"], torch.equal(dense["b.weight"], torch.cat(shards))


def test_tied_tensor_parallel_weight_exports_dense_under_each_name(rank_pool):
    assert rank_pool(2).run(_tied_dense_export_on_rank) == [(["a._extra_state", "a.weight", "b._extra_state", "b.weight"], True, True)] * 2


def _clip_without_dims_on_rank():
    """dims=None: pure data parallelism over the world; replicated gradients count once."""
    from torch import nn

    p = nn.Parameter(torch.zeros(3, dtype=F64))
    p.grad = torch.tensor([3.0, 4.0, 0.0], dtype=F64)  # the same on every rank, as DDP leaves it
    return float(ok.clip_grad_norm_([p], 10.0, dims=None)), float(ok.clip_grad_norm_([p], 10.0, 1.0, dims=None))


def test_clip_grad_norm_without_dims_is_data_parallel(rank_pool):
    assert rank_pool(2).run(_clip_without_dims_on_rank) == [(5.0, 7.0)] * 2


def _planted_on_rank():
    """Shard the dense weights along the wrong dim: the dense-twin comparison must catch it."""
    tp, one, world, rank = _groups()
    torch.manual_seed(0)
    dense = ColumnParallelLinear(8, 4 * world, one, dtype=F64)
    par = ColumnParallelLinear(8, 4 * world, tp, dtype=F64)
    with torch.no_grad():
        par.weight.copy_(dense.weight[rank::world])  # interleaved rows instead of a contiguous block
        par.bias.copy_(dense.bias.chunk(world)[rank])
    x = _randn(3, 2, 8, seed=1)
    try:
        _close("out", par(x), dense(x)[..., rank * 4:(rank + 1) * 4])
    except AssertionError:
        return "caught"
    return "missed"


def test_planted_error_is_caught(rank_pool):
    assert rank_pool(2).run(_planted_on_rank) == ["caught", "caught"]


# -- zero-bubble: the parallel linears leave their weight gradients to W -----------------------
def _deferred_linears_on_rank(method, drop_closure=False):
    """Column/Row x SP on/off, each against the same layer without deferral: inside ``deferring``
    backward gives the input and bias gradients and leaves the weight's untouched (an existing
    .grad, not None, so accumulation is tested too) behind one closure; W adds what plain backward
    adds. A frozen weight gets no closure and no gradient. ``drop_closure``: a planted lost W.
    Also under activation checkpointing (reentrant or not), where backward's saved tensors are
    recomputed aliases of the parameters: the closures must still reach the parameters."""
    from torch.utils.checkpoint import checkpoint

    from overlapkernels.ops.weight_grad_store import WeightGradStore, deferring
    from overlapkernels.runtime.pipeline import enable_zero_bubble

    tp, _, world, rank = _groups()
    s, b, narrow, wide = 3 * world, 2, 10, 4 * world
    exact = dict(atol=1e-12, rtol=1e-12)
    cases = [(sp, cls, d_in, d_out, frozen, ckpt) for sp in (False, True)
             for cls, d_in, d_out in ((ColumnParallelLinear, narrow, wide), (RowParallelLinear, wide, narrow))
             for frozen in (False, True) for ckpt in (None, "non-reentrant", "reentrant")]
    for sp, cls, d_in, d_out, frozen, ckpt in cases:
        torch.manual_seed(0)
        ref = cls(d_in, d_out, tp, sequence_parallel=sp, method=method, dtype=F64)
        zb = enable_zero_bubble(cls(d_in, d_out, tp, sequence_parallel=sp, method=method, dtype=F64))
        assert zb.defer_weight_grad and not ref.defer_weight_grad
        with torch.no_grad():
            for i, (p, q) in enumerate(zip(ref.parameters(), zb.parameters())):
                p.copy_(_randn(*p.shape, seed=10 * rank + i))
                q.copy_(p)
        for layer in (ref, zb):
            layer.weight.requires_grad_(not frozen)
            for i, p in enumerate(layer.parameters()):
                p.grad = None if frozen and p is layer.weight else _randn(*p.shape, seed=50 + i)
        rows = s // world if sp and cls is ColumnParallelLinear else s
        x = _randn(rows, b, ref.weight.shape[1], seed=20 + rank)
        xr, xz = x.clone().requires_grad_(), x.clone().requires_grad_()
        yr = ref(xr)
        g = _randn(*yr.shape, seed=30 + rank)
        (yr * g).sum().backward()
        store = WeightGradStore()
        before = None if zb.weight.grad is None else zb.weight.grad.clone()
        with deferring(store):
            y = zb(xz) if ckpt is None else checkpoint(zb, xz, use_reentrant=ckpt == "reentrant")
            (y * g).sum().backward()
        what = f"{cls.__name__} sp={sp} frozen={frozen} checkpoint={ckpt}"
        assert len(store.closures) == (0 if frozen else 1), what
        assert (zb.weight.grad is None) if frozen else torch.equal(zb.weight.grad, before), what
        torch.testing.assert_close(xz.grad, xr.grad, **exact, msg=lambda m: f"{what} input grad: {m}")
        torch.testing.assert_close(zb.bias.grad, ref.bias.grad, **exact, msg=lambda m: f"{what} bias: {m}")
        if drop_closure:
            store.closures.pop()
        store.run()
        assert (zb.weight.grad is None) == frozen, what
        if not frozen:
            torch.testing.assert_close(zb.weight.grad, ref.weight.grad, **exact,
                                       msg=lambda m: f"{what} weight grad after W: {m}")
            assert not zb.weight.grad.requires_grad, what  # a gradient, not a graph
    return True


@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_linears_defer_weight_grads_to_w(rank_pool, method):
    assert rank_pool(2).run(_deferred_linears_on_rank, method) == [True, True]


def _dropped_closure_on_rank():
    try:
        _deferred_linears_on_rank("baseline", drop_closure=True)
    except AssertionError:  # both ranks fail at the same (first) check, before any more communication
        return "caught"
    return "missed"


def test_planted_lost_weight_grad_is_caught(rank_pool):
    assert rank_pool(2).run(_dropped_closure_on_rank) == ["caught", "caught"]
