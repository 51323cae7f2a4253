"""The fused GEMMs address within a chunk in 32 bits: a chunk, weight or output chunk past 2^31
elements is refused by name before anything communicates, and auto (rules or measured) never picks
fused for such a call."""
import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.comm.thread_world import ThreadWorld


@pytest.mark.parametrize("a_shape, b_shape, world, said", [
    ((2 * 65537, 32768), (32768, 8), 2, "the a chunk spans 2147516416 elements"),  # m*K = 2^31 + K
    ((8, 65536), (65536, 32769), 2, "the b spans 2147549184 elements"),
    ((2 * 65537, 8), (8, 32768), 2, "the output chunk spans 2147516416 elements"),
])
def test_fused_gemm_refuses_chunks_past_32_bit_offsets(a_shape, b_shape, world, said):
    """Offsets within a chunk are 32-bit in the fused kernels: a chunk (or b) whose last element lies
    at offset 2^31 or beyond is refused by name before any rank signals, not wrapped into reads and
    writes elsewhere. One row (or column) less, whose last offset is 2^31 - 1, is accepted."""
    from overlapkernels.kernels.triton.tile_gemm import check_gemm_operands

    a, b = torch.empty(a_shape, device="meta"), torch.empty(b_shape, device="meta")
    out = torch.empty(a_shape[0], b_shape[1], device="meta")
    with pytest.raises(ValueError, match=f"^fused GEMM: {said} .*use method='symm'"):
        check_gemm_operands(a, b, out, world)
    if "b" in said:
        check_gemm_operands(a, torch.empty(b_shape[0], b_shape[1] - 1, device="meta"), out[:, :-1], world)
    else:
        check_gemm_operands(a[:-world], b, out[:-world], world)


def _huge_fused_on_rank(ctx):
    said = []
    for call in (lambda: ok.all_gather_matmul(torch.empty(65537, 32768, device="meta"),
                                              torch.empty(32768, 8, device="meta"), ctx, method="fused"),
                 lambda: ok.matmul_reduce_scatter(torch.empty(2 * 65537, 32768, device="meta"),
                                                  torch.empty(32768, 8, device="meta"), ctx, method="fused")):
        with pytest.raises(ValueError) as info:
            call()
        said.append(str(info.value))
    return said


def test_the_ops_refuse_fused_past_32_bit_offsets_before_communicating():
    want = ("fused GEMM: the a chunk spans 2147516416 elements (65537 rows per chunk, K=32768, N=8); the kernel's "
            "offsets within a chunk are 32-bit (< 2^31 elements): use method='symm' (cuBLAS per chunk) or 'decomposed'")
    assert ThreadWorld(2, timeout=30).run(_huge_fused_on_rank) == [[want, want]] * 2


@pytest.mark.parametrize("rows, fits", [(65536, True), (65537, False)])
def test_measured_auto_leaves_out_fused_past_its_32_bit_offsets(world_of_one, monkeypatch, rows, fits):
    """Measured auto must not time (and so fail in) a fused GEMM the call's chunks do not fit: both
    ops, forward shapes [rows, 32768] per chunk, tell the measurement whether fused fits."""
    import importlib

    from overlapkernels.ops.dispatch import Choice

    # the modules (the package re-exports the functions under the same names)
    agm = importlib.import_module("overlapkernels.ops.all_gather_matmul")
    mrs = importlib.import_module("overlapkernels.ops.matmul_reduce_scatter")

    told = []

    def fake_measured(op, key, group, device, run, fused_fits=True):
        told.append((op, fused_fits))
        return Choice("baseline", "fake")

    monkeypatch.setenv("OVERLAPKERNELS_AUTO", "measure")
    monkeypatch.setattr(agm, "measured", fake_measured)
    monkeypatch.setattr(mrs, "measured", fake_measured)
    x, b = torch.empty(rows, 32768, device="meta"), torch.empty(32768, 8, device="meta")
    agm.resolve("auto", dist.group.WORLD, x, 8, 2, bs=[b])
    mrs.resolve("auto", dist.group.WORLD, torch.empty(2 * rows, 32768, device="meta"), b, 2, measurable=True)
    assert told == [("all_gather_matmul", fits), ("matmul_reduce_scatter", fits)]


def test_auto_weighs_every_weight_together_against_fused_offsets(world_of_one, monkeypatch):
    """Backward multiplies by the weights concatenated ([sum N, K]): two weights that each fit can
    pass 2^31 together. Measured auto is told fused does not fit; in a peer-memory world the rules
    pick symm rather than a fused call that would raise."""
    import importlib

    from overlapkernels.ops.dispatch import Choice, choose

    agm = importlib.import_module("overlapkernels.ops.all_gather_matmul")
    told = []
    monkeypatch.setenv("OVERLAPKERNELS_AUTO", "measure")
    monkeypatch.setattr(agm, "measured", lambda *a, fused_fits=True: told.append(fused_fits) or Choice("baseline", ""))
    x = torch.empty(1024, 1 << 20, device="meta")  # K * 1536 < 2^31 <= K * 3072
    one, two = [torch.empty(1 << 20, 1536, device="meta")], [torch.empty(1 << 20, 1536, device="meta")] * 2
    agm.resolve("auto", dist.group.WORLD, x, 1536, 2, bs=one)
    agm.resolve("auto", dist.group.WORLD, x, 3072, 2, bs=two)
    assert told == [True, False]
    common = dict(world_size=2, rows_per_rank=1024, step_bytes=1 << 20, step_flops=1 << 30,
                  device=torch.device("cpu"), peer_memory=True, dtype=torch.float32)
    assert choose("all_gather_matmul", "auto", **common).method == "fused"
    assert choose("all_gather_matmul", "auto", fused_fits=False, **common).method == "symm"


def test_the_offset_limit_is_exactly_2_to_the_31_elements():
    """A last offset of 2^31 - 1 (2^31 elements) fits in int32 offsets; one more element does not."""
    from overlapkernels.kernels.offsets import fused_sizes_error, offsets_error

    assert offsets_error({"b": (1 << 31) - 1}, "") is None
    assert offsets_error({"b": 1 << 31}, "").startswith("fused GEMM: the b spans 2147483649 elements")
    assert fused_sizes_error(1 << 15, 1 << 16, 1) is None  # a chunk of exactly 2^31 elements
    assert "the a chunk spans 2147483649 elements" in fused_sizes_error(1, (1 << 31) + 1, 1)


def _fused_weights_together_on_rank(ctx):
    # K * 16385 < 2^31 for each weight; backward's dual op multiplies by both: K * 32770 > 2^31
    x, ws = torch.empty(8, 1 << 16, device="meta"), [torch.empty(1 << 16, 16385, device="meta")] * 2
    with pytest.raises(ValueError) as info:
        ok.all_gather_matmul(x, ws, ctx, method="fused")
    return str(info.value)


def test_an_explicit_fused_call_weighs_every_weight_together_before_communicating():
    want = ("fused GEMM: the b spans 2147614720 elements (8 rows per chunk, K=65536, N=32770); the kernel's offsets "
            "within a chunk are 32-bit (< 2^31 elements): use method='symm' (cuBLAS per chunk) or 'decomposed'")
    assert ThreadWorld(2, timeout=30).run(_fused_weights_together_on_rank) == [want, want]
