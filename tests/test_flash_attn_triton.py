"""The Triton flash-attention kernels alone vs the torch reference (interpreter on CPU), and ring
attention running on them. Compiled on a GPU (-m gpu, make gpu-check): test_flash_attn_gpu.py."""
import importlib
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlapkernels.kernels import attention_ref as ref
from overlapkernels.kernels.triton import flash_attn as fa, flash_configs as fc

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (2e-3, 2e-3)}
# (causal, q_start, k_start): plain, causal diagonal, ring offsets, a block with empty rows
# (queries 0..3 precede every key), a block fully in the past, and an offset that puts the edge
# of the fully visible keys one short of a 16-key tile (an off-by-one there unmasks a hidden key),
# and q_start - k_start = 1 (mod 16): the last key tile a query tile needs holds one visible key
# (an off-by-one in the loop's end skips it)
OFFSETS = [(False, 0, 0), (True, 0, 0), (True, 7, 3), (True, 0, 4), (True, 40, 0), (True, 14, 0), (True, 1, 0),
           (True, 17, 0)]


def _inputs(dtype, heads=4, kv_heads=2, lq=20, lk=18, dim=12, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, lq, dim, generator=g)
    k = torch.randn(2, kv_heads, lk, dim, generator=g)
    v = torch.randn(2, kv_heads, lk, dim, generator=g)
    do = torch.randn(2, heads, lq, dim, generator=g)
    return [t.to(device, dtype) for t in (q, k, v, do)]


def _close(name, got, want, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(got, want.to(got.dtype), atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")


def test_a_head_dim_above_16_that_is_no_power_of_two():
    """D = 24 (as 40, 80, 96 in real models): the kernels pad it to the next power of two (tl.arange
    needs one) and mask the padding; 12, as above, pads to the minimum 16 either way."""
    q, k, v, do = _inputs(torch.float32, dim=24)
    args = dict(q_start=7, k_start=3, causal=True)
    out, lse = fa.block_forward(q, k, v, 0.3, **args)
    out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, **args)
    _close("out", out, out_ref, torch.float32)
    _close("lse", lse, lse_ref, torch.float32)
    delta = (do.float() * out_ref).sum(-1)
    for name, got, want in zip(("dq", "dk", "dv"), fa.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args),
                               ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)):
        _close(name, got, want, torch.float32)


# Each ring offset in both dtypes, the head grouping (MHA, GQA 2:1, MQA) turning with them: every
# dtype meets every grouping, every offset two of the three. The offsets' masks and the heads'
# mapping are separate index arithmetic; the full product was 48 interpreted cases, ~30 s of CI.
KERNEL_CASES = [(dtype, *offsets, (4, 2, 1)[(i + j) % 3]) for i, offsets in enumerate(OFFSETS)
                for j, dtype in enumerate((torch.float32, torch.float16))]


@pytest.mark.parametrize("dtype, causal, q_start, k_start, kv_heads", KERNEL_CASES)
def test_kernels_match_reference(dtype, causal, q_start, k_start, kv_heads):
    q, k, v, do = _inputs(dtype, kv_heads=kv_heads)
    args = dict(q_start=q_start, k_start=k_start, causal=causal)
    out, lse = fa.block_forward(q, k, v, 0.3, **args)
    out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, **args)
    assert not out.isnan().any() and torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
    _close("out", out, out_ref, dtype)
    _close("lse", lse, lse_ref, dtype)
    if causal and k_start > q_start:  # rows that see no key: exactly 0 and -inf
        empty = slice(0, k_start - q_start)
        assert torch.equal(out[:, :, empty], torch.zeros_like(out[:, :, empty]))
        assert torch.isneginf(lse[:, :, empty]).all()
    delta = (do.float() * out_ref).sum(-1)
    grads = fa.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)
    grads_ref = ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)
    for name, got, want in zip(("dq", "dk", "dv"), grads, grads_ref):
        assert not got.isnan().any(), name
        _close(name, got, want, dtype)


def test_fp16_over_many_tiles_with_gqa():
    """The cases above are one or two tiles a side: fp16 dK/dV summed over many query tiles and four
    query heads a key head is where 16-bit partial sums would show (rounding dK/dV to fp16 after
    each tile, planted in the kernel, took this to 1.3x the tolerance; the kernel is at 0.5x)."""
    q, k, v, do = _inputs(torch.float16, heads=8, kv_heads=2, lq=96, lk=96, dim=16)
    out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, causal=True)
    delta = (do.float() * out_ref).sum(-1)
    out, _ = fa.block_forward(q, k, v, 0.3, causal=True)
    _close("out", out, out_ref, torch.float16)
    for name, got, want in zip(("dq", "dk", "dv"), fa.block_backward(q, k, v, do, lse_ref, delta, 0.3, causal=True),
                               ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, causal=True)):
        _close(name, got, want, torch.float16)


@pytest.mark.parametrize("causal, q_start, k_start", OFFSETS)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_reference_matches_sdpa(causal, q_start, k_start, kv_heads):
    """The torch reference the kernels are held to, against SDPA itself (fp64): out, lse and the
    gradients, with the ring offsets as an explicit mask; rows that see no key are 0 and -inf."""
    q, k, v, do = _inputs(torch.float64, kv_heads=kv_heads)
    args = dict(q_start=q_start, k_start=k_start, causal=causal)
    out, lse = ref.block_forward(q, k, v, 0.3, **args)
    dq, dk, dv = ref.block_backward(q, k, v, do, lse, (do * out).sum(-1), 0.3, **args)
    empty = max(0, k_start - q_start) if causal else 0  # leading queries that precede every key
    assert not out[:, :, :empty].any() and torch.isneginf(lse[:, :, :empty]).all()
    assert not dq[:, :, :empty].any()
    qs, ks, vs = (x.clone().requires_grad_() for x in (q[:, :, empty:], k, v))
    group = q.shape[1] // kv_heads
    rows = torch.arange(empty, q.shape[2])[:, None] + q_start
    mask = (torch.arange(k.shape[2])[None, :] + k_start <= rows) if causal else None
    want = F.scaled_dot_product_attention(qs, ks.repeat_interleave(group, 1), vs.repeat_interleave(group, 1),
                                          attn_mask=mask, scale=0.3)
    (want * do[:, :, empty:]).sum().backward()
    scores = (qs @ ks.repeat_interleave(group, 1).transpose(-1, -2) * 0.3).masked_fill(
        mask.logical_not() if causal else torch.zeros((), dtype=torch.bool), float("-inf"))
    tight = dict(atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(out[:, :, empty:], want.detach(), **tight)
    torch.testing.assert_close(lse[:, :, empty:], torch.logsumexp(scores.detach(), -1), **tight)
    for name, got, grad in (("dq", dq[:, :, empty:], qs.grad), ("dk", dk, ks.grad), ("dv", dv, vs.grad)):
        torch.testing.assert_close(got, grad, **tight, msg=lambda m, n=name: f"{n}: {m}")


def _tiles_match_reference(configs, q, k, v, do, **args):
    """Forward and backward with every flash kernel forced to ``configs``, against the reference (fp32)."""
    with fc.forced_flash_configs(configs):
        out, lse = fa.block_forward(q, k, v, 0.3, **args)
        out_ref, lse_ref = ref.block_forward(q, k, v, 0.3, **args)
        _close("out", out, out_ref, torch.float32)
        _close("lse", lse, lse_ref, torch.float32)
        delta = (do * out_ref).sum(-1)
        grads = fa.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref.block_backward(q, k, v, do, lse_ref, delta, 0.3, **args)):
        _close(name, got, want, torch.float32)


# (a half of OFFSETS: non-causal, q ahead of k, k ahead of q, one visible key in the last tile)
@pytest.mark.parametrize("causal, q_start, k_start", [(False, 0, 0), (True, 7, 3), (True, 0, 4), (True, 1, 0)])
def test_rectangular_tiles_match_reference(causal, q_start, k_start):
    """GPU configs use BLOCK_M != BLOCK_N, and different ones per kernel: run that in the
    interpreter (fwd 32x16, dK/dV 16x32, dQ 32x16) over 40 queries x 36 keys, ragged edges."""
    wide, tall = fc.FlashConfig(32, 16), fc.FlashConfig(16, 32)
    _tiles_match_reference(fc.FlashConfigs(fwd=wide, dkdv=tall, dq=wide), *_inputs(torch.float32, lq=40, lk=36),
                           q_start=q_start, k_start=k_start, causal=causal)


GPU_TILE_TABLES = {**{f"16bit D<={d}": c for d, c in fc.CUDA_FLASH_16BIT.items()},
                   **{f"fp32 D<={d}": c for d, c in fc.CUDA_FLASH_FP32.items()},
                   **{f"small-smem D<={d}": c for d, c in fc.CUDA_FLASH_SMALL.items()}, "wide": fc.CUDA_FLASH_WIDE}


# each table with one of two offsets, in turn: q ahead of k by 4, and the last key tile holding one
# visible key (every table's loop bounds meet both kinds of edge over 150 x 146 anyway)
TABLE_CASES = [(table, True, *((7, 3), (1, 0))[i % 2]) for i, table in enumerate(GPU_TILE_TABLES)]


@pytest.mark.parametrize("table, causal, q_start, k_start", TABLE_CASES)
def test_every_gpu_tile_table_matches_reference(table, causal, q_start, k_start):
    """The exact tile shapes each GPU table hands out (64x32 forward beside a 16x64 dK/dV, 128-row
    tiles, ...), run by the interpreter over ragged lengths (150 queries x 146 keys: two 128-row tiles)
    with ring offsets: a shape-specific masking or loop-bound bug shows here, before a GPU runs them."""
    _tiles_match_reference(GPU_TILE_TABLES[table], *_inputs(torch.float32, heads=1, kv_heads=1, lq=150, lk=146),
                           q_start=q_start, k_start=k_start, causal=causal)


@pytest.mark.parametrize("dout_layout", ["dense", "transposed"])
def test_backward_of_a_sliced_q_with_dout_laid_out_otherwise(dout_layout):
    """q sliced out of a longer sequence (as a ring block) and a dout whose strides differ from q's:
    the kernels read dout with q's strides, so both must end up laid out alike."""
    q_long, k, v, _ = _inputs(torch.float32, lq=32)
    q = q_long[:, :, 6:26]  # strides of the 32-long tensor, 20 queries
    do = torch.randn(2, 4, 20, 12, generator=torch.Generator().manual_seed(1))
    if dout_layout == "transposed":
        do = do.transpose(1, 2).contiguous().transpose(1, 2)  # [B, L, H, D] memory
    assert do.stride() != q.stride()
    _, lse = ref.block_forward(q, k, v, 0.3, causal=True, q_start=6)
    out, _ = ref.block_forward(q, k, v, 0.3, causal=True, q_start=6)
    delta = (do * out).sum(-1)
    args = dict(causal=True, q_start=6)
    got = fa.block_backward(q, k, v, do, lse, delta, 0.3, **args)
    for name, g, want in zip(("dq", "dk", "dv"), got, ref.block_backward(q, k, v, do, lse, delta, 0.3, **args)):
        _close(name, g, want, torch.float32)


def test_v_laid_out_unlike_k():
    """The kernels read v with k's strides: a v transposed in memory ([B, L, H, D] order, as a bshd
    view) is brought to k's layout first, not read wrongly (it was off by ~2 before)."""
    q, k, v, do = _inputs(torch.float32)
    v = v.transpose(1, 2).contiguous().transpose(1, 2)
    assert v.stride() != k.stride()
    out, lse = fa.block_forward(q, k, v, 0.3, causal=True, q_start=4)
    want, want_lse = ref.block_forward(q, k, v, 0.3, causal=True, q_start=4)
    _close("out", out, want, torch.float32)
    delta = (do * want).sum(-1)
    got = fa.block_backward(q, k, v, do, want_lse, delta, 0.3, causal=True, q_start=4)
    for name, g, w in zip(("dq", "dk", "dv"), got, ref.block_backward(q, k, v, do, want_lse, delta, 0.3, causal=True,
                                                                     q_start=4)):
        _close(name, g, w, torch.float32)


def test_grid_keeps_batch_times_heads_off_one_axis(monkeypatch):
    """CUDA caps grid axes 1 and 2 at 65535: B*H on one axis failed to launch at B=512, H=128 (the
    interpreter has no such cap). Each kernel's launch grid, recorded instead of launched."""
    grids = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            grids[self.name] = grid
            return lambda *args, **kwargs: None

    for name in ("_flash_fwd_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"):
        monkeypatch.setattr(fa, name, Recorder(name))
    b, h, h_kv, length = 512, 128, 128, 16
    q = torch.zeros(b, h, length, 16)
    k = v = torch.zeros(b, h_kv, length, 16)
    _, lse = fa.block_forward(q, k, v, 0.3)
    fa.block_backward(q, k, v, q, lse, lse, 0.3)
    assert set(grids) == {"_flash_fwd_kernel", "_flash_bwd_dkdv_kernel", "_flash_bwd_dq_kernel"}
    for name, grid in grids.items():
        assert len(grid) == 3 and max(grid[1:]) <= 65535 and grid[1] * grid[2] == b * h, (name, grid)


_BEYOND_INT32 = textwrap.dedent("""
    import torch
    from overlapkernels.kernels import attention_ref as ref
    from overlapkernels.kernels.triton import flash_attn as fa

    stride_b, L, D = (1 << 30) + 64, 16, 16  # batch 2 starts at element 2^31 + 128: past int32
    storage = torch.empty(2 * stride_b + L * D, dtype=torch.float16)  # virtual: pages untouched stay unbacked
    x = storage.as_strided((3, 1, L, D), (stride_b, L * D, D, 1))
    x.copy_(torch.randn(3, 1, L, D, generator=torch.Generator().manual_seed(0)))
    dense = x.clone()  # the same values at small offsets: the reference
    out, lse = fa.block_forward(x, x, x, 0.25, causal=True)
    dq, dk, dv = fa.block_backward(x, x, x, x, lse, (out * x.float()).sum(-1), 0.25, causal=True)
    want = ref.block_forward(dense, dense, dense, 0.25, causal=True)
    want_grads = ref.block_backward(dense, dense, dense, dense, want[1], (want[0] * dense.float()).sum(-1), 0.25,
                                    causal=True)
    for name, got, expected in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), (*want, *want_grads)):
        torch.testing.assert_close(got, expected.to(got.dtype), atol=2e-3, rtol=2e-3, msg=lambda m, n=name: f"{n}: {m}")
    print("ok")
""")


def test_offsets_past_int32_of_a_batch_or_head():
    """A (batch, head) base offset of 2^31 elements or more (B*H*S*D at long context): a 32-bit product
    wraps and the kernels read and write elsewhere (a segfault under the interpreter, garbage or an
    illegal address on a GPU). Three batches 2^30 elements apart in one virtual 4 GiB buffer, of which
    only the touched pages are ever backed; a fresh process, so a crash fails this test only."""
    out = subprocess.run([sys.executable, "-c", _BEYOND_INT32], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0 and out.stdout.split() == ["ok"], (out.returncode, out.stderr[-3000:])


def test_flash_configs_fit_the_device():
    cpu = fc.flash_configs(torch.device("cpu"), torch.float16, 128)
    assert cpu == fc.INTERPRETER_FLASH
    for cfgs in GPU_TILE_TABLES.values():
        for cfg in (cfgs.fwd, cfgs.dkdv, cfgs.dq):  # tl.dot needs >= 16 and powers of two
            assert cfg.block_m >= 16 and cfg.block_n >= 16
            assert cfg.block_m & (cfg.block_m - 1) == 0 and cfg.block_n & (cfg.block_n - 1) == 0


def test_planted_error_is_caught():
    q, k, v, _ = _inputs(torch.float32)
    out, _ = fa.block_forward(q, k, v, 0.3)
    want, _ = ref.block_forward(q, k, v, 0.3)
    _close("out", out, want, torch.float32)
    out[1, 2, 3, 4] += 1e-3
    with pytest.raises(AssertionError):
        _close("out", out, want, torch.float32)


def test_float64_is_refused_with_a_pointer_to_the_torch_backend():
    q, k, v, _ = _inputs(torch.float64)
    with pytest.raises(ValueError, match="dtype torch.float64 not supported.*the torch backend takes float64"):
        fa.block_forward(q, k, v, 0.3)
    # so ring_attention takes that backend for float64 on a GPU too (SDPA takes float64 there)
    ring = importlib.import_module("overlapkernels.ops.ring_attention")
    meta = torch.empty(1, 2, 2, 8, device="meta")
    cuda_like = type("CudaLike", (), {"is_cuda": True})
    for dtype, want in ((torch.float64, "torch"), (torch.float32, "triton"), (torch.bfloat16, "triton")):
        fake = cuda_like()
        fake.dtype = dtype
        assert ring.default_backend(fake) == want, dtype
    assert ring.default_backend(meta) == "torch"  # not CUDA: the kernels would only be interpreted


def test_shapes_past_the_grid_or_32_bit_head_offsets_are_refused():
    """Heads and batch each on a grid axis of at most 65535, and 32-bit offsets within one head: past
    them a launch failed bare (grid) or read wrapped addresses (a strided view at long context)."""
    def meta(*shape, transpose=False):
        return torch.empty(*shape, device="meta").transpose(1, 2) if transpose else torch.empty(*shape, device="meta")

    k = meta(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"q.shape=\(1, 70000, 4, 8\): batch and heads must each be <= 65535"):
        fa.block_forward(meta(1, 70000, 4, 8), k, k, 0.3)
    with pytest.raises(ValueError, match=r"q.shape=\(70000, 1, 4, 8\): batch and heads must each be <= 65535"):
        fa.block_forward(meta(70000, 1, 4, 8), k, k, 0.3)
    # [B, S, H, D] seen as [B, H, S, D]: a head's last row starts S x H x D - H x D elements in
    long = meta(1, 2 ** 17 + 1, 128, 128, transpose=True)
    with pytest.raises(ValueError, match=r"k of shape \(1, 128, 131073, 128\), strides .*: one head spans 2\^31"):
        fa.block_forward(meta(1, 128, 4, 128), long, long, 0.3)
    fine = meta(1, 2 ** 17, 128, 128, transpose=True)  # one row less: its last offset is below 2^31
    fa._check(meta(1, 128, 4, 128), fine, fine)


def test_bf16_on_cpu_is_refused_not_misread():
    """Triton's interpreter computes with bf16 wrongly without an error: the kernels refuse it on CPU."""
    from overlapkernels.kernels.triton.tile_gemm import check_gemm_operands

    q, k, v, _ = _inputs(torch.float32)
    with pytest.raises(ValueError, match=r"flash attention \(Triton\) with bfloat16 runs in Triton's interpreter here \(CPU\)"):
        fa.block_forward(q.bfloat16(), k.bfloat16(), v.bfloat16(), 0.3)
    a = torch.ones(4, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"fused GEMM with bfloat16 runs in Triton's interpreter here \(CPU\), which computes bfloat16 wrongly"):
        check_gemm_operands(a, a.T, a, 1)


def _ring_on_triton_on_rank(layout, causal, documents=False):
    """RingAttention with the Triton backend (interpreter) vs SDPA on the full sequence; with
    ``documents``, segment ids of three packed documents and SDPA with their mask."""
    ra = importlib.import_module("overlapkernels.ops.ring_attention")
    import overlapkernels as ok

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(5)
    seq, heads, kv_heads, dim = (16 if documents else 4) * world, 2, 1, 8
    q, k, v = (torch.randn(1, n, seq, dim, generator=g, requires_grad=True) for n in (heads, kv_heads, kv_heads))
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor([5, seq - 12, 7]))[None] if documents else None
    visible = None
    if documents:
        visible = (ids[:, :, None] == ids[:, None, :]) & (torch.ones(seq, seq, dtype=torch.bool).tril() if causal
                                                          else True)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=None if visible is None else visible[:, None],
                                          is_causal=causal and not documents)
    do = torch.randn(want.shape, generator=g)
    want.backward(do)

    def local(x, d=2):
        return ok.shard_sequence(x.detach(), dim=d, layout=layout)

    ql, kl, vl = (local(x).requires_grad_() for x in (q, k, v))
    out, _ = ra.RingAttention.apply(ql, kl, vl, local(ids, 1) if documents else None, dist.group.WORLD, causal,
                                    dim ** -0.5, layout, "triton")
    out.backward(local(do))
    for name, got, ref_t in (("out", out, want), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
                             ("dv", vl.grad, v.grad)):
        torch.testing.assert_close(got, local(ref_t), atol=2e-5, rtol=2e-5, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("layout, causal", [("zigzag", True), ("contiguous", False)])
def test_ring_on_triton_kernels(rank_pool, layout, causal):
    assert rank_pool(2).run(_ring_on_triton_on_rank, layout, causal) == [True, True]


@pytest.mark.parametrize("smem_kb, dtype, head_dim, want", [
    (227, torch.bfloat16, 128, fc.CUDA_FLASH_16BIT[128]), (227, torch.float16, 64, fc.CUDA_FLASH_16BIT[64]),
    (227, torch.bfloat16, 32, fc.CUDA_FLASH_16BIT[64]), (227, torch.bfloat16, 256, fc.CUDA_FLASH_16BIT[256]),
    (227, torch.bfloat16, 512, fc.CUDA_FLASH_WIDE), (99, torch.bfloat16, 128, fc.CUDA_FLASH_SMALL[128]),
    (99, torch.float16, 16, fc.CUDA_FLASH_SMALL[128]), (99, torch.bfloat16, 256, fc.CUDA_FLASH_SMALL[256]),
    (99, torch.bfloat16, 512, fc.CUDA_FLASH_WIDE), (227, torch.float32, 16, fc.CUDA_FLASH_FP32[64]),
    (227, torch.float32, 128, fc.CUDA_FLASH_FP32[128]), (227, torch.float32, 256, fc.CUDA_FLASH_FP32[256]),
    (99, torch.float32, 64, fc.CUDA_FLASH_FP32[64]), (227, torch.float32, 512, fc.CUDA_FLASH_WIDE),
    (99, torch.float32, 128, fc.CUDA_FLASH_FP32_SMALL[128]), (99, torch.float32, 256, fc.CUDA_FLASH_FP32[256])])
def test_flash_config_rules_per_gpu(monkeypatch, smem_kb, dtype, head_dim, want):
    monkeypatch.setattr(fc, "shared_memory_per_block", lambda device: smem_kb << 10)
    assert fc.flash_configs(torch.device("cuda", 0), dtype, head_dim) is want
