"""Edges of the Triton flash kernels' launch contract the main files leave out, in the interpreter
against the torch reference: causal blocks whose keys start more than a tile after the queries,
lse and delta laid out differently, segment ids at a non-unit position stride, and segment ids
with a different tile shape in each of the three kernels."""
import pytest
import torch

from overlapkernels.kernels import attention_ref as ref
from overlapkernels.kernels.triton import flash_attn as fa, flash_configs as fc
from test_flash_attn_segments_triton import _check_block, _ids
from test_flash_attn_triton import _close, _inputs


@pytest.mark.parametrize("q_start, k_start", [(0, 20), (3, 37)])
def test_keys_starting_more_than_a_tile_after_the_queries(q_start, k_start):
    """Causal, keys at k_start > q_start + 16: the first query tile sees no key at all and the next
    only some. Its fully visible key tiles end before 0 (clamped: an unclamped end, floored to a
    tile, started the masked loop at a negative key and read before k)."""
    q, k, v, do = _inputs(torch.float32, lq=40, lk=36)
    args = dict(q_start=q_start, k_start=k_start, causal=True)
    out, lse = fa.block_forward(q, k, v, 0.3, **args)
    out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, **args)
    empty = k_start - q_start  # leading queries that precede every key
    assert torch.equal(out[:, :, :empty], torch.zeros_like(out[:, :, :empty]))
    assert torch.isneginf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    _close("out", out, out_ref, torch.float32)
    _close("lse", lse[:, :, empty:], lse_ref[:, :, empty:], torch.float32)
    delta = (do * out_ref).sum(-1)
    grads = fa.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)):
        assert not got.isnan().any(), name
        _close(name, got, want, torch.float32)


@pytest.mark.parametrize("sliced", ["lse", "delta"])
def test_lse_and_delta_laid_out_unlike_each_other(sliced):
    """The backward reads lse and delta with one set of strides: one of them sliced out of a longer
    [B, H, L] row (as a ring block's), the other dense, must still be read each as itself."""
    q, k, v, do = _inputs(torch.float32)
    args = dict(q_start=4, causal=True)
    out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, **args)
    delta = (do * out_ref).sum(-1)
    want = ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)

    def in_longer(x):  # the same values at [B, H, 32] strides, positions 5..24
        longer = torch.full((*x.shape[:2], 32), 7.0)
        longer[:, :, 5:25] = x
        return longer[:, :, 5:25]

    lse, dl = (in_longer(lse_ref), delta) if sliced == "lse" else (lse_ref, in_longer(delta))
    assert lse.stride() != dl.stride()
    for name, got, w in zip(("dq", "dk", "dv"), fa.block_backward(q, k, v, do, lse, dl, 0.3, **args), want):
        _close(name, got, w, torch.float32)


def test_segment_ids_at_a_position_stride_other_than_one():
    """int64 ids viewed at stride 2 along the positions (no dtype copy makes them dense): the kernels
    read ids at unit stride, so the launcher must hand them a dense copy, as tile_spans takes one."""
    q_ids = _ids([7, 30, 1, 12]).repeat_interleave(2, dim=1)[:, ::2]
    k_ids = _ids([12, 28, 10]).repeat_interleave(2, dim=1)[:, ::2]
    assert q_ids.stride(1) == 2 and q_ids.dtype == torch.int64
    _check_block(torch.float32, q_ids, k_ids, causal=True, q_start=10, k_start=0)
    _check_block(torch.float32, q_ids, k_ids, causal=False)


def test_segment_spans_follow_each_kernels_own_tiles():
    """A different tile shape in each kernel (forward 32x16, dK/dV 16x32, dQ 16x16, as the fp32 D=128
    table pairs a 32x64 forward with a 16x64 dQ): each kernel's tile spans must be cut for its own
    tiles (dQ's from the forward's tiles walked the wrong key tiles)."""
    configs = fc.FlashConfigs(fwd=fc.FlashConfig(32, 16), dkdv=fc.FlashConfig(16, 32), dq=fc.FlashConfig(16, 16))
    ids = _ids([7, 30, 1, 12, 14])
    with fc.forced_flash_configs(configs):
        _check_block(torch.float32, ids, ids, causal=True)
        _check_block(torch.float32, ids, ids, causal=False)


def test_fp16_dk_summed_over_eight_query_heads_stays_in_fp32():
    """MQA: eight query heads and seven query tiles add into one key head's dK. Rounding dK to fp16
    after each tile (planted in the dK/dV kernel) took it to 1.8x the tolerance here, where the
    kernel is at 0.3x (the 96-position case in test_flash_attn_triton.py catches that in dV only)."""
    q, k, v, do = _inputs(torch.float16, heads=8, kv_heads=1, lq=112, lk=112, dim=16)
    out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, causal=True)
    delta = (do.float() * out_ref).sum(-1)
    for name, got, want in zip(("dq", "dk", "dv"), fa.block_backward(q, k, v, do, lse_ref, delta, 0.3, causal=True),
                               ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, causal=True)):
        _close(name, got, want, torch.float16)


def test_fp32_dout_with_fp16_inputs():
    """block_forward returns fp32, so a caller's dout may be fp32 while q, k, v are fp16: the backward
    takes it in q's dtype (the kernels' dots need matching operands: passed through, it failed)."""
    q, k, v, do = _inputs(torch.float16)
    do = do.float() + 1e-3 * torch.randn(do.shape, generator=torch.Generator().manual_seed(9))
    args = dict(q_start=7, k_start=3, causal=True)
    out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, **args)
    delta = (do * out_ref).sum(-1)
    for name, got, want in zip(("dq", "dk", "dv"), fa.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args),
                               ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)):
        _close(name, got, want, torch.float16)


def test_a_head_whose_last_offset_is_2_31_minus_1_is_accepted():
    """The 32-bit bound counts a head's last element, not its rows times their stride: at a sequence
    stride of 3 x 128 (a bshd view, 3 heads) 5592406 positions end at offset 2^31 - 1 (accepted;
    S x stride would refuse it), one position more passes it."""
    def bshd_view(s):
        return torch.empty(1, s, 3, 128, device="meta").transpose(1, 2)

    q = torch.empty(1, 3, 4, 128, device="meta")
    edge = bshd_view(5592406)
    assert (edge.shape[2] - 1) * edge.stride(2) + edge.shape[3] == 2 ** 31
    fa._check(q, edge, edge)
    with pytest.raises(ValueError, match=r"k of shape \(1, 3, 5592407, 128\), strides .*: one head spans 2\^31"):
        fa._check(q, bshd_view(5592407), bshd_view(5592407))
