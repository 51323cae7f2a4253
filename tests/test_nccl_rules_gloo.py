"""What NCCL refuses or pairs differently from gloo, checked on gloo ranks (``nccl_like``): strided
inputs to the ops, as models make them (q, k, v cut from one packed projection), and whole training
steps of every composition only ever hand contiguous tensors to a collective or P2P op, their P2P
messages pair in posting order as they do by tag (NCCL ignores tags), and no rank posts a collective
and a P2P batch on one communicator in the opposite order to its peers. Each strided call also
equals the same call on contiguous copies, bitwise."""
import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels import _compat
from overlapkernels.comm import collectives
from nccl_like import Collective, NonContiguous, check_p2p_logs, nccl_rules
from test_train_4d import _compose_on_rank


def _grads(fn, *inputs):
    inputs = [t.detach().requires_grad_() for t in inputs]
    out = fn(*inputs)
    outs = out if isinstance(out, (list, tuple)) else [out]
    g = torch.Generator().manual_seed(9)
    torch.autograd.backward(outs, [torch.randn(o.shape, generator=g, dtype=o.dtype) for o in outs])
    return [o.detach() for o in outs] + [t.grad for t in inputs]


def _same(name, strided_fn, args):
    """``strided_fn`` on strided views of ``args`` vs on contiguous copies: both checked, equal."""
    with nccl_rules() as log:
        got = _grads(strided_fn, *args)
        want = _grads(strided_fn, *[a.contiguous() for a in args])
    P2P_LOG.extend(log)
    for i, (x, y) in enumerate(zip(got, want)):
        torch.testing.assert_close(x, y, atol=0, rtol=0, msg=lambda m, i=i: f"{name}[{i}]: {m}")


P2P_LOG = []


def _strided_ops_on_rank(method):
    rank, world = dist.get_rank(), dist.get_world_size()
    P2P_LOG.clear()
    g = torch.Generator().manual_seed(rank)
    packed = torch.randn(7, 3 * 6, dtype=torch.float64, generator=g)  # a fused QKV projection's output
    w = torch.randn(6, 5, dtype=torch.float64, generator=g)
    x = packed[:, 6:12]
    assert not x.is_contiguous()
    _same("all_gather_matmul", lambda a, b: ok.all_gather_matmul(a, b, method=method), (x, w))
    _same("all_gather_matmul gather_dim=1", lambda a, b: ok.all_gather_matmul(a, b, gather_dim=1, method=method),
          (torch.randn(2, 3, 6, dtype=torch.float64, generator=g).transpose(0, 1), w))
    a = torch.randn(world * 4, 2 * 6, dtype=torch.float64, generator=g)[:, ::2]
    _same("matmul_reduce_scatter", lambda a, b: ok.matmul_reduce_scatter(a, b, method=method), (a, w))

    qkv = torch.randn(2, 4 * world, 3, 2, 4, dtype=torch.float64, generator=g)  # [B, S_local, (q,k,v), H, D]
    for layout, causal in (("zigzag", True), ("contiguous", False)):
        _same(f"ring_attention {layout}",
              lambda q, k, v, lo=layout, c=causal: ok.ring_attention(q, k, v, causal=c, layout=lo),
              qkv.unbind(2))
    return P2P_LOG


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_strided_op_inputs_keep_nccl_rules(rank_pool, world, method):
    """The ops' rings (decomposed AG and RS, their backward, ring attention forward and backward)."""
    logs = rank_pool(world).run(_strided_ops_on_rank, method)
    assert check_p2p_logs(logs) > 0  # ring attention exchanges K/V with every method


def _checked_composition_on_rank(layout, schedule, zero_stage):
    with nccl_rules() as log:
        return _compose_on_rank(layout, schedule, zero_stage=zero_stage), log


@pytest.mark.parametrize("layout, schedule, zero_stage", [
    (dict(tp=2, pp=2), "1f1b", 1), (dict(cp=2, pp=2), "zb-h1", 2), (dict(tp=2, dp=2), "1f1b", 3),
    (dict(dp=2, pp=2), "zb-h1", 3)])
def test_training_steps_keep_nccl_rules(rank_pool, layout, schedule, zero_stage):
    """TP + SP layers, vocab-parallel loss, ring attention, pipeline P2P and ZeRO 1/2/3 gathers
    and reductions, as Trainer runs them (ZB-H1 at dp=2: reductions on the DP group started after
    each W, between the PP group's P2P batches)."""
    results = rank_pool(4).run(_checked_composition_on_rank, layout, schedule, zero_stage)
    assert all(losses == results[0][0] for losses, _ in results)
    logs = [log for _, log in results]
    assert check_p2p_logs(logs) > 0
    assert {item[0] for log in logs for _, item in log if isinstance(item, Collective)} >= {"all_reduce"}


def _planted_on_rank():
    x = torch.ones(4, 4, dtype=torch.float64)
    with nccl_rules():
        collectives.all_reduce(x)  # the package's alias of dist.all_reduce is checked too
        try:  # the package's in-place all_reduce refuses a strided tensor itself, before any rank sends
            collectives.all_reduce(x.t()[:, :2])
            return False
        except ValueError as exc:
            assert "all_reduce: x of shape (4, 2) with strides (1, 4) is not contiguous" in str(exc)
        try:  # through an alias the package bound at import (_compat's): checked like dist's own
            out = torch.empty(2 * dist.get_world_size(), 4, dtype=torch.float64)
            _compat.all_gather_single(out, x.t()[:2], group=dist.group.WORLD)
        except NonContiguous as exc:
            return "all_gather" in str(exc)
    return False


def test_the_check_catches_a_strided_collective(rank_pool):
    assert rank_pool(2).run(_planted_on_rank) == [True, True]


def test_the_replay_catches_a_collective_and_a_batch_posted_in_opposite_orders():
    """On one communicator: rank 0 sends, then joins an all-reduce; rank 1 joins the all-reduce
    before it receives. NCCL hangs (each waits for the other); in the same order it completes."""
    send, recv, reduce = [(True, 1, 0, (4,), "f")], [(False, 0, 0, (4,), "f")], Collective(("all_reduce", (0, 1)))
    assert check_p2p_logs([[("g", send), ("g", reduce)], [("g", recv), ("g", reduce)]]) == 2
    with pytest.raises(AssertionError, match="deadlock"):
        check_p2p_logs([[("g", send), ("g", reduce)], [("g", reduce), ("g", recv)]])
    with pytest.raises(AssertionError, match="rank 0's collective 0 is all_reduce, rank 1's is"):
        check_p2p_logs([[("g", reduce)], [("g", Collective(("barrier", (0, 1))))]])


def test_the_replay_catches_messages_that_only_tags_pair():
    """gloo pairs these by tag; NCCL, in order, would swap the two tensors."""
    first, second = (True, 1, 7, (4,), "torch.float32"), (True, 1, 8, (4,), "torch.float32")
    as_recv = lambda op: (False, 0, *op[2:])  # noqa: E731
    check_p2p_logs([[("g", [first, second])], [("g", [as_recv(first), as_recv(second)])]])
    with pytest.raises(AssertionError, match="rank 0 -> rank 1"):
        check_p2p_logs([[("g", [first, second])], [("g", [as_recv(second), as_recv(first)])]])
