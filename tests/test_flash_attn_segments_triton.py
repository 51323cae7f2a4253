"""The Triton flash kernels with segment ids (packed documents) vs the torch reference, in the
interpreter: masks with causal ring offsets, GQA, ragged lengths and several tiles per side, so
that tiles whose id ranges cannot meet are skipped and their neighbours are not; and ring
attention on them vs SDPA with the document mask. Compiled for sm_90 by compile_kernels_sm90.py."""
import pytest
import torch

from overlapkernels.kernels import attention_ref as ref
from overlapkernels.kernels.triton import flash_attn as fa, flash_configs as fc, flash_segments as fs
from test_flash_attn_triton import _ring_on_triton_on_rank

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3)}


def _ids(lengths, batch=2):
    """[B, L] ids of documents of ``lengths``; the second row reversed (ids counting down)."""
    row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return torch.stack([row, row.flip(0)])[:batch]


def _check_block(dtype, q_ids, k_ids, heads=4, kv_heads=2, dim=12, seed=0, **args):
    g = torch.Generator().manual_seed(seed)
    lq, lk = q_ids.shape[1], k_ids.shape[1]
    q, k, v = (torch.randn(2, n, length, dim, generator=g).to(dtype)
               for n, length in ((heads, lq), (kv_heads, lk), (kv_heads, lk)))
    do = torch.randn(2, heads, lq, dim, generator=g).to(dtype)
    ids = dict(q_segments=q_ids, k_segments=k_ids)
    out, lse = fa.block_forward(q, k, v, 0.3, **args, **ids)
    out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, **args, **ids)
    atol, rtol = TOL[dtype]
    delta = (do.float() * out_ref).sum(-1)
    got = (out, lse) + fa.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args, **ids)
    want = (out_ref, lse_ref) + ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args, **ids)
    for name, g_, w in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g_, w.to(g_.dtype), atol=atol, rtol=rtol, msg=lambda m, n=name: f"{n}: {m}")
    return out_ref


# (document lengths of the queries, of the keys, causal, q_start, k_start): one block of a ring
# (queries and keys from the same packed sequence at their positions), or the diagonal block
CASES = [
    ([7, 30, 1, 12], [7, 30, 1, 12], True, 0, 0),  # the diagonal: 50 positions, 4 tiles of 16 a side
    ([5, 20, 15], [12, 28], True, 40, 0),  # queries later in the sequence than the keys: all tiles below the diagonal
    ([40], [3, 3, 30], False, 0, 0),  # one query document, keys of three
    ([9, 9, 9, 9, 4], [9, 9, 9, 9, 4], False, 0, 0),  # every tile meets at most two documents
]


# fp16 on the diagonal case only: the id masks and loop spans do not depend on the dtype (~4 s of CI)
@pytest.mark.parametrize("case, dtype", [(c, torch.float32) for c in range(len(CASES))] + [(0, torch.float16)],
                         ids=str)
def test_kernels_match_reference_with_segment_ids(case, dtype):
    q_lengths, k_lengths, causal, q_start, k_start = CASES[case]
    out_ref = _check_block(dtype, _ids(q_lengths), _ids(k_lengths), causal=causal, q_start=q_start, k_start=k_start,
                           kv_heads=(2, 1, 4, 2)[case], heads=4)
    assert out_ref.abs().sum() > 0  # (not an all-masked block)


def test_rectangular_tiles_and_unsorted_ids():
    """32x16 and 16x32 tiles (a tile's id range spans two of the other side's tiles), and ids in no
    order (ranges then always meet: nothing skipped, the mask alone)."""
    wide, tall = fc.FlashConfig(32, 16), fc.FlashConfig(16, 32)
    g = torch.Generator().manual_seed(3)
    with fc.forced_flash_configs(fc.FlashConfigs(fwd=wide, dkdv=tall, dq=wide)):
        _check_block(torch.float32, _ids([3, 40, 2, 25]), _ids([3, 40, 2, 25]), causal=True)
        _check_block(torch.float32, torch.randint(0, 3, (2, 45), generator=g), torch.randint(0, 3, (2, 37), generator=g))


def test_skipped_tiles_are_only_those_that_cannot_meet():
    """Ids in order put documents in separate tiles: the loops' spans must leave out only tiles the
    mask would zero. (A span one tile short at either end fails here and in the cases above: checked
    by planting first + 1 and last - 1 in flash_segments.tile_spans.)"""
    q_ids = k_ids = _ids([16, 16, 16, 16])  # documents exactly on the 16-position tiles
    _check_block(torch.float32, q_ids, k_ids, causal=False)
    shifted = _ids([17, 15, 16, 16])  # one position of document 0 in the second tile
    _check_block(torch.float32, shifted, shifted, causal=False)


@pytest.mark.parametrize("spans", ["tile_spans", "tile_spans_reference"])
def test_tile_spans_walk_only_the_tiles_that_can_meet(spans):
    """The loop bounds: per tile, the first and last tile of the other side with a shared id range
    (the kernels' launcher, and the torch form the next test holds it to)."""
    tile_spans = getattr(fs, spans)
    ids = _ids([16, 16, 16, 16], batch=1)  # a document per 16 positions
    assert tile_spans(ids, ids, 16, 16).tolist() == [[[0, 0], [1, 1], [2, 2], [3, 3]]]
    assert tile_spans(ids, ids, 32, 16).tolist() == [[[0, 1], [2, 3]]]  # row tiles of 32: two column tiles each
    shifted = _ids([17, 15, 16, 16], batch=1)  # document 0 reaches into the second tile
    assert tile_spans(shifted, shifted, 16, 16).tolist() == [[[0, 1], [0, 1], [2, 2], [3, 3]]]
    ragged = torch.tensor([[0] * 16 + [1] * 4])  # the last tile padded with its last id: no new id
    assert tile_spans(ragged, ragged, 16, 16).tolist() == [[[0, 0], [1, 1]]]
    assert tile_spans(torch.full((1, 16), 5), torch.full((1, 16), 7), 16, 16).tolist() == [[[1, -1]]]  # none
    unsorted = torch.tensor([[0, 1] * 16])  # every tile holds both ids: all walked, the mask does the rest
    assert tile_spans(unsorted, unsorted, 16, 16).tolist() == [[[0, 1], [0, 1]]]
    empty = torch.zeros(1, 0, dtype=torch.long)
    assert tile_spans(ids, empty, 16, 16).tolist() == [[[0, -1]] * 4] and tile_spans(empty, ids, 16, 16).shape == (1, 0, 2)
    rows = torch.arange(64)[None] // 16  # 4 row tiles, more than _PAIRS_AT_ONCE lets the torch form compare at once
    old, fs._PAIRS_AT_ONCE = fs._PAIRS_AT_ONCE, 2
    try:
        assert tile_spans(rows, rows, 16, 16).tolist() == [[[0, 0], [1, 1], [2, 2], [3, 3]]]
    finally:
        fs._PAIRS_AT_ONCE = old


def test_tile_spans_kernels_equal_the_torch_form(monkeypatch):
    """Random ids (sorted as packing makes them, or not), ragged lengths, several tile sizes, two rows;
    the span kernel's loop over column tiles in chunks of 2 (1024 on GPUs), so several chunks."""
    monkeypatch.setattr(fs, "_SPAN_CHUNK", 2)
    g = torch.Generator().manual_seed(11)
    for case in range(10):
        draw = [torch.randint(-3, 6, (2, int(n)), generator=g) for n in torch.randint(1, 90, (2,), generator=g)]
        row_ids, col_ids = (d.sort(dim=1).values if case % 2 else d for d in draw)
        for block_rows, block_cols in ((16, 16), (32, 16), (16, 32)):
            got = fs.tile_spans(row_ids, col_ids, block_rows, block_cols)
            want = fs.tile_spans_reference(row_ids, col_ids, block_rows, block_cols)
            assert torch.equal(got, want), (case, block_rows, block_cols)
    wide = torch.arange(64).reshape(1, 64).expand(2, 64) // 8  # rows at stride 0, then positions at stride 2
    for row_ids in (wide, wide[:, ::2], wide.t().contiguous().t()):
        assert torch.equal(fs.tile_spans(row_ids, wide, 16, 16), fs.tile_spans_reference(row_ids, wide, 16, 16))
    with pytest.raises(ValueError, match=r"tile_spans: row_ids \(2, 64\) and col_ids \(1, 64\) differ in batch"):
        fs.tile_spans(wide, wide[:1], 16, 16)


def test_empty_blocks_and_ids_of_mixed_signedness_match_reference():
    """An empty side (no keys, or no queries: ring blocks never are, direct callers may be) gives what
    the reference gives; int8 -1 and uint8 255 are different ids, as torch compares them."""
    g = torch.Generator().manual_seed(4)
    for lq, lk in ((8, 0), (0, 8)):
        q, k, v, do = (torch.randn(1, 2, n, 16, generator=g) for n in (lq, lk, lk, lq))
        ids = dict(q_segments=torch.zeros(1, lq, dtype=torch.long), k_segments=torch.zeros(1, lk, dtype=torch.long))
        out, lse = fa.block_forward(q, k, v, 0.3, **ids)
        want, want_lse = ref.block_forward(q, k, v, 0.3, **ids)
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        grads = fa.block_backward(q, k, v, do, want_lse, torch.zeros(1, 2, lq), 0.3, **ids)
        assert all(t.shape == w.shape and not t.abs().sum() for t, w in zip(grads, (q, k, v)))
    _check_block(torch.float32, torch.tensor([[-1] * 8 + [0] * 8] * 2, dtype=torch.int8),
                 torch.tensor([[255] * 8 + [0] * 8] * 2, dtype=torch.uint8), causal=False)


def test_segment_ids_must_be_both_or_neither_and_integer():
    q, k, v = (torch.ones(1, 2, 8, 16) for _ in range(3))
    ids = torch.zeros(1, 8, dtype=torch.long)
    for bad in (dict(q_segments=ids), dict(q_segments=ids.float(), k_segments=ids),
                dict(q_segments=ids, k_segments=ids[:, :4])):
        with pytest.raises(ValueError, match=r"flash attention \(Triton\): (q|k)_segments must be integer ids"):
            fa.block_forward(q, k, v, 0.3, **bad)
    with pytest.raises(ValueError, match=r"flash attention \(Triton\): k_segments is on meta but q is on cpu"):
        fa.block_forward(q, k, v, 0.3, q_segments=ids, k_segments=ids.to("meta"))


@pytest.mark.parametrize("layout, causal", [("zigzag", True), ("contiguous", False)])
def test_ring_on_triton_kernels_with_segment_ids(rank_pool, layout, causal):
    assert rank_pool(2).run(_ring_on_triton_on_rank, layout, causal, True) == [True, True]
