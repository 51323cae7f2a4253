"""What ring attention sends and keeps, and the merge it folds blocks with: properties that the
value tests (test_ring_attention_gloo.py) cannot see, since a ring that replicated GQA heads,
sent 16-bit gradient partial sums or kept every step's output would compute the same numbers
in fp64. Each is a failure seen in a peer (REFERENCES.md: torchtitan replicating KV heads,
ring-flash-attention's backward error growing with the ring, TransformerEngine's per-step outputs)."""
import importlib
import math
import weakref

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.comm.ring import Ring
from overlapkernels.kernels import attention_ref

ra = importlib.import_module("overlapkernels.ops.ring_attention")


# ---------------------------------------------------------------------------------------- merge
def _lse(scores):
    return torch.logsumexp(scores, dim=-1)


def test_merging_two_blocks_equals_attention_over_both():
    """Two halves of a key set merged equal softmax over all of it (fp64, random scores, values)."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(2, 3, 5, 10, generator=g, dtype=torch.float64) * 4
    v = torch.randn(2, 3, 10, 7, generator=g, dtype=torch.float64)
    halves = [(torch.softmax(s[..., i], -1) @ v[:, :, i], _lse(s[..., i])) for i in (slice(0, 4), slice(4, 10))]
    out, lse = attention_ref.merge(*halves[0], *halves[1])
    torch.testing.assert_close(out, torch.softmax(s, -1) @ v, atol=1e-13, rtol=1e-13)
    torch.testing.assert_close(lse, _lse(s), atol=1e-13, rtol=1e-13)


def test_merge_is_overflow_safe_in_fp32():
    """lse values far apart (1e4 vs -1e4, or both near 1e4): exp(lse) overflows fp32, the sigmoid
    form does not. The larger block wins outright; equal ones average."""
    o1, o2 = torch.full((1, 1, 2, 3), 2.0), torch.full((1, 1, 2, 3), -4.0)
    out, lse = attention_ref.merge(o1, torch.tensor([[[1e4, -1e4]]]), o2, torch.tensor([[[-1e4, 1e4]]]))
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(out[0, 0, 0], o1[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 1], o2[0, 0, 1])
    torch.testing.assert_close(lse, torch.tensor([[[1e4, 1e4]]]))
    out, lse = attention_ref.merge(o1, torch.tensor([[[1e4, 1e4]]]), o2, torch.tensor([[[1e4, 1e4]]]))
    torch.testing.assert_close(out, torch.full_like(o1, -1.0))
    torch.testing.assert_close(lse, torch.full((1, 1, 2), 1e4 + math.log(2)))


def test_merge_with_an_empty_side_keeps_the_other():
    """An lse of -inf means no visible key: that side contributes nothing, whichever side it is, and
    two empty sides stay empty (out 0, lse -inf), never NaN."""
    inf = float("inf")
    o1, o2 = torch.full((1, 1, 3, 2), 5.0), torch.full((1, 1, 3, 2), 7.0)
    out, lse = attention_ref.merge(o1, torch.tensor([[[-inf, 1.5, -inf]]]), o2, torch.tensor([[[0.5, -inf, -inf]]]))
    torch.testing.assert_close(out[0, 0, 0], o2[0, 0, 0])
    torch.testing.assert_close(out[0, 0, 1], o1[0, 0, 1])
    torch.testing.assert_close(lse[0, 0, :2], torch.tensor([0.5, 1.5]))
    assert lse[0, 0, 2] == -inf and not out.isnan().any()
    zeros = torch.zeros(1, 1, 1, 2)
    out, lse = attention_ref.merge(zeros, torch.tensor([[[-inf]]]), zeros, torch.tensor([[[-inf]]]))
    assert (out == 0).all() and lse.item() == -inf


def test_merge_propagates_a_nan_side():
    """NaN (from a NaN or inf in q or k) is not "nothing visible": it must reach the output, as in
    SDPA, or a diverged run hides behind a finite loss. Only -inf means empty."""
    nan, inf = float("nan"), float("inf")
    o1, o2 = torch.full((1, 1, 3, 2), 5.0), torch.full((1, 1, 3, 2), nan)
    out, lse = attention_ref.merge(o1, torch.tensor([[[1.0, -inf, 2.0]]]), o2, torch.tensor([[[nan, nan, -inf]]]))
    assert out[0, 0, :2].isnan().all() and lse[0, 0, :2].isnan().all()
    assert torch.equal(out[0, 0, 2], o1[0, 0, 2]) and lse[0, 0, 2] == 2.0


def _nonfinite_key_on_rank(bad, backend):
    """One NaN or inf key element, held by the last rank: on every rank exactly the rows SDPA makes
    non-finite are non-finite, in out and dq (inf: the rows whose score with it is +inf; NaN: all),
    and the others match SDPA - not a finite result that silently left out the block holding it."""
    import torch.nn.functional as F

    ra = importlib.import_module("overlapkernels.ops.ring_attention")  # the module, not the function
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    dtype = torch.float64 if backend == "torch" else torch.float32
    q, k, v = (torch.randn(1, 2, 4 * world, 16, generator=g, dtype=dtype).requires_grad_() for _ in range(3))
    with torch.no_grad():
        k[0, 1, -1, 3] = bad  # head 1 only
    want = F.scaled_dot_product_attention(q, k, v)
    want.sum().backward()
    local = lambda x: ok.shard_sequence(x.detach(), dim=2, layout="contiguous")
    ql, kl, vl = (local(x).requires_grad_() for x in (q, k, v))
    out, lse = ra.RingAttention.apply(ql, kl, vl, None, dist.group.WORLD, False, 16 ** -0.5, "contiguous", backend)
    out.sum().backward()
    same = []
    for got, ref in ((out, local(want)), (ql.grad, local(q.grad))):
        bad_rows = ~torch.isfinite(ref).all(-1)
        same.append(torch.equal(~torch.isfinite(got).all(-1), bad_rows) and bool(bad_rows[:, 1].any()))
        torch.testing.assert_close(got[~bad_rows], ref[~bad_rows], atol=1e-5, rtol=1e-5)
    return same


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nonfinite_key_propagates_like_sdpa(rank_pool, bad, backend):
    assert rank_pool(2).run(_nonfinite_key_on_rank, bad, backend) == [[True, True]] * 2


# ------------------------------------------------------------------------ what travels the ring
def _traffic_on_rank(dtype):
    """Record every ring exchange of a causal zigzag GQA call (H=4, H_kv=2) and its backward."""
    sent = []
    original = Ring.exchange

    def recording(self, send, to, recv, frm, *, tag=0):
        sent.extend((tag, tuple(t.shape), t.dtype) for t in ([send] if isinstance(send, torch.Tensor) else send))
        return original(self, send, to, recv, frm, tag=tag)

    Ring.exchange = recording
    try:
        g = torch.Generator().manual_seed(dist.get_rank())
        q = torch.randn(1, 8, 4, 16, generator=g).to(dtype).requires_grad_()
        k = torch.randn(1, 8, 2, 16, generator=g).to(dtype).requires_grad_()
        v = torch.randn(1, 8, 2, 16, generator=g).to(dtype).requires_grad_()
        ok.ring_attention(q, k, v, causal=True).sum().backward()
    finally:
        Ring.exchange = original
    return sent


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_only_real_kv_heads_travel_and_gradients_travel_in_fp32(rank_pool, dtype):
    """K/V travel with their H_kv heads (not repeated to H) in the input dtype; the dK/dV partial
    sums travel in fp32, so P hops add P roundings of fp32, not of the 16-bit type. World 4:
    3 K/V hops in forward and backward each, 4 gradient hops."""
    world = 4
    for sent in rank_pool(world).run(_traffic_on_rank, dtype):
        kv = [(shape, dt) for tag, shape, dt in sent if tag == ra.KV_TAG]
        grads = [(shape, dt) for tag, shape, dt in sent if tag == ra.GRAD_TAG]
        # [B, H_kv, S_local, D]: the kernels' layout
        assert kv == [((1, 2, 8, 16), dtype)] * (2 * 2 * (world - 1)), kv
        assert grads == [((1, 2, 8, 16), torch.float32)] * (2 * world), grads


# ------------------------------------------------------------------------------- what it keeps
def _live_block_outputs_on_rank():
    """The forward merges each block's output as it comes: at most one block output (the one the
    loop variable still holds) is alive when the next is computed, however many blocks there are."""
    original, outputs, most_alive = attention_ref.block_forward, [], [0]

    def tracking(*args, **kwargs):
        most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in outputs))
        o, lse = original(*args, **kwargs)
        outputs.append(weakref.ref(o))
        return o, lse

    attention_ref.block_forward = tracking
    try:
        g = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 8, 2, 4, generator=g, dtype=torch.float64) for _ in range(3))
        ok.ring_attention(q, k, v, causal=False, layout="zigzag")  # 2 segments x 2 segments x 4 blocks
    finally:
        attention_ref.block_forward = original
    return len(outputs), most_alive[0]


def test_forward_keeps_no_per_step_outputs(rank_pool):
    assert rank_pool(4).run(_live_block_outputs_on_rank) == [(16, 1)] * 4


def _live_gradient_sums_on_rank():
    """Backward passes each block's dK/dV partial sums on as they are made: when a step sends its
    sums, at most the previous step's (whose send may still be in flight) are alive besides them -
    not every step's, which would hold P blocks' gradients."""
    sent, most_alive, original = [], [0], Ring.exchange

    def tracking(self, send, to, recv, frm, *, tag=0):
        if tag == ra.GRAD_TAG:
            most_alive[0] = max(most_alive[0], sum(ref() is not None for ref in sent))
            sent.extend(weakref.ref(t) for t in send)
        return original(self, send, to, recv, frm, tag=tag)

    Ring.exchange = tracking
    try:
        q = torch.randn(1, 2, 4, 4, dtype=torch.float64, requires_grad=True)
        ok.ring_attention(q, q, q).sum().backward()  # 4 steps, 4 gradient hops of (dK, dV)
    finally:
        Ring.exchange = original
    return len(sent), most_alive[0]


def test_backward_keeps_no_per_step_gradient_sums(rank_pool):
    assert rank_pool(4).run(_live_gradient_sums_on_rank) == [(8, 2)] * 4


def _allgather_baseline_on_rank():
    """The benchmark's unoverlapped baseline (all-gather K/V, then every block) computes what the
    ring does: its times are only comparable if its answers are."""
    ra = importlib.import_module("overlapkernels.ops.ring_attention")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 8, 8, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64) + rank  # every rank's block differs
    v = torch.randn(1, 2, 8, 8, generator=g, dtype=torch.float64) * (1 + rank)
    for layout, causal in (("zigzag", True), ("contiguous", True), ("contiguous", False)):
        out, lse = ra.ring_forward(q, k, v, dist.group.WORLD, causal, 0.3, layout, "torch")
        base_out, base_lse = ra.allgather_kv_forward(q, k, v, dist.group.WORLD, causal, 0.3, layout, "torch")
        torch.testing.assert_close(base_out, out, atol=1e-12, rtol=1e-12, msg=lambda m, lo=layout: f"{lo}: {m}")
        torch.testing.assert_close(base_lse, lse, atol=1e-12, rtol=1e-12, msg=lambda m, lo=layout: f"{lo}: {m}")
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_allgather_kv_baseline_equals_the_ring(rank_pool, world):
    assert rank_pool(world).run(_allgather_baseline_on_rank) == [True] * world


def _head_dim_zero_on_rank():
    q = torch.zeros(1, 4, 2, 0, requires_grad=True)
    out, lse = ok.ring_attention(q, q, q, causal=True, layout="zigzag", return_lse=True)
    out.sum().backward()
    return tuple(out.shape), tuple(lse.shape), tuple(q.grad.shape)


def test_head_dim_zero_gives_an_empty_result_not_a_division_by_zero(rank_pool):
    """SDPA returns an empty result for D = 0; the default scale 1/sqrt(D) must not raise first."""
    assert rank_pool(2).run(_head_dim_zero_on_rank) == [((1, 4, 2, 0), (1, 2, 4), (1, 4, 2, 0))] * 2


def _failing_step_on_rank(where):
    """A rank-local error inside a ring step (an out-of-memory, a kernel's limit) left that step's
    posted exchange unwaited: gloo's pair was then unusable and the next collective of the group
    hung on every rank. Now the step's exchanges are waited for before the error propagates - in
    backward's last step too, where the one in flight is the previous step's dK/dV hop (whether an
    unwaited one hangs depends on timing there, so every posted exchange is checked to be waited)."""
    import overlapkernels.kernels.attention_ref as ref

    q = torch.randn(1, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    module, name = (ra, "_attend_block") if where == "forward" else (ref, "block_backward")
    original, calls, posted, exchange = getattr(module, name), [], [], Ring.exchange

    class Waited:
        def __init__(self, work):
            self.work, self.waited = work, False

        def wait(self, *args):
            self.waited = True
            return self.work.wait(*args)

    def planted(*args, **kwargs):
        calls.append(None)
        if where == "backward, last step" and len(calls) == 1:  # (one block per step: contiguous, not causal)
            return original(*args, **kwargs)
        raise RuntimeError("planted: out of memory")

    def recording(self, *args, **kwargs):
        works = [Waited(work) for work in exchange(self, *args, **kwargs)]
        posted.extend(works)
        return works

    setattr(module, name, planted)
    Ring.exchange = recording
    try:
        ok.ring_attention(q, q, q).sum().backward()
        said = "no error"
    except RuntimeError as exc:
        said = str(exc)
    finally:
        setattr(module, name, original)
        Ring.exchange = exchange
    dist.barrier()  # hung (until the pool's timeout) before
    return said, bool(posted) and all(work.waited for work in posted)


@pytest.mark.parametrize("where", ["forward", "backward", "backward, last step"])
def test_an_error_inside_a_ring_step_leaves_the_group_usable(rank_pool, where):
    assert rank_pool(2).run(_failing_step_on_rank, where) == [("planted: out of memory", True)] * 2


def _kernel_limits_on_rank():
    """The Triton kernels' limits (the CUDA default backend) were checked inside the ring's first
    step, after its exchange was posted: now before anything is sent, like every other bad input.
    Sparse inputs are refused by name too (torch's own errors before)."""
    from comm_guard import no_communication

    said = []
    default = ra.default_backend
    ra.default_backend = lambda q: "triton"  # (what CUDA tensors get)
    try:
        big = torch.ones(65536, 2, 1, 2)  # 65536 batch rows: past CUDA's grid axis
        with no_communication():
            for call in (lambda: ok.ring_attention(big, big, big),
                         lambda: ok.ring_attention(torch.eye(4).reshape(1, 1, 4, 4).to_sparse(), big, big)):
                try:
                    call()
                except (ValueError, TypeError) as exc:
                    said.append(str(exc))
    finally:
        ra.default_backend = default
    return said


def test_kernel_limits_and_sparse_inputs_are_refused_before_the_ring(rank_pool):
    for said in rank_pool(2).run(_kernel_limits_on_rank):
        assert said[0].startswith("flash attention (Triton): q.shape=(65536, 1, 2, 2): batch and heads must each be "
                                  "<= 65535"), said
        assert said[1].startswith("q is a sparse_coo tensor; these ops take dense (strided) tensors"), said


def _exchanges_matched_by_tag_on_rank():
    """Two exchanges between the same ranks in flight at once, posted in opposite orders on the two
    ranks (ring attention's K/V and gradient exchanges): each message lands where its tag says, not
    in whichever receive was posted first."""
    ring, rank = Ring.of(dist.group.WORLD), dist.get_rank()
    peer = 1 - rank
    sends = {tag: torch.full((4,), float(10 * rank + tag)) for tag in (1, 2)}
    recvs = {tag: torch.zeros(4) for tag in (1, 2)}
    works = [ring.exchange(sends[tag], peer, recvs[tag], peer, tag=tag) for tag in ((1, 2) if rank == 0 else (2, 1))]
    for w in works:
        for work in w:
            work.wait()
    return {tag: recvs[tag][0].item() for tag in (1, 2)}


def test_concurrent_exchanges_are_matched_by_tag(rank_pool):
    assert rank_pool(2).run(_exchanges_matched_by_tag_on_rank) == [{1: 11.0, 2: 12.0}, {1: 1.0, 2: 2.0}]

