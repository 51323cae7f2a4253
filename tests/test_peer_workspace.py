"""symm/fused workspaces when shapes change from call to call (variable sequence lengths): one
growing symmetric buffer per (op, dtype), shared by symm and fused, not one per shape. Symmetric
memory is never freed while the process runs (a peer may still map it), so a buffer per shape
would grow without bound over a training run whose batches differ in length."""
import threading

import pytest
import torch

import overlapkernels as ok
from overlapkernels.comm.thread_world import ThreadWorld

# all_gather_matmul: (rows per rank, K) -> slot elements 32, 48, 80, 96, 128, 16
AG_SHAPES = [(2, 16), (3, 16), (5, 16), (4, 24), (8, 16), (2, 8)]
# matmul_reduce_scatter, world 2: (rows per chunk, N) -> slot elements 2*m*N = 24, 40, 32, 72, 12
RS_SHAPES = [(3, 4), (5, 4), (2, 8), (6, 6), (1, 6)]


def _ints(shape, seed):
    return torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed)).float()


def _varying_shapes_on_rank(ctx, method):
    r, w = ctx.rank, ctx.world_size
    allocated, alloc = [], ctx.alloc_symmetric

    def counting(shape, dtype, **kwargs):
        allocated.append(tuple(shape))
        return alloc(shape, dtype, **kwargs)

    ctx.alloc_symmetric = counting
    exact = []
    for call, (m, k) in enumerate(AG_SHAPES):
        shards = [_ints((m, k), 10 * call + q) for q in range(w)]
        b = _ints((k, 3), 100 + call)
        gathered, out = ok.all_gather_matmul(shards[r], b, ctx, return_gathered=True, method=method)
        exact.append(torch.equal(gathered, torch.cat(shards)) and torch.equal(out, torch.cat(shards) @ b))
    for call, (m, n) in enumerate(RS_SHAPES):
        a_all = [_ints((w * m, 7), 200 + 10 * call + q) for q in range(w)]
        b = _ints((7, n), 300 + call)
        out = ok.matmul_reduce_scatter(a_all[r], b, ctx, method=method)
        exact.append(torch.equal(out, sum(a @ b for a in a_all).chunk(w)[r]))
    # outgrown buffers stay referenced: a peer may still be pulling from one (its previous call)
    outgrown = {key[0]: len(ws._outgrown) for key, ws in ctx._workspaces.items() if key[0] in ("ag", "rs")}
    return exact, allocated, outgrown


@pytest.mark.parametrize("method", ["symm", "fused"])
def test_changing_shapes_reuse_one_growing_buffer(method):
    """Exact results on every call (a smaller call reads a prefix that a larger one wrote: nothing
    stale may leak), and the slots grow geometrically: 3 all-gather buffers for 6 shapes, 3
    reduce-scatter buffers for 5, after one signal pad each."""
    results = ThreadWorld(2, timeout=60).run(_varying_shapes_on_rank, method)
    for exact, allocated, outgrown in results:
        assert exact == [True] * (len(AG_SHAPES) + len(RS_SHAPES))
        assert allocated == [(4,), (32,), (64,), (128,), (4,), (24,), (48,), (96,)], allocated
        assert outgrown == {"ag": 2, "rs": 2}


def _empty_first_then_mixed_on_rank(ctx, method):
    """An empty call first (a rank's batch with no rows) still sets the workspace up; then the
    plain reduce-scatter (no GEMM: sequence-parallel gradients) shares the symm reduce-scatter
    workspace with matmul_reduce_scatter, each call a different shape."""
    from overlapkernels.ops import _methods

    r, w = ctx.rank, ctx.world_size
    b = _ints((6, 3), 1)
    got = [tuple(ok.all_gather_matmul(torch.zeros(0, 6), b, ctx, method=method).shape),
           tuple(ok.matmul_reduce_scatter(torch.zeros(0, 6), b, ctx, method=method).shape)]
    for call, m in enumerate((3, 5, 2)):
        a_all = [_ints((w * m, 6), 10 * call + q) for q in range(w)]
        got.append(torch.equal(ok.matmul_reduce_scatter(a_all[r], b, ctx, method=method),
                               sum(a @ b for a in a_all).chunk(w)[r]))
        x_all = [_ints((w * (m + 1), 4), 50 + 10 * call + q) for q in range(w)]
        got.append(torch.equal(_methods.reduce_scatter(x_all[r], ctx), sum(x_all).chunk(w)[r]))
        shards = [_ints((m, 6), 90 + 10 * call + q) for q in range(w)]
        got.append(torch.equal(ok.all_gather_matmul(shards[r], b, ctx, method=method), torch.cat(shards) @ b))
    return got


@pytest.mark.parametrize("method", ["symm", "fused"])
def test_an_empty_first_call_and_the_plain_reduce_scatter_share_the_workspace(method):
    want = [(0, 3), (0, 3)] + [True] * 9
    assert ThreadWorld(2, timeout=60).run(_empty_first_then_mixed_on_rank, method) == [want, want]


def test_a_prefix_keeps_every_peer_address_and_refuses_more_than_the_buffer():
    from overlapkernels.comm.symmetric import SymmetricTensor

    peers = tuple(torch.arange(12.0) + 100 * q for q in range(2))
    ptrs = torch.tensor([p.data_ptr() for p in peers])
    whole = SymmetricTensor(1, 2, peers[1], ptrs, peers)
    part = whole.prefix((2, 3))
    assert torch.equal(part.peer(0), torch.arange(6.0).view(2, 3)) and torch.equal(part.local, part.peer(1))
    assert part.local.data_ptr() == peers[1].data_ptr() and part.local.shape == (2, 3)
    assert [p.data_ptr() for p in part.peers] == ptrs.tolist() and part.peer_ptrs is ptrs
    with pytest.raises(ValueError, match="prefix of 13 elements asked of a symmetric buffer of 12"):
        whole.prefix((13,))


def _methods_alternating_on_rank(ctx):
    """symm and fused calls interleaved, as auto=measure times them (and as rules may pick one for
    one shape, the other for the next): one workspace per op, whose epochs, release flags and
    partial counts carry from a call of one method to a call of the other."""
    r, w = ctx.rank, ctx.world_size
    exact = []
    for call, method in enumerate(["symm", "fused", "fused", "symm", "fused"]):
        shards = [_ints((3, 8), 10 * call + q) for q in range(w)]
        b = _ints((8, 5), 100 + call)
        exact.append(torch.equal(ok.all_gather_matmul(shards[r], b, ctx, method=method), torch.cat(shards) @ b))
        a_all = [_ints((w * 3, 8), 200 + 10 * call + q) for q in range(w)]
        exact.append(torch.equal(ok.matmul_reduce_scatter(a_all[r], b, ctx, method=method),
                                 sum(a @ b for a in a_all).chunk(w)[r]))
    kinds = sorted(key[0] for key in ctx._workspaces if key[0] in ("ag", "rs"))
    return exact, kinds


@pytest.mark.parametrize("world", [2, 3])
def test_symm_and_fused_calls_share_one_workspace_per_op(world):
    """Symmetric memory is never freed: a workspace per method kept the losing method's buffers
    for the life of the process wherever both ran (auto=measure runs both on every new shape)."""
    for exact, kinds in ThreadWorld(world, timeout=60).run(_methods_alternating_on_rank):
        assert exact == [True] * 10
        assert kinds == ["ag", "rs"], kinds


_planted = threading.local()


def _stops_mid_protocol_on_rank(ctx, op, where):
    """Call 1 on both ranks; then in call 2 on rank 0 the copy engine refuses its first submission
    (``where="submit"``: as an allocation failing mid-call, after this rank signalled its peers) or
    the reduce-scatter's fp32 sum cannot be allocated (``"sum"``: before it signals), and rank 0
    calls once more. Rank 1 makes call 2 only."""
    def call():
        if op == "ag":
            return ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 2), ctx, method="symm")
        return ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 2), ctx, method="symm")

    class OutOfMemory:
        def submit(self, *args, **kwargs):
            raise RuntimeError("CUDA out of memory (planted)")

        def synchronize(self):
            real.synchronize()

    call()
    real, said = ctx.side_stream(), []
    ctx.wait_timeout = 0.5  # the waits that fail here: rank 1's for a partial rank 0 never pushed
    if ctx.rank == 0 and where == "submit":
        ctx.side_stream = OutOfMemory
    _planted.fail = ctx.rank == 0 and where == "sum"
    for _ in range(2 if ctx.rank == 0 else 1):
        try:
            call()
            said.append("ok")
        except Exception as exc:  # noqa: BLE001 - what each call raised is the result
            said.append(f"{type(exc).__name__}: {str(exc)[:300]}")
    return said


@pytest.fixture
def sum_allocation_fails(monkeypatch):
    from overlapkernels.ops import _peer_methods

    def failing(dtype):
        if getattr(_planted, "fail", False):
            raise RuntimeError("CUDA out of memory (planted)")
        return accumulation_dtype(dtype)

    accumulation_dtype = _peer_methods.accumulation_dtype
    monkeypatch.setattr(_peer_methods, "accumulation_dtype", failing)


@pytest.mark.usefixtures("sum_allocation_fails")
@pytest.mark.parametrize("op, where", [("ag", "submit"), ("rs", "submit"), ("rs", "sum")])
def test_a_call_stopped_mid_protocol_refuses_the_next_at_once(op, where):
    """Was: a rank whose call raised after it had signalled its peers (an out-of-memory error
    between its publish and its pulls or pushes) left its flags a call behind theirs for good, so
    each of its later calls spun until the wait timeout and then computed with stale slots. Now
    the workspace remembers why it stopped, and the next call raises that at once."""
    rank0, rank1 = ThreadWorld(2, timeout=60).run(_stops_mid_protocol_on_rank, op, where)
    name = "all_gather_matmul" if op == "ag" else "matmul_reduce_scatter"
    assert rank0[0] == "RuntimeError: CUDA out of memory (planted)"
    assert rank0[1].startswith(f"RuntimeError: ok/{name}[symm]: an earlier call on this group stopped mid-protocol "
                               f"(ok/{name}[symm]: RuntimeError: CUDA out of memory (planted))"), rank0[1]
    # rank 1: rank 0 published its shard before it stopped (AG: rank 1's call completes); it never
    # pushed its partial (RS: rank 1's wait for it times out, naming it)
    assert rank1 == ["ok"] if op == "ag" else \
        rank1[0].startswith("SignalTimeoutError: ok/matmul_reduce_scatter[symm]: rank 1 timed out waiting for rank 0's "
                            "partial of chunk 1"), rank1
