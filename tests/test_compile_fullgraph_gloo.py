"""torch.compile(..., fullgraph=True) through the ops, the layers and the GPT (ops/_opaque): each op
one opaque ``overlapkernels::call`` node, its backward the eager op's own. Against eager on gloo
ranks, bitwise in fp64 (aot_eager runs the same kernels; Inductor's fused pointwise code would not be
bitwise): outputs and the gradients of every input, the methods overlap_stats records, and the
edges (a forward without backward, a second backward, a zero-bubble deferral, autocast, bad input)."""
import gc

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.models import GPT, GPTConfig
from overlapkernels.ops import _opaque, tp_regions, weight_grad_store
from overlapkernels.ops.all_gather_matmul import all_gather_linear
from overlapkernels.ops.matmul_reduce_scatter import linear_reduce_scatter


def _compiled(fn):
    return torch.compile(fn, backend="aot_eager", fullgraph=True)


def _flat(result):
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for item in result for t in _flat(item)]


def _run(fn, inputs, grad_seed):
    """fn's outputs and its inputs' gradients under a fixed random weighting of every output."""
    xs = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    ok.reset_overlap_stats()
    outs = _flat(fn(*xs))
    g = torch.Generator().manual_seed(grad_seed)
    loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs if o.is_floating_point())
    loss.backward()
    return [o.detach() for o in outs], [x.grad for x in xs if x.is_floating_point()], dict(ok.overlap_stats())


def _same_compiled(fn, *inputs, stats=True):
    eager_outs, eager_grads, eager_stats = _run(fn, inputs, 7)
    outs, grads, compiled_stats = _run(_compiled(fn), inputs, 7)
    assert len(outs) == len(eager_outs) and len(grads) == len(eager_grads)
    for got, want in zip(outs + grads, eager_outs + eager_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert all(g.abs().sum() > 0 for g in eager_grads)  # the comparison sees real gradients
    if stats:  # counted at run time, per call, forward and backward (never per trace)
        assert compiled_stats == eager_stats and compiled_stats


def _ops_on_rank(case):
    group, rank = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(100 + rank)  # each rank's own shard; the weights alike on every rank
    shard = lambda *shape: torch.randn(*shape, dtype=torch.float64)  # noqa: E731
    w = torch.Generator().manual_seed(5)
    weight = lambda *shape: torch.randn(*shape, dtype=torch.float64, generator=w)  # noqa: E731
    if case == "ag":
        _same_compiled(lambda a, b: ok.all_gather_matmul(a, b, group), shard(3, 2, 5), weight(5, 4))
    elif case == "ag-many-gathered":  # a list sharing one gather, dim 1, the gathered input returned, decomposed
        _same_compiled(lambda a, b1, b2: ok.all_gather_matmul(a, [b1, b2], group, gather_dim=1, return_gathered=True,
                                                              method="decomposed"),
                       shard(2, 3, 5), weight(5, 4), weight(5, 2))
    elif case == "ag-linear-saved":
        _same_compiled(lambda x, w1, w2: all_gather_linear(x, [w1, w2], group, save_gathered=True),
                       shard(3, 5), weight(4, 5), weight(6, 5))
    elif case == "rs":  # group=None: the default group, resolved at run time
        _same_compiled(lambda a, b: ok.matmul_reduce_scatter(a, b, method="decomposed"), shard(4, 3, 5), weight(5, 6))
    elif case == "rs-over-n":
        _same_compiled(lambda x, w_: linear_reduce_scatter(x, w_, group, scatter_dim=-1), shard(3, 5), weight(6, 5))
    elif case == "tp-regions":  # every region op in one graph (the identity forward comes back a copy)
        def regions(x):
            y = tp_regions.reduce_from_tp_region(tp_regions.copy_to_tp_region(x, group) * 3, group)
            y = tp_regions.split_last_dim(tp_regions.gather_last_dim(y, group), group)
            return tp_regions.gather_first_dim(tp_regions.reduce_scatter_first_dim(y, group), group)
        _same_compiled(regions, shard(4, 3), stats=False)
    elif case == "attention":  # local, ring (zigzag, documents, lse) and Ulysses in one graph
        q, k, v = shard(1, 4, 4, 3), shard(1, 4, 2, 3), shard(1, 4, 2, 3)
        ids = torch.tensor([[0, 0, 1, 1]]) + rank  # documents crossing the ranks' parts

        def attend(q, k, v):
            local, lse = ok.local_attention(q, k, v, causal=True, return_lse=True)
            ring, ring_lse = ok.ring_attention(q, k, v, group, causal=True, layout="zigzag", return_lse=True,
                                               segment_ids=ids)
            return local, lse, ring, ring_lse, ok.ulysses_attention(q, k, v, group, causal=True, segment_ids=ids)
        _same_compiled(attend, q, k, v, stats=False)
    elif case == "sequence":
        _same_compiled(lambda x: ok.unshard_sequence(ok.shard_sequence(x, group) * 2, group), weight(2, 8, 3),
                       stats=False)
    elif case == "cross-entropy":
        target = torch.tensor([[1, 9, 3, -100, 0]])
        _same_compiled(lambda z: ok.vocab_parallel_cross_entropy(z, target, group, label_smoothing=0.1),
                       shard(1, 5, 5), stats=False)
    else:
        raise AssertionError(case)


@pytest.mark.parametrize("case", ["ag", "ag-many-gathered", "ag-linear-saved", "rs", "rs-over-n", "tp-regions",
                                  "attention", "sequence", "cross-entropy"])
def test_each_op_compiles_fullgraph_and_matches_eager(rank_pool, case):
    rank_pool(2).run(_ops_on_rank, case)


def _gpt_on_rank(layout, sequence_parallel, cp_attention, documents):
    config = GPTConfig(vocab_size=32, hidden=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=32,
                       max_seq_len=16, sequence_parallel=sequence_parallel, cp_attention=cp_attention)
    g = torch.Generator().manual_seed(42)
    tokens, targets = torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)
    targets[1, 3] = -100
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [5, 3, 3, 3, 3, 3, 3, 3]]) if documents else None
    dims = ok.init_parallel(**layout)
    torch.manual_seed(0)
    eager, compiled = GPT(config, dims, dtype=torch.float64), GPT(config, dims, dtype=torch.float64)
    compiled.load_state_dict(eager.state_dict())
    eager_loss = eager.loss(tokens, targets, ids)
    eager_loss.backward()
    loss = _compiled(compiled.loss)(tokens, targets, ids)  # one graph: embedding, blocks, head, loss
    loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        assert p.grad is not None, name
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("layout, sequence_parallel, cp_attention, documents", [
    (dict(tp=2, cp=2), True, "ring", True),
    (dict(tp=2, cp=2), False, "ulysses", False),
])
def test_gpt_compiles_fullgraph_and_matches_eager(rank_pool, layout, sequence_parallel, cp_attention, documents):
    rank_pool(4).run(_gpt_on_rank, layout, sequence_parallel, cp_attention, documents)


def _edges_on_rank():
    group = dist.group.WORLD
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    agl = _compiled(lambda x, w: all_gather_linear(x, [w], group, save_gathered=True)[0])

    # a forward whose backward never runs: its entry goes with its outputs
    gc.collect()
    before = len(_opaque._GRAPHS)
    out = agl(x, w)
    assert len(_opaque._GRAPHS) == before + 1
    del out
    gc.collect()
    assert len(_opaque._GRAPHS) == before

    # a second backward raises, as through an eager graph freed by its first
    out = agl(x, w)
    out.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        out.sum().backward()
    x.grad = w.grad = None

    # inside a zero-bubble B the compiled call's weight gradient is computed, not deferred to the
    # aliases the op ran on (it would be lost)
    store = weight_grad_store.WeightGradStore()
    with weight_grad_store.deferring(store):
        agl(x, w).sum().backward()
    assert not store.closures and w.grad is not None
    want = all_gather_linear(x.detach(), [w.detach().requires_grad_()], group)[0]
    assert want.shape == out.shape

    # the op's inputs are not kept for backward beyond what the eager op saves (cross-entropy keeps its
    # probabilities, not the logits); the gradient as eager's
    base = torch.randn(1, 5, 5, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([[1, 9, 3, -100, 0]])
    logits, tensors = base * 1, []
    spec = _opaque._encode(((logits, target, group), {}), tensors)
    name = "overlapkernels.ops.cross_entropy.vocab_parallel_cross_entropy"
    loss = torch.ops.overlapkernels.call(name, repr((0, spec)), tensors, [True, False])[1]
    memory = logits.untyped_storage()
    del logits, tensors
    gc.collect()
    assert torch._C._storage_Use_Count(memory._cdata) == 1  # ours (memory) only
    loss.sum().backward()
    want = base.grad.clone()
    base.grad = None
    ok.vocab_parallel_cross_entropy(base * 1, target, group).sum().backward()
    torch.testing.assert_close(base.grad, want, rtol=0, atol=0)

    # a group of one: an identity forward hands its input back (a copy of it, then)
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]
    _same_compiled(lambda x: tp_regions.reduce_from_tp_region(x, alone) * 2, torch.randn(3, 2, dtype=torch.float64),
                   stats=False)
    _same_compiled(lambda a, b: ok.all_gather_matmul(a, b, alone, return_gathered=True),
                   torch.randn(3, 2, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))

    # two identical calls in one graph stay two (merged, they shared one handle: a second backward)
    _same_compiled(lambda a, b: ok.all_gather_matmul(a, b, group) + 2 * ok.all_gather_matmul(a, b, group),
                   torch.randn(3, 2, dtype=torch.float64), torch.randn(2, 4, dtype=torch.float64))

    # autocast: cast in the graph as the eager op casts on entry; bitwise alike
    a = torch.randn(3, 5)
    b = torch.randn(5, 4)

    def amp(a, b):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return ok.all_gather_matmul(a, b, group)
    got, want = _compiled(amp)(a, b), amp(a, b)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    # bad input: the eager op's message, raised while compiling, before any rank communicates
    with pytest.raises(Exception, match=r"does not match a_shard.shape\[-1\]=5"):
        _compiled(lambda a, b: ok.all_gather_matmul(a, b, group))(a, torch.randn(4, 4))


def test_compiled_calls_release_refuse_and_cast_as_eager(rank_pool):
    rank_pool(2).run(_edges_on_rank)


def _inductor_on_rank():
    """Inductor (its C++ code around the ops, the ops called as extern kernels) on the GPT over TP=2
    with sequence parallelism, against eager: close in fp32 (it fuses and reorders arithmetic). Was
    wrong (weight gradients 10-150% off): Inductor reused the buffers of the ops' inputs once the
    graph had read them, while the eager op still held them for backward (see _SavedPrivately).
    Then a sequence-parallel MLP at two lengths, the second traced with dynamic shapes."""
    config = GPTConfig(vocab_size=32, hidden=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=32,
                       max_seq_len=16)
    g = torch.Generator().manual_seed(42)
    tokens, targets = torch.randint(0, 32, (2, 8), generator=g), torch.randint(0, 32, (2, 8), generator=g)
    dims = ok.init_parallel(tp=2)
    torch.manual_seed(0)
    # fp32: torch 2.11's Inductor fails SDPA's CPU backward in fp64 (a float buffer for a double)
    eager, compiled = GPT(config, dims), GPT(config, dims)
    compiled.load_state_dict(eager.state_dict())
    eager.loss(tokens, targets).backward()
    torch.compile(compiled.loss, backend="inductor", fullgraph=True)(tokens, targets).backward()
    for (name, p), q in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)

    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    w1, w2 = (torch.randn(n, m, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
              for n, m in ((8, 4), (4, 8)))

    def mlp(x, w1, w2):  # gather + GEMM, GELU, GEMM + reduce-scatter
        return linear_reduce_scatter(torch.nn.functional.gelu(all_gather_linear(x, [w1], group)[0]), w2, group) + x
    compiled_mlp = torch.compile(mlp, backend="inductor", fullgraph=True)
    for rows in (3, 5):
        x = torch.randn(rows, 2, 4, dtype=torch.float64)
        want, got = _run(mlp, (x, w1, w2), 3), _run(compiled_mlp, (x, w1, w2), 3)
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_inductor_compiles_around_the_ops(rank_pool):
    rank_pool(2).run(_inductor_on_rank)


def test_arguments_travel_as_constants_or_the_op_runs_eagerly():
    """What cannot travel as a constant (a thread world's peer group, any other object, a NaN) makes
    the op run eagerly under compile, with a graph break, as before; the rest round-trips."""
    assert _opaque._encode((object(),), []) is None
    assert _opaque._encode(([torch.zeros(1)], {"method": "auto", "scale": float("nan")}), []) is None
    tensors = []
    spec = _opaque._encode(((torch.zeros(1), [torch.ones(2)], None, (3, "x")), {"gather_dim": 1, "s": 0.1}), tensors)
    assert len(tensors) == 2
    args, kwargs = _opaque._call_args(repr((0, spec)), tensors)
    assert args[0] is tensors[0] and args[1] == [tensors[1]] and args[2] is None and args[3] == (3, "x")
    assert kwargs == {"gather_dim": 1, "s": 0.1}


def _inductor_reuse_on_rank():
    """Inductor reuses an intermediate's buffer once the graph no longer reads it (or writes into an
    output in place): what the eager op saved for backward must not live in such memory."""
    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())
    x = torch.randn(4, 8, dtype=torch.float64)
    w = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))

    def saved_input(x, w):  # linear_reduce_scatter saves h for w's gradient; r takes h's size after it
        h = x * 2.0
        r = linear_reduce_scatter(h, w, group).repeat(2, 1) * 3.0
        return r.sin() * x

    def saved_output(a, b):  # the gathered input, returned and saved
        gathered, y = ok.all_gather_matmul(a, b, group, return_gathered=True, save_gathered=True)
        return (gathered * 2.0).cos().sum() * y + y.sin()

    for fn, inputs in ((saved_input, (x, w)), (saved_output, (x[:2], w))):
        want, got = _run(fn, inputs, 3), _run(torch.compile(fn, backend="inductor", fullgraph=True), inputs, 3)
        for a, b in zip(got[0] + got[1], want[0] + want[1]):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_inductor_buffer_reuse_keeps_what_backward_saved(rank_pool):
    rank_pool(2).run(_inductor_reuse_on_rank)


def test_inductor_buffer_reuse_local_attention_mqa():
    """MQA: k/v [B, S, 1, D] transposed stay contiguous, so the op saves the graph's own buffers."""
    q, k, v = (torch.randn(1, 8, h, 4, dtype=torch.float64) for h in (2, 1, 1))

    def f(q, k, v):
        out = ok.local_attention(q, k * 1.5, v + 0.5)
        return (out[:, :, :1] * 3.0).sin() * (out[:, :, 1:] - 1.0).cos() + out[:, :, :1]
    want, got = _run(f, (q, k, v), 3), _run(torch.compile(f, backend="inductor", fullgraph=True), (q, k, v), 3)
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def _fakes_on_rank():
    """Each op's fake rule (what Inductor plans buffers by; aot_eager never checks it) against the real
    op's results: shapes and dtypes, over dtypes (fp64 keeps an fp64 loss, the lse stays fp32)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    group = dist.group.WORLD
    torch.manual_seed(dist.get_rank())

    def check(fn, *args, **kwargs):
        op = _opaque._OPS[f"{fn.__module__}.{fn.__name__}"]
        real = _opaque._flatten(op.fn(*args, **kwargs), [])
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            fake = _opaque._flatten(op.fake(*fake_args, **kwargs), [])
        assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real], fn.__name__

    for dtype in (torch.float32, torch.bfloat16, torch.float64):
        r = lambda *shape: torch.randn(*shape, dtype=dtype)  # noqa: E731
        check(ok.vocab_parallel_cross_entropy, r(2, 3, 5), torch.randint(0, 10, (2, 3)), group)
        check(ok.all_gather_matmul, r(2, 4), r(4, 3), group, return_gathered=True)
        check(ok.matmul_reduce_scatter, r(3, 4), r(4, 6), group, scatter_dim=-1)
        for fmt in ("bshd", "sbhd"):
            q, kv = r(1, 4, 2, 8), r(1, 4, 1, 8)
            if fmt == "sbhd":
                q, kv = q.transpose(0, 1).contiguous(), kv.transpose(0, 1).contiguous()
            check(ok.local_attention, q, kv, kv, qkv_format=fmt, return_lse=True)
            check(ok.ring_attention, q, kv, kv, group, qkv_format=fmt, return_lse=True)
        check(ok.unshard_sequence, ok.shard_sequence(r(2, 8, 3), group), group)
        for region in ("gather_last_dim", "split_last_dim", "gather_first_dim", "reduce_scatter_first_dim"):
            check(getattr(tp_regions, region), r(4, 6), group)


def test_fake_rules_match_the_ops(rank_pool):
    rank_pool(2).run(_fakes_on_rank)
