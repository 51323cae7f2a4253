"""symm and fused in the thread world: the gathered input's gradient (reduce-scattered through the
peer protocol) and results that later calls must not overwrite; an owner that releases its
reduce-scatter slots only after summing them, shown by a rank held right after its release (a
handshake, not a sleep). Each test here once passed every other test with a plausible bug planted."""
import threading

import pytest
import torch

import overlapkernels as ok
from overlapkernels.comm.thread_world import ThreadWorld


def _ints(shape, seed):
    return torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(seed)).to(torch.float32)


def _gathered_on_rank(ctx, method):
    r, w = ctx.rank, ctx.world_size
    shards = [_ints((3, 8), q) for q in range(w)]
    b = _ints((8, 4), 50)
    a = shards[r].clone().requires_grad_()
    gathered, out = ok.all_gather_matmul(a, b, ctx, return_gathered=True, method=method)
    # every rank's loss uses the gathered input with weights of its own, position by position
    g_gathered = [_ints((w * 3, 8), 60 + q) for q in range(w)]
    g_out = [_ints((w * 3, 4), 70 + q) for q in range(w)]
    torch.autograd.backward([gathered, out], [g_gathered[r], g_out[r]])
    want = sum(gg + go @ b.T for gg, go in zip(g_gathered, g_out)).chunk(w)[r]  # small integers: exact
    assert torch.equal(a.grad, want), (r, a.grad, want)
    # a second call of the same shape leaves the first call's results alone
    others = [_ints((3, 8), 10 + q) for q in range(w)]
    gathered2, out2 = ok.all_gather_matmul(others[r], b, ctx, return_gathered=True, method=method)
    assert torch.equal(gathered2, torch.cat(others))
    assert torch.equal(gathered.detach(), torch.cat(shards)) and torch.equal(out.detach(), torch.cat(shards) @ b)
    return True


@pytest.mark.parametrize("method", ["symm", "fused"])
def test_the_gathered_inputs_gradient_and_later_calls(method):
    assert ThreadWorld(2, timeout=60).run(_gathered_on_rank, method) == [True, True]


def _two_reduce_scatters_on_rank(ctx):
    r, w = ctx.rank, ctx.world_size
    for call in range(2):
        a_all = [_ints((w * 4, 8), 100 * call + q) for q in range(w)]
        b_all = [_ints((8, 5), 100 * call + 50 + q) for q in range(w)]
        out = ok.matmul_reduce_scatter(a_all[r], b_all[r], ctx, method="symm")
        want = sum(x @ y for x, y in zip(a_all, b_all)).chunk(w)[r]
        assert torch.equal(out, want), (r, call)
    return True


def test_an_owner_sums_its_partials_before_releasing_its_slots(monkeypatch):
    """Rank 1, right after releasing its slots of call 1, is held until rank 0 has pushed its
    partial of call 2 into them: had it released before summing, it would sum call 2's partial."""
    from overlapkernels.kernels.triton import signals as sig

    add, set_ = sig.add_peer_flag, sig.set_peer_flag
    pushes_to_rank_1, pushed_again = [], threading.Event()

    def add_peer_flag(pads, peer, index, value):
        add(pads, peer, index, value)
        if (peer, index) == (1, 0):  # rank 0 counted a partial in owner 1's pad (all-gather counts at W + r)
            pushes_to_rank_1.append(value)
            if len(pushes_to_rank_1) == 2:
                pushed_again.set()

    def set_peer_flag(pads, peer, index, value):
        set_(pads, peer, index, value)
        if (peer, index, value) == (0, 3, 1):  # rank 1 (of 2) released its slots of call 1 at rank 0
            assert pushed_again.wait(timeout=20), "rank 0 never pushed call 2's partial"

    monkeypatch.setattr(sig, "add_peer_flag", add_peer_flag)
    monkeypatch.setattr(sig, "set_peer_flag", set_peer_flag)
    assert ThreadWorld(2, timeout=60).run(_two_reduce_scatters_on_rank) == [True, True]
    assert len(pushes_to_rank_1) == 2


class _TorchCountingMatmuls:
    """``torch`` as _peer_methods sees it, calling ``after_matmul`` after each ``torch.matmul``."""

    def __init__(self, after_matmul):
        self._after = after_matmul

    def __getattr__(self, name):
        return getattr(torch, name)

    def matmul(self, *args, **kwargs):
        out = torch.matmul(*args, **kwargs)
        self._after()
        return out


def _one_gather_on_rank(ctx):
    r, w = ctx.rank, ctx.world_size
    shards = [_ints((3, 8), 20 + q) for q in range(w)]
    b = _ints((8, 4), 30)
    out = ok.all_gather_matmul(shards[r], b, ctx, method="symm")
    assert torch.equal(out, torch.cat(shards) @ b), r
    return True


def test_symm_marks_a_chunk_arrived_only_once_it_is_copied(monkeypatch):
    """The copy engine, right after it marks a chunk arrived, is held until every rank has run both
    its chunk GEMMs: marked before its copy, a chunk would be multiplied before it is there."""
    from overlapkernels.kernels.triton import signals as sig
    from overlapkernels.ops import _peer_methods

    matmuls, all_ran = [], threading.Event()

    def after_matmul():
        matmuls.append(1)
        if len(matmuls) == 4:  # 2 ranks x (the local chunk, the peer's)
            all_ran.set()

    set_flag_now = sig.set_flag_now

    def held_set_flag_now(flag, value):
        set_flag_now(flag, value)
        assert all_ran.wait(timeout=20), "the chunk GEMMs never ran"

    monkeypatch.setattr(_peer_methods, "torch", _TorchCountingMatmuls(after_matmul))
    monkeypatch.setattr(sig, "set_flag_now", held_set_flag_now)
    assert ThreadWorld(2, timeout=60).run(_one_gather_on_rank) == [True, True]
    assert len(matmuls) == 4
