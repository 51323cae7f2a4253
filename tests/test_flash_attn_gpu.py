"""The Triton flash-attention kernels compiled on a GPU (-m gpu, make gpu-check): vs SDPA in bf16 and
fp32, the widest dK/dV tiles, ring attention of two ranks sharing one GPU, fp64 on the torch backend.
The same kernels under the interpreter: test_flash_attn_triton.py."""
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlapkernels.kernels.triton import flash_attn as fa, flash_configs as fc
from test_flash_attn_triton import _inputs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, dim, causal, tol", [
    (torch.bfloat16, 64, True, 5e-2), (torch.bfloat16, 128, False, 5e-2), (torch.bfloat16, 128, True, 5e-2),
    (torch.bfloat16, 256, True, 5e-2),
    (torch.bfloat16, 512, True, 5e-2), (torch.float32, 128, True, 1e-4)])
def test_kernels_vs_sdpa(dtype, dim, causal, tol):
    """The GPU tile tables against SDPA: 16-bit D=128 (the benchmark's), 256 and 512 (wide tiles), fp32
    (an fp64 reference). Few cases: each compiles three kernels within gpu-check's test step, whose
    pipeline tests come after these."""
    q, k, v, do = _inputs(dtype, heads=8, kv_heads=2, lq=300, lk=300, dim=dim, device="cuda")
    out, lse = fa.block_forward(q, k, v, dim ** -0.5, causal=causal)
    # fp32: the reference in fp64 (SDPA's fp32 kernels may use TF32); 16-bit: SDPA in that dtype
    ref_dtype = torch.float64 if dtype == torch.float32 else dtype
    qr, kr, vr = (t.detach().to(ref_dtype).requires_grad_() for t in (q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)))
    want = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
    torch.testing.assert_close(out, want.float(), atol=tol / 2.5, rtol=tol / 2.5)
    want.backward(do.to(ref_dtype))
    delta = (do.float() * out).sum(-1)
    dq, dk, dv = fa.block_backward(q, k, v, do, lse, delta, dim ** -0.5, causal=causal)
    torch.testing.assert_close(dq, qr.grad.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(dk, kr.grad.float().reshape(2, 2, 4, 300, dim).sum(2), atol=tol, rtol=tol)
    torch.testing.assert_close(dv, vr.grad.float().reshape(2, 2, 4, 300, dim).sum(2), atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dkdv", [fc.FlashConfig(16, 128, 8, 3), fc.FlashConfig(32, 128, 8, 2),
                                  fc.FlashConfig(64, 128, 8, 2)], ids=str)
def test_dkdv_tiles_four_times_wider_than_tall_vs_sdpa(dkdv, causal):
    """Regression (an H200, triton 3.6, 2026-11-30): dK/dV computed as dots on tl.trans(P) and
    tl.trans(dS) went wrong in tiles with BLOCK_N >= 4 * BLOCK_M, which the interpreter computed
    right; the transposed kernel must get them right. D=128, ragged 300 rows, GQA."""
    q, k, v, do = _inputs(torch.bfloat16, heads=8, kv_heads=2, lq=300, lk=300, dim=128, device="cuda")
    scale, default = 128 ** -0.5, fc.flash_configs(q.device, q.dtype, 128)
    out, lse = fa.block_forward(q, k, v, scale, causal=causal)
    delta = (do.float() * out).sum(-1)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)))
    F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal).backward(do)
    with fc.forced_flash_configs(fc.FlashConfigs(default.fwd, dkdv, default.dq)):
        _, dk, dv = fa.block_backward(q, k, v, do, lse, delta, scale, causal=causal)
    for name, got, want in (("dk", dk, kr.grad), ("dv", dv, vr.grad)):
        torch.testing.assert_close(got, want.float().reshape(2, 2, 4, 300, 128).sum(2), atol=5e-2, rtol=5e-2,
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_kernels_with_segment_ids_vs_sdpa(causal):
    """Packed documents on the compiled kernels (bf16, D=128's tiles): every tile masked by id, the
    tiles between documents skipped; vs SDPA with the block-diagonal mask (and causal)."""
    q, k, v, do = _inputs(torch.bfloat16, heads=8, kv_heads=2, lq=700, lk=700, dim=128, device="cuda")
    row = torch.repeat_interleave(torch.arange(5), torch.tensor([1, 300, 99, 250, 50]))
    ids = torch.stack([row, row.flip(0)]).cuda()
    out, lse = fa.block_forward(q, k, v, 128 ** -0.5, causal=causal, q_segments=ids, k_segments=ids)
    visible = (ids[:, :, None] == ids[:, None, :])[:, None]
    if causal:
        visible = visible & torch.ones(700, 700, dtype=torch.bool, device="cuda").tril()
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1)))
    want = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=visible)
    torch.testing.assert_close(out, want.float(), atol=2e-2, rtol=2e-2)
    want.backward(do)
    delta = (do.float() * out).sum(-1)
    dq, dk, dv = fa.block_backward(q, k, v, do, lse, delta, 128 ** -0.5, causal=causal, q_segments=ids,
                                   k_segments=ids)
    torch.testing.assert_close(dq, qr.grad.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(dk, kr.grad.float().reshape(2, 2, 4, 700, 128).sum(2), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(dv, vr.grad.float().reshape(2, 2, 4, 700, 128).sum(2), atol=5e-2, rtol=5e-2)


def _ring_bf16_one_gpu_on_rank(layout, documents=False, attention="ring_attention"):
    """Two processes sharing cuda:0, gloo moving K/V through host memory: the ring on the compiled
    Triton kernels in bf16 vs SDPA on the full sequence; with ``documents``, packed documents (segment
    ids travelling with K/V) vs SDPA with their mask. ``attention="ulysses_attention"``: its
    all-to-alls (through host memory too) around the same kernels instead."""
    import overlapkernels as ok

    torch.cuda.set_device(0)
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(9)
    seq, heads, kv_heads, dim = 128 * world, 8, 2, 64
    q, k, v = (torch.randn(2, seq, n, dim, generator=g).to("cuda", torch.bfloat16).requires_grad_()
               for n in (heads, kv_heads, kv_heads))
    ids = None
    mask = None
    if documents:  # documents of 1, 90 and the rest: boundaries inside ranks' parts and zigzag halves
        row = torch.repeat_interleave(torch.arange(3), torch.tensor([1, 90, seq - 91]))
        ids = torch.stack([row, row.flip(0)]).cuda()
        mask = ((ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril())[:, None]
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(4, 1),
                                          v.transpose(1, 2).repeat_interleave(4, 1), attn_mask=mask,
                                          is_causal=not documents).transpose(1, 2)
    do = torch.randn(want.shape, generator=g).to("cuda", torch.bfloat16)
    want.backward(do)

    def local(x):
        return ok.shard_sequence(x.detach(), layout=layout)

    ql, kl, vl = (local(x).requires_grad_() for x in (q, k, v))
    out = getattr(ok, attention)(ql, kl, vl, causal=True, layout=layout,
                                 segment_ids=None if ids is None else ok.shard_sequence(ids, dim=1, layout=layout))
    out.backward(local(do))
    for name, got, ref_t in (("out", out, want), ("dq", ql.grad, q.grad), ("dk", kl.grad, k.grad),
                             ("dv", vl.grad, v.grad)):
        torch.testing.assert_close(got.float(), local(ref_t).float(), atol=5e-2, rtol=5e-2,
                                   msg=lambda m, n=name: f"{layout} {n}: {m}")
    return True


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_bf16_two_ranks_one_gpu(rank_pool, layout):
    assert rank_pool(2).run(_ring_bf16_one_gpu_on_rank, layout) == [True, True]


@pytest.mark.gpu
def test_ring_bf16_two_ranks_one_gpu_packed_documents(rank_pool):
    assert rank_pool(2).run(_ring_bf16_one_gpu_on_rank, "zigzag", True) == [True, True]


@pytest.mark.gpu
@pytest.mark.parametrize("layout, documents", [("zigzag", False), ("contiguous", True)])
def test_ulysses_bf16_two_ranks_one_gpu(rank_pool, layout, documents):
    assert rank_pool(2).run(_ring_bf16_one_gpu_on_rank, layout, documents, "ulysses_attention") == [True, True]


@pytest.mark.gpu
def test_local_attention_packed_documents_on_the_kernels(monkeypatch):
    """The layers' path for packed documents without CP (sbhd, as they call it): the Triton kernels
    (D=64's tiles, as the two-rank ring above), not SDPA with a dense mask; vs SDPA with that mask."""
    from overlapkernels.ops.local_attention import local_attention

    calls = []
    block_forward = fa.block_forward
    monkeypatch.setattr(fa, "block_forward", lambda *a, **kw: calls.append(1) or block_forward(*a, **kw))
    g = torch.Generator().manual_seed(2)
    seq = 256
    q, k, v = (torch.randn(seq, 2, n, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_() for n in (8, 2, 2))
    row = torch.repeat_interleave(torch.arange(4), torch.tensor([1, 120, 70, 65]))
    ids = torch.stack([row, row.flip(0)]).cuda()
    out = local_attention(q, k, v, causal=True, qkv_format="sbhd", segment_ids=ids)
    assert calls and out.dtype == torch.bfloat16
    do = torch.randn(out.shape, generator=g).to("cuda", torch.bfloat16)
    out.backward(do)
    mask = ((ids[:, :, None] == ids[:, None, :]) & torch.ones(seq, seq, dtype=torch.bool, device="cuda").tril())[:, None]
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = F.scaled_dot_product_attention(ref[0].permute(1, 2, 0, 3), ref[1].permute(1, 2, 0, 3).repeat_interleave(4, 1),
                                          ref[2].permute(1, 2, 0, 3).repeat_interleave(4, 1),
                                          attn_mask=mask).permute(2, 0, 1, 3)
    want.backward(do.float())
    for name, got, ref_t in (("out", out, want), ("dq", q.grad, ref[0].grad), ("dk", k.grad, ref[1].grad),
                             ("dv", v.grad, ref[2].grad)):
        torch.testing.assert_close(got.float(), ref_t.float(), atol=5e-2, rtol=5e-2, msg=lambda m, n=name: f"{n}: {m}")


def _ring_fp64_cuda_on_rank():
    """float64 on a GPU runs the torch backend (the kernels take 16/32-bit): exact to fp64 rounding."""
    import overlapkernels as ok

    world = dist.get_world_size()
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 8 * world, n, 16, generator=g, dtype=torch.float64).cuda().requires_grad_()
               for n in (4, 2, 2))
    want = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(2, 1),
                                          v.transpose(1, 2).repeat_interleave(2, 1), is_causal=True).transpose(1, 2)
    want.sum().backward()
    ql, kl, vl = (ok.shard_sequence(x.detach()).requires_grad_() for x in (q, k, v))
    out = ok.ring_attention(ql, kl, vl, causal=True, layout="zigzag")
    out.sum().backward()
    for got, ref_t in ((out, want), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad)):
        torch.testing.assert_close(got, ok.shard_sequence(ref_t.detach()), atol=1e-10, rtol=1e-10)
    return True


@pytest.mark.gpu
def test_ring_fp64_on_gpu_takes_the_torch_backend(rank_pool):
    assert rank_pool(2).run(_ring_fp64_cuda_on_rank) == [True, True]
