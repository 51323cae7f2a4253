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
from comm_guard import no_communication

TOL = dict(atol=1e-11, rtol=1e-11)
F64 = torch.float64
# small integers instead of normal values (_integer_values): every product and sum is exact in fp64
# whatever the order, so the layers must then match their dense twins bit for bit
_EXACT = {"on": False}


def _close(name, got, want):
    tol = dict(atol=0, rtol=0) if _EXACT["on"] else TOL
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{name}: {m}")


def _randn(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    if _EXACT["on"]:
        return torch.randint(-3, 4, shape, generator=g).to(F64)
    return torch.randn(*shape, generator=g, dtype=F64)


def _twins(make, tp_group, one_group):
    """(dense module on a 1-rank group, parallel module with the dense weights sharded in)."""
    torch.manual_seed(0)
    dense = make(one_group)
    with torch.no_grad():
        # biases start at 0: randomise everything so every term is tested, each parameter with its own
        # values (k and v, gate and up swapped must not compute the same)
        for i, p in enumerate(dense.parameters()):
            p.copy_(_randn(*p.shape, seed=1000 + i) * (1 if _EXACT["on"] else 0.3))
    par = make(tp_group)
    par.load_state_dict(shard_dense_state_dict(par, dense.state_dict(), tp_group), strict=True)
    return dense, par


def _run_pair(dense, par, x_full, x_local, g_full, g_local, *, out_local_of, x_grad_local_of, tp_group):
    xd = x_full.clone().requires_grad_()
    xp = x_local.clone().requires_grad_()
    yd, yp = dense(xd), par(xp)
    _close("out", yp, out_local_of(yd.detach()))
    assert yp.is_contiguous()  # as Megatron's outputs: callers .view() them
    (yd * g_full).sum().backward()
    (yp * g_local).sum().backward()
    allreduce_sequence_parallel_grads(par, tp_group)
    _close("input grad", xp.grad, x_grad_local_of(xd.grad))
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    assert all(g is not None for g in dense_grads.values()), [n for n, g in dense_grads.items() if g is None]
    grads = gather_dense_state_dict(par, tp_group, grads=True)  # (a parameter without a gradient is left out)
    assert sorted(grads) == sorted(dense_grads), sorted(set(dense_grads) ^ set(grads))
    for name, grad in grads.items():
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
    # print(model) says what each rank holds
    assert repr(ColumnParallelLinear(n_in, n_out, tp, sequence_parallel=True, method=method, dtype=F64)) == (
        f"ColumnParallelLinear(in_features={n_in}, out_features={n_out} ({n_out // world} per rank), "
        f"sequence_parallel=True, method={method!r})")
    assert repr(par) == (f"RowParallelLinear(in_features={n_out} ({n_out // world} per rank), out_features={n_in}, "
                         f"sequence_parallel=False, method={method!r})")
    return True


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["baseline", "decomposed", "auto"])
def test_linears_match_dense(rank_pool, world, method):
    assert rank_pool(world).run(_linears_on_rank, method) == [True] * world


def _integer_values(fn, *args):
    _EXACT["on"] = True
    try:
        return fn(*args)
    finally:
        _EXACT["on"] = False


@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_linears_match_dense_bit_for_bit_on_integer_values(rank_pool, method):
    """With sums that are exact in any order, nothing but a wrong value can differ: outputs, input
    and weight gradients equal the dense twin's exactly, with and without SP, in every mode."""
    assert rank_pool(2).run(_integer_values, _linears_on_rank, method) == [True] * 2


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
@pytest.mark.parametrize("method", ["baseline", "decomposed", "auto"])
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
            with pytest.raises(IndexError, match=rf"tokens hold ids outside \[0, {vocab}\), e.g. {bad_id}"), \
                    no_communication():
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
    # an ignore_index that is a real class id (3 lies on rank 0's slice): those tokens, and only
    # they, get no loss and no gradient. The default (-100) runs last: the checks below use its shard and got
    target_3 = target.masked_fill(target == -100, 3)
    target_3[1, 2] = 3
    for ignore_index, tgt in ((3, target_3), (-100, target)):
        for smoothing in (0.0, 0.1):
            what = f"ignore_index {ignore_index}, smoothing {smoothing}"
            full = logits.clone().requires_grad_()
            want = F.cross_entropy(full.reshape(-1, vocab), tgt.reshape(-1), reduction="none",
                                   ignore_index=ignore_index, label_smoothing=smoothing).reshape(3, 4)
            shard = logits.chunk(world, -1)[rank].clone().requires_grad_()
            kwargs = {} if ignore_index == -100 else dict(ignore_index=ignore_index)
            got = ok.vocab_parallel_cross_entropy(shard, tgt, tp, label_smoothing=smoothing, **kwargs)
            _close(f"loss ({what})", got, want)
            w = _randn(3, 4, seed=7)
            (want * w).sum().backward()
            (got * w).sum().backward()
            _close(f"logits grad ({what})", shard.grad, full.grad.chunk(world, -1)[rank])
    for call, error, match in (
            (lambda: ok.vocab_parallel_cross_entropy(shard.tolist(), target, tp), TypeError,
             r"^logits_shard must be a torch.Tensor, got list$"),
            (lambda: ok.vocab_parallel_cross_entropy(shard, target.float(), tp), TypeError,
             r"^target must be an integer tensor, got torch.float32$"),
            (lambda: ok.vocab_parallel_cross_entropy(shard, target[:2], tp), ValueError,
             r"^target shape \(2, 4\) must equal logits_shard.shape\[:-1\] \(3, 4\)$"),
            (lambda: ok.vocab_parallel_cross_entropy(shard, target, tp, label_smoothing=1.5), ValueError,
             r"^label_smoothing=1.5: expected a value in \[0, 1\]$"),
            (lambda: par(tokens.float()), TypeError, r"^tokens must be an integer tensor, got torch.float32$")):
        with no_communication(), pytest.raises(error, match=match):
            call()
    for bad in ("0.1", None, torch.ones(2)):
        with no_communication(), pytest.raises(TypeError, match=rf"label_smoothing must be a float in \[0, 1\], "
                                                               rf"got {type(bad).__name__}"):
            ok.vocab_parallel_cross_entropy(shard, target, tp, label_smoothing=bad)
    _close("0-d tensor label_smoothing", ok.vocab_parallel_cross_entropy(shard, target, tp,
                                                                          label_smoothing=torch.tensor(0.1, dtype=F64)), got)
    # as Megatron's embedding, whose state dict has no _extra_state; ours once saved one: still loads strictly
    assert list(par.state_dict()) == ["weight"]
    par.load_state_dict({"weight": par.weight.detach() * 2, "_extra_state": None})
    _close("loaded weight", par.weight, dense.weight.chunk(world)[rank] * 2)
    with pytest.raises(RuntimeError, match='Unexpected key.*"junk"'):
        par.load_state_dict({"weight": par.weight.detach(), "junk": None})
    with pytest.raises(TypeError, match="tokens must be a torch.Tensor of token ids, got list"):
        par([[0, 1]])
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_embedding_and_cross_entropy_match_dense(rank_pool, world):
    assert rank_pool(world).run(_embedding_and_loss_on_rank) == [True] * world


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
    .grad, so accumulation is tested, or None) behind one closure; W adds what plain backward
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
        fresh = ckpt == "reentrant" and not frozen  # the weight's .grad starts None: W assigns, not adds
        for layer in (ref, zb):
            layer.weight.requires_grad_(not frozen)
            for i, p in enumerate(layer.parameters()):
                p.grad = None if (frozen or fresh) and p is layer.weight else _randn(*p.shape, seed=50 + i)
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
        assert (zb.weight.grad is None) if (frozen or fresh) else torch.equal(zb.weight.grad, before), what
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
            # laid out as the parameter (as autograd leaves it), not a transposed view of W's product
            assert zb.weight.grad.stride() == zb.weight.stride(), (what, zb.weight.grad.stride())
    # under autocast the matmul sees a bf16 cast of the fp32 weight (not a leaf, so nothing to defer
    # to): its gradient must still reach the parameter, as without deferral
    for sp in (False, True):
        torch.manual_seed(0)
        ref = ColumnParallelLinear(narrow, wide, tp, sequence_parallel=sp, method=method)
        zb = enable_zero_bubble(ColumnParallelLinear(narrow, wide, tp, sequence_parallel=sp, method=method))
        zb.load_state_dict(ref.state_dict())
        x = _randn(s // world if sp else s, b, narrow, seed=40 + rank).float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref(x).float().sum().backward()
        store = WeightGradStore()
        with deferring(store), torch.autocast("cpu", dtype=torch.bfloat16):
            zb(x).float().sum().backward()
        store.run()
        assert zb.weight.grad is not None, f"autocast sp={sp}: the weight gradient was lost"
        # decomposed + SP: the two paths sum the per-chunk bf16 wgrads in other orders (1 bf16 ulp)
        bf16 = dict(atol=0, rtol=0) if method == "baseline" else dict(atol=1e-2, rtol=2 ** -7)
        torch.testing.assert_close(zb.weight.grad, ref.weight.grad, **bf16, msg=lambda m: f"autocast sp={sp}: {m}")
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
