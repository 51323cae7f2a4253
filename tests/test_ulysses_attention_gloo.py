"""ulysses_attention (context parallelism by all-to-all) on gloo ranks: against SDPA over the whole
sequence (fp64, ring attention's own cases and packed documents), against ring attention, and its
bad inputs refused before any communication."""
import functools
import importlib
import re

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from comm_guard import no_communication
from test_ring_attention_gloo import _case_on_rank as dense_case
from overlapkernels.ops.sequence_shard import reorder_parts
from test_ring_attention_segments_gloo import _case_on_rank as documents_case

ua = importlib.import_module("overlapkernels.ops.ulysses_attention")  # the module (the package re-exports the function)

# (layout, causal, heads, kv_heads, qkv_format, lse): heads split over 2 and 4 ranks; key/value heads
# split too, or fewer than the ranks (copied: GQA 8/2 and MQA on 4 ranks)
CASES = [
    ("zigzag", True, 4, 4, "bshd", False), ("contiguous", True, 8, 4, "bshd", True),
    ("contiguous", False, 4, 4, "sbhd", False), ("zigzag", False, 8, 2, "bshd", True),
    ("zigzag", True, 4, 1, "bshd", True),  # MQA: the one key/value head goes to every rank
    ("zigzag", True, 8, 2, "sbhd", "only"),  # the lse alone: out's gradient arrives as None
    ("zigzag", True, 8, 8, "bshd", True),  # 2 head groups (the default) on 4 ranks too
]
DOCUMENT_CASES = [
    ("zigzag", True, 4, 2, "bshd", "packed"), ("contiguous", False, 4, 4, "sbhd", "packed"),
    ("zigzag", True, 8, 4, "bshd", "unsorted"),
]


def _all_cases_on_rank():
    for case in CASES:
        dense_case(*case, attention=ok.ulysses_attention)
    dense_case("zigzag", True, 4, 2, "bshd", False, scale=0.3, attention=ok.ulysses_attention)
    for case in DOCUMENT_CASES:
        documents_case(*case, attention=ok.ulysses_attention)
    return True


@pytest.mark.parametrize("world", [2, 4])
def test_matches_sdpa_on_the_full_sequence(rank_pool, world):
    """out, lse, dq, dk, dv against SDPA over the whole sequence (to 1e-10 in fp64), every layout
    and format, GQA/MQA with key/value heads split or copied, packed documents (sorted or not)."""
    assert rank_pool(world).run(_all_cases_on_rank) == [True] * world


def _planted_on_rank():
    try:
        dense_case("zigzag", True, 4, 2, "bshd", False, planted=1e-8, attention=ok.ulysses_attention)
    except AssertionError as exc:
        return str(exc).split(":")[0]
    return "missed"


def test_a_small_planted_error_is_caught(rank_pool):
    assert rank_pool(2).run(_planted_on_rank) == ["out"] * 2


def _against_ring_on_rank(layout):
    """The same inputs through both: one result (fp64, to reduction order)."""
    g = torch.Generator().manual_seed(dist.get_rank())
    q, k, v = (torch.randn(2, 8, h, 4, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    ids = torch.tensor([[0] * 3 + [1] * 5, [2] * 8]).roll(dist.get_rank(), 1)
    results = []
    for attention in (ok.ring_attention, ok.ulysses_attention):
        for t in (q, k, v):
            t.grad = None
        out, lse = attention(q, k, v, causal=True, layout=layout, return_lse=True, segment_ids=ids)
        (out.square().sum() + lse.sum()).backward()
        results.append([out.detach(), lse.detach(), q.grad, k.grad, v.grad])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-10, rtol=1e-10)
    return True


@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_agrees_with_ring_attention(rank_pool, layout):
    assert rank_pool(2).run(_against_ring_on_rank, layout) == [True] * 2


def test_reordering_round_trips():
    """The ranks' parts in rank order to the sequence's order and back, for both layouts."""
    x = torch.arange(24).reshape(1, 24)
    for world in (1, 2, 3):
        natural = reorder_parts(x, 1, "zigzag", world, to_sequence=True)
        assert torch.equal(reorder_parts(natural, 1, "zigzag", world, to_sequence=False), x)
        assert torch.equal(reorder_parts(x, 1, "contiguous", world, to_sequence=True), x)
    # rank order of 2 ranks under zigzag: chunks 0, 3 | 1, 2 (6 positions each)
    assert reorder_parts(x, 1, "zigzag", 2, to_sequence=True)[0, ::6].tolist() == [0, 12, 18, 6]


BAD = [  # (q heads, kv heads, error, message): on 2 ranks
    (3, 3, ValueError, r"q \(bshd dim 2\) has 3 heads, not divisible by the group size 2"),
    (6, 3, ValueError, r"k/v have 3 heads and the group 2 ranks: expected one to divide the other"),
]


def _bad_inputs_on_rank():
    for i, (heads, kv_heads, exc_type, pattern) in enumerate(BAD):
        q = torch.ones(2, 6, heads, 8, dtype=torch.float64)
        k = v = torch.ones(2, 6, kv_heads, 8, dtype=torch.float64)
        with pytest.raises(exc_type, match=pattern), no_communication():
            ok.ulysses_attention(q, k, v)
    q = k = v = torch.ones(2, 6, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"layout='zigzag' needs S divisible"), no_communication():
        ok.ulysses_attention(q[:, :5], k[:, :5], v[:, :5], layout="zigzag")
    with pytest.raises(ValueError, match=re.escape("q was laid out with layout='zigzag'")), no_communication():
        ok.ulysses_attention(ok.shard_sequence(torch.ones(2, 12, 2, 8), layout="zigzag"), k, v, layout="contiguous")
    with pytest.raises(TypeError, match=r"causal='yes': expected a bool"), no_communication():
        ok.ulysses_attention(q, k, v, causal="yes")
    solo = [dist.new_group([r]) for r in range(2)][dist.get_rank()]  # (collective: every rank makes both)
    with pytest.raises(ValueError, match=r"a ring part of 3 positions \(q's local 3 x the group's 1\) is odd"), \
            no_communication():
        ok.ulysses_attention(q[:, :3], k[:, :3], v[:, :3], solo, layout="zigzag", ring_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"layout='zig': expected one of"), no_communication():
        ok.ulysses_attention(q, k, v, solo, layout="zig", ring_group=dist.group.WORLD)
    total = torch.ones(1)
    dist.all_reduce(total)  # nobody communicated before raising
    return int(total)


def test_bad_input_raises_before_communicating(rank_pool):
    assert rank_pool(2).run(_bad_inputs_on_rank) == [2, 2]


@pytest.mark.usefixtures("world_of_one")
def test_group_of_one_is_local_attention():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 6, h, 4, generator=g, dtype=torch.float64) for h in (2, 1, 1))
    torch.testing.assert_close(ok.ulysses_attention(q, k, v, causal=True), ok.local_attention(q, k, v, causal=True),
                               atol=0, rtol=0)


def _edge_cases_on_rank():
    """Empty tensors (batch 0, local sequence 0, head dim 0) as ring_attention takes them, and the
    returned lse modified in place (ring_attention's is)."""
    for shape in [(0, 4, 2, 4), (1, 0, 2, 4), (1, 4, 2, 0)]:
        q = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        out, lse = ok.ulysses_attention(q, q, q, causal=True, return_lse=True)
        want, want_lse = ok.ring_attention(q, q, q, causal=True, return_lse=True)
        assert out.shape == want.shape and lse.shape == want_lse.shape
        (out.sum() + lse.sum()).backward()
    q = torch.randn(1, 4, 2, 4, dtype=torch.float64, requires_grad=True)
    out, lse = ok.ulysses_attention(q, q, q, causal=True, return_lse=True)
    lse += 1
    (out.sum() + lse.sum()).backward()
    return True


def test_empty_tensors_and_an_lse_modified_in_place(rank_pool):
    assert rank_pool(2).run(_edge_cases_on_rank) == [True] * 2


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_group_of_one_odd_sizes_with_lse(dtype):
    """A group of one: the received buffer's parts are not copied, and out's bytes (odd element
    counts) leave the fp32 lse part at an offset no float view may start at."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 3, 1, 3, generator=g, dtype=torch.float64).to(dtype) for _ in range(3))
    out, lse = ok.ulysses_attention(q, k, v, causal=True, return_lse=True)
    want, want_lse = ok.local_attention(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out, want, atol=0, rtol=0)
    torch.testing.assert_close(lse, want_lse, atol=0, rtol=0)


def _kernel_limits_on_rank():
    """With the Triton kernels, their limits are checked for what they will run on - H/P heads of the
    whole sequence (key/value heads copied) - before the first all-to-all, not for the local shapes."""
    ra = importlib.import_module("overlapkernels.ops.ring_attention")
    seen = []

    class Kernels:
        @staticmethod
        def check_inputs(q_shape, kv_shape, dtype, device):
            seen.append((tuple(q_shape), tuple(kv_shape)))
            raise ValueError("refused by the kernels' limits")

    own_backend, own_default = ua._backend, ra.default_backend
    ua._backend, ra.default_backend = (lambda name: Kernels), (lambda q: "triton")
    try:
        q, kv = torch.ones(2, 6, 4, 8), torch.ones(2, 6, 1, 8)  # [B, S_local, H, D]: 1 key/value head, copied
        with pytest.raises(ValueError, match="refused by the kernels' limits"), no_communication():
            ok.ulysses_attention(q, kv, kv)
    finally:
        ua._backend, ra.default_backend = own_backend, own_default
    return seen


def test_kernel_limits_are_checked_for_the_whole_sequence(rank_pool):
    assert rank_pool(2).run(_kernel_limits_on_rank) == [[((2, 2, 12, 8), (2, 1, 12, 8))]] * 2


def _chunked_cases_on_rank():
    """Every number of head groups gives SDPA's results; then the pipeline's order: chunk c + 1's
    trade posted before chunk c attends, its output traded back before chunk c + 1 attends."""
    for chunks in (1, 2, 4):  # 8 heads over 2 ranks: 4 query and 4 key/value heads per rank
        dense_case("zigzag", True, 8, 8, "bshd", True, attention=functools.partial(ok.ulysses_attention,
                                                                                  head_chunks=chunks))
    dense_case("contiguous", True, 8, 4, "sbhd", True, attention=functools.partial(ok.ulysses_attention, head_chunks=2))
    events = []
    own_a2a, own_fwd, own_bwd = ua.all_to_all, ua.ring_forward, ua.ring_backward
    ua.all_to_all = lambda *a, **k: (events.append("trade"), own_a2a(*a, **k))[1]
    ua.ring_forward = lambda *a, **k: (events.append("attend"), own_fwd(*a, **k))[1]
    ua.ring_backward = lambda *a, **k: (events.append("attend backward"), own_bwd(*a, **k))[1]
    try:
        q = torch.randn(1, 4, 4, 2, dtype=torch.float64, requires_grad=True)
        out = ok.ulysses_attention(q, q, q, head_chunks=2)
        forward = list(events)
        events.clear()
        out.sum().backward()
    finally:
        ua.all_to_all, ua.ring_forward, ua.ring_backward = own_a2a, own_fwd, own_bwd
    return forward, events


def test_head_chunks_pipeline_the_trades(rank_pool):
    forward, backward = rank_pool(2).run(_chunked_cases_on_rank)[0]
    assert forward == ["trade", "trade", "attend", "trade", "attend", "trade"]
    assert backward == ["trade", "trade", "attend backward", "trade", "attend backward", "trade"]


def _bad_chunks_on_rank():
    q = torch.ones(1, 4, 4, 2, dtype=torch.float64)  # 2 query and 2 key/value heads per rank
    for bad in (3, 0, True, 2.0, "2"):
        with pytest.raises(ValueError, match=f"head_chunks={bad!r}: expected an integer >= 1 dividing the 2 query and "
                                             "2 key/value heads each rank attends with"), no_communication():
            ok.ulysses_attention(q, q, q, head_chunks=bad)
    return True


def test_bad_head_chunks_are_refused_before_communicating(rank_pool):
    assert rank_pool(2).run(_bad_chunks_on_rank) == [True, True]


def _overlap_on_rank():
    """The trades are async (async_op=True) and overlap the attention: chunk c + 1's trade is posted
    before chunk c attends and waited for after, chunk c's trade back waited for after chunk c + 1
    attends; the default splits 2 heads per rank in 2 groups. An order of posts alone passed with
    synchronous all-to-alls or a trade waited for as soon as it was posted (no overlap left)."""
    events, asyncs = [], []
    own_a2a, own_fwd, own_bwd = ua.all_to_all, ua.ring_forward, ua.ring_backward
    own_init, own_wait = ua._Trade.__init__, ua._Trade.wait

    def init(self, *a, **k):
        own_init(self, *a, **k)
        self.number = sum(e[0] == "post" for e in events)
        events.append(("post", self.number))

    def wait(self):
        events.append(("wait", self.number))
        return own_wait(self)

    ua.all_to_all = lambda *a, **k: (asyncs.append(k.get("async_op", False)), own_a2a(*a, **k))[1]
    ua.ring_forward = lambda *a, **k: (events.append(("attend",)), own_fwd(*a, **k))[1]
    ua.ring_backward = lambda *a, **k: (events.append(("attend",)), own_bwd(*a, **k))[1]
    ua._Trade.__init__, ua._Trade.wait = init, wait
    try:
        q = torch.randn(1, 4, 4, 2, dtype=torch.float64, requires_grad=True)  # 2 heads a rank: 2 groups by default
        out = ok.ulysses_attention(q, q, q)
        forward = list(events)
        events.clear()
        out.sum().backward()
        backward = list(events)
    finally:
        ua.all_to_all, ua.ring_forward, ua.ring_backward = own_a2a, own_fwd, own_bwd
        ua._Trade.__init__, ua._Trade.wait = own_init, own_wait
    for seen in (forward, backward):
        attends = [i for i, e in enumerate(seen) if e == ("attend",)]
        at = {e: i for i, e in enumerate(seen) if e[0] != "attend"}
        assert len(attends) == 2 and len(at) == 8, seen  # trades 0, 1 (in), 2, 3 (back: chunk 0's, 1's)
        assert at["post", 1] < attends[0] < at["wait", 1], seen  # chunk 1's trade travels while chunk 0 attends
        assert at["post", 2] < attends[1] < at["wait", 2], seen  # chunk 0's trade back while chunk 1 attends
        assert all(at["wait", n] > at["post", n] for n in range(4))
    return asyncs


def test_the_trades_overlap_the_attention(rank_pool):
    assert rank_pool(2).run(_overlap_on_rank) == [[True] * 8] * 2


def _gradient_bytes_on_rank():
    """16-bit inputs: the gradients travel back in the inputs' dtype (as many bytes as q, k, v did
    forward), not in the fp32 the attention's backward accumulates in."""
    sizes = []
    own_a2a = ua.all_to_all
    ua.all_to_all = lambda x, *a, **k: (sizes.append(x.numel()), own_a2a(x, *a, **k))[1]
    try:
        g = torch.Generator().manual_seed(dist.get_rank())
        q, k, v = (torch.randn(1, 4, h, 8, generator=g).to(torch.bfloat16).requires_grad_() for h in (8, 4, 4))
        out = ok.ulysses_attention(q, k, v, causal=True, head_chunks=2)
        forward = list(sizes)
        sizes.clear()
        out.float().sum().backward()
    finally:
        ua.all_to_all = own_a2a
    return forward, sizes


def test_gradients_travel_in_the_inputs_dtype(rank_pool):
    forward, backward = rank_pool(2).run(_gradient_bytes_on_rank)[0]
    assert len(forward) == len(backward) == 4
    assert backward[2:] == forward[:2]  # dq, dk, dv back: the bytes q, k, v came in


@pytest.mark.usefixtures("world_of_one")
def test_a_trade_in_flight_keeps_only_its_message():
    """The blocks a trade sends (chunk copies forward; dq, dk, dv backward, all of them until the
    last trade back) are not held while it travels: the message holds their bytes."""
    import weakref

    block = torch.randn(1, 1, 2, 3, 4, dtype=torch.float64)
    want = block.clone()
    trade = ua._Trade(dist.group.WORLD, [block], lambda got: got)
    alive = weakref.ref(block)
    del block
    assert alive() is None
    (got,) = trade.wait()
    assert torch.equal(got, want)
