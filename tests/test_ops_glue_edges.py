"""Edges of the ops' glue found by planting bugs in it (each test here failed with one planted):
auto's documented thresholds as numbers, overlap_stats snapshots, nested strict_overlap, the reasons
the CUDA rule records, check_flag on bool tensors, autocast and non-float weights, local_attention's
output never being the tensor its backward saved, and the sequence helpers on a world of one."""
import pytest
import torch
import torch.nn.functional as F

import overlapkernels as ok
from overlapkernels.ops import dispatch
from overlapkernels.ops._validate import check_flag

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


def _choose(op="all_gather_matmul", method="auto", *, device=CPU, rows=8, nbytes=512 << 10, flops=None):
    return dispatch.choose(op, method, world_size=2, rows_per_rank=rows, step_bytes=nbytes,
                           step_flops=nbytes if flops is None else flops, device=device, peer_memory=False)


@pytest.fixture
def clean_stats():
    ok.reset_overlap_stats()
    yield
    ok.reset_overlap_stats()


def test_rule_thresholds_are_the_documented_values(clean_stats):
    """The numbers benchmarks/results/cpu_tp_ops.md and the README state, not the module's constants
    (a test against the constants passes whatever they are set to): gloo overlaps from 512 KiB ring
    messages up to 128 (all-gather) / 512 (reduce-scatter) GEMM flop per byte; CUDA from 1024 rows."""
    kib = 1 << 10
    assert [_choose(nbytes=n).method for n in (256 * kib, 512 * kib - 1, 512 * kib)] == \
        ["baseline", "baseline", "decomposed"]
    for op, most in (("all_gather_matmul", 128), ("matmul_reduce_scatter", 512)):
        got = [_choose(op, nbytes=512 * kib, flops=f * 512 * kib).method for f in (most // 2, most, most + 1)]
        assert got == ["decomposed", "decomposed", "baseline"], (op, got)
    assert [_choose(device=CUDA, rows=r).method for r in (512, 1023, 1024)] == ["baseline", "baseline", "decomposed"]


def test_the_cuda_rule_names_the_rows_per_rank_it_saw(clean_stats):
    """The recorded reason is what a user reads to learn why nothing overlapped: it must name the
    call's rows per rank, not another of its sizes."""
    choice = _choose(device=CUDA, rows=1000, nbytes=4096, flops=8192)
    assert choice.method == "baseline"
    assert choice.reason.startswith("1000 rows per rank < 1024: chunk GEMMs too small"), choice.reason
    assert list(ok.overlap_stats().reasons[("all_gather_matmul", "baseline")]) == [choice.reason]


def test_an_overlap_stats_snapshot_does_not_change_with_later_calls(clean_stats):
    """overlap_stats() returns a snapshot: reading it after more calls shows what it showed then,
    its reasons included (a live view of the counters would count the later calls in it)."""
    dispatch.record("all_gather_matmul", dispatch.Choice("baseline", "first"))
    snapshot = ok.overlap_stats()
    dispatch.record("all_gather_matmul", dispatch.Choice("baseline", "first"))
    dispatch.record("all_gather_matmul", dispatch.Choice("baseline", "second"))
    assert dict(snapshot) == {("all_gather_matmul", "baseline"): 1}
    assert snapshot.reasons == {("all_gather_matmul", "baseline"): {"first": 1}}
    now = ok.overlap_stats()
    assert now.reasons == {("all_gather_matmul", "baseline"): {"first": 2, "second": 1}}


def test_a_nested_strict_overlap_leaves_the_outer_one_active(clean_stats):
    """Leaving an inner strict_overlap() (a library's own, inside the user's) restores the outer
    one, which still polices; only leaving the outermost ends strict mode."""
    small = dict(nbytes=256, flops=1024)  # 256 B ring messages: auto falls back to baseline
    with ok.strict_overlap():
        with ok.strict_overlap():
            pass
        assert dispatch.strict_active()
        with pytest.raises(ok.StrictOverlapError, match="strict_overlap\\(\\) is active"):
            _choose(**small)
    assert not dispatch.strict_active()
    assert _choose(**small).method == "baseline"


def test_a_strict_overlap_left_by_an_error_ends():
    with pytest.raises(RuntimeError, match="raised inside"), ok.strict_overlap():
        raise RuntimeError("raised inside")
    assert not dispatch.strict_active()


def test_check_flag_refuses_a_bool_tensor_of_several_elements():
    """A 0-d bool tensor (or numpy bool) is a switch; a mask of several bools is not, and must be
    refused by name rather than fail in bool()."""
    import numpy as np

    assert check_flag(torch.tensor(True), "bias") is True and check_flag(np.bool_(False), "bias") is False
    for value in (torch.tensor([True, False]), torch.zeros(0, dtype=torch.bool),
                  np.array([True, False])):
        with pytest.raises(TypeError, match=r"^bias=.*: expected a bool$"):
            check_flag(value, "bias")


@pytest.mark.usefixtures("world_of_one")
def test_autocast_does_not_cast_an_integer_weight_into_a_valid_call():
    """Under torch.autocast the ops cast their floating operands to its dtype; an integer b is no
    floating operand: it stays what it is and is refused, as it is outside autocast."""
    a = torch.ones(4, 8)
    for call in (lambda b: ok.all_gather_matmul(a, b, method="baseline"),
                 lambda b: ok.matmul_reduce_scatter(a, b, method="baseline")):
        with torch.autocast("cpu", dtype=torch.bfloat16), \
                pytest.raises(ValueError, match=r"b\.dtype=torch\.int64 does not match a(_shard)?\.dtype=torch\.bfloat16"):
            call(torch.ones(8, 3, dtype=torch.int64))


def test_local_attentions_output_with_one_head_takes_an_in_place_op():
    """With one head (or one position) the [B, S, H, D] output laid out from [B, H, S, D] is
    contiguous already: it must still be a copy, not the tensor backward saved, or an in-place op
    on it (allowed on SDPA's output) breaks the backward."""
    g = torch.Generator().manual_seed(0)
    leaves = [torch.randn(1, 6, 1, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    out = ok.local_attention(*leaves, causal=True)
    out.mul_(2)
    out.sum().backward()
    ref = [x.detach().clone().requires_grad_() for x in leaves]
    want = 2 * F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in ref), is_causal=True).transpose(1, 2)
    want.sum().backward()
    torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12)
    for got, exp in zip(leaves, ref):
        torch.testing.assert_close(got.grad, exp.grad, atol=1e-12, rtol=1e-12)


@pytest.mark.usefixtures("world_of_one")
def test_sequence_helpers_take_minus_ndim_as_a_dim():
    x = torch.arange(24.0).reshape(4, 3, 2)
    for layout in ("contiguous", "zigzag"):
        part = ok.shard_sequence(x, dim=-3, layout=layout)
        assert torch.equal(part, x) and torch.equal(ok.unshard_sequence(part, dim=-3, layout=layout), x)


@pytest.mark.usefixtures("world_of_one")
def test_a_world_of_one_does_not_refuse_another_layouts_tag():
    """On one rank every layout holds the sequence in order: a part shard_sequence tagged zigzag
    (its default) is the same tensor laid out contiguously, so passing layout='contiguous' (ring
    attention's default) on is no mistake there."""
    x = torch.arange(8.0).reshape(1, 8, 1)
    part = ok.shard_sequence(x)
    assert torch.equal(ok.unshard_sequence(part, layout="contiguous"), x)
    q = ok.shard_sequence(torch.randn(1, 8, 1, 4, dtype=torch.float64))  # tagged zigzag
    out = ok.ring_attention(q, q, q, causal=True)  # ring attention's default layout: contiguous
    want = F.scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2), q.transpose(1, 2), is_causal=True)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-12, rtol=1e-12)
