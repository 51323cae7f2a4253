"""local_attention: attention over a sequence held whole (the layers' path for packed documents
without CP), ring attention's kernels on a ring of one, no process group. Against SDPA with the
dense mask: fp64 on the torch backend, fp32 on the Triton kernels in the interpreter."""
import importlib

import pytest
import torch
import torch.nn.functional as F

import overlapkernels as ok
from overlapkernels.kernels import attention_ref
from overlapkernels.kernels.triton import flash_attn
from overlapkernels.profiling.ranges import span

la = importlib.import_module("overlapkernels.ops.local_attention")
ra = importlib.import_module("overlapkernels.ops.ring_attention")  # its checks choose the backend
local_attention = ok.local_attention

DOCS = [7, 20, 13]  # 40 positions: tiles of 16 meet one or two documents


def _ids(batch=2):
    ids = torch.cat([torch.full((n,), d) for d, n in enumerate(DOCS)])
    return torch.stack([ids + 10 * b for b in range(batch)]) if batch > 1 else ids[None]


def _inputs(dtype, qkv_format, batch=2, heads=4, kv_heads=2, dim=16):
    g = torch.Generator().manual_seed(5)
    s = sum(DOCS)
    shape = (lambda h: (batch, s, h, dim)) if qkv_format == "bshd" else (lambda h: (s, batch, h, dim))
    q, k, v, do = (torch.randn(*shape(h), generator=g, dtype=torch.float64).to(dtype)
                   for h in (heads, kv_heads, kv_heads, heads))
    return q, k, v, do


def _sdpa(q, k, v, causal, ids, qkv_format):
    """SDPA in fp64 with the dense mask (documents, then causal), [B, H, S, D] inside."""
    to_bhsd = (lambda x: x.transpose(1, 2)) if qkv_format == "bshd" else (lambda x: x.permute(1, 2, 0, 3))
    q, k, v = (to_bhsd(x.double()) for x in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    s = q.shape[2]
    mask = torch.ones(q.shape[0], s, s, dtype=torch.bool)
    if ids is not None:
        mask &= ids[:, :, None] == ids[:, None, :]
    if causal:
        mask &= torch.ones(s, s, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1),
                                         attn_mask=mask[:, None])
    return out.transpose(1, 2) if qkv_format == "bshd" else out.permute(2, 0, 1, 3)


def _check(dtype, qkv_format, causal, with_ids, tol, **shape):
    q, k, v, do = _inputs(dtype, qkv_format, **shape)
    ids = _ids(q.shape[0] if qkv_format == "bshd" else q.shape[1]) if with_ids else None
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = local_attention(*leaves, causal=causal, qkv_format=qkv_format, segment_ids=ids)
    assert out.dtype == dtype and out.shape == q.shape and out.is_contiguous()
    out.backward(do)
    ref_leaves = [x.double().requires_grad_() for x in (q, k, v)]
    want = _sdpa(*ref_leaves, causal, ids, qkv_format)
    want.backward(do.double())
    for name, got, ref in zip(("out", "dq", "dk", "dv"), [out] + [x.grad for x in leaves],
                              [want] + [x.grad for x in ref_leaves]):
        torch.testing.assert_close(got.double(), ref.detach(), atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    if with_ids:  # the mask matters here: the test fails an implementation that ignores the ids
        unmasked = _sdpa(q, k, v, causal, None, qkv_format)
        assert (unmasked - want.detach()).abs().max() > 100 * tol


@pytest.mark.parametrize("with_ids", [True, False])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("qkv_format", ["bshd", "sbhd"])
def test_torch_backend_matches_sdpa_with_the_dense_mask(qkv_format, causal, with_ids):
    _check(torch.float64, qkv_format, causal, with_ids, 1e-12)


@pytest.mark.parametrize("qkv_format, causal", [("sbhd", True), ("bshd", False)])
def test_triton_kernels_match_sdpa_with_the_dense_mask(monkeypatch, qkv_format, causal):
    """What CUDA runs (the interpreter here, fp32): documents in the kernels' masks and loop spans."""
    used = []
    block_forward = flash_attn.block_forward
    monkeypatch.setattr(ra, "default_backend", lambda q: "triton")
    monkeypatch.setattr(flash_attn, "block_forward", lambda *a, **kw: used.append(1) or block_forward(*a, **kw))
    _check(torch.float32, qkv_format, causal, True, 2e-5, batch=1, heads=2, kv_heads=1)
    assert used  # not the torch reference


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_the_lse_is_the_masked_logsumexp_and_differentiable(monkeypatch, backend):
    """return_lse: [B, H, S] fp32, as ring_attention's; a loss using it backpropagates through it."""
    dtype, tol = (torch.float64, 1e-12) if backend == "torch" else (torch.float32, 2e-5)
    monkeypatch.setattr(ra, "default_backend", lambda q: backend)
    q, k, v, do = _inputs(dtype, "bshd", batch=1, heads=2, kv_heads=1)
    weight = torch.randn(1, 2, sum(DOCS), generator=torch.Generator().manual_seed(1))  # fp32: dlse exact
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, lse = local_attention(*leaves, causal=True, segment_ids=_ids(1), return_lse=True)
    assert lse.dtype == torch.float32 and lse.shape == (1, 2, sum(DOCS))
    ((out * do).sum() + (lse * weight).sum()).backward()
    ref = [x.double().requires_grad_() for x in (q, k, v)]
    s = sum(DOCS)
    visible = (_ids(1)[0][:, None] == _ids(1)[0][None, :]) & torch.ones(s, s, dtype=torch.bool).tril()
    scores = (ref[0].transpose(1, 2) @ ref[1].transpose(1, 2).repeat_interleave(2, 1).transpose(-1, -2)) * 16 ** -0.5
    scores = scores.masked_fill(~visible, -torch.inf)
    lse_ref = scores.logsumexp(-1)
    out_ref = (scores.softmax(-1) @ ref[2].transpose(1, 2).repeat_interleave(2, 1)).transpose(1, 2)
    ((out_ref * do.double()).sum() + (lse_ref * weight.double()).sum()).backward()
    torch.testing.assert_close(lse.double(), lse_ref.detach(), atol=max(tol, 1e-6), rtol=max(tol, 1e-6))
    torch.testing.assert_close(out.double(), out_ref.detach(), atol=tol, rtol=tol)
    for name, got, want in zip(("dq", "dk", "dv"), leaves, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, atol=tol, rtol=tol, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(TypeError, match=r"return_lse=1: expected a bool"):
        local_attention(q, k, v, return_lse=1)


def test_no_process_group_is_needed_and_nothing_travels(monkeypatch):
    import torch.distributed as dist
    from overlapkernels.comm.ring import Ring

    monkeypatch.setattr(Ring, "exchange", lambda *a, **kw: pytest.fail("a ring of one exchanged"))
    assert not dist.is_initialized()
    _check(torch.float64, "bshd", True, True, 1e-12)


def test_a_ring_of_one_allocates_no_exchange_buffers(monkeypatch):
    """Forward and backward on a ring of one receive nothing: no buffers shaped as K/V (the ring's
    double buffers, and backward's fp32 partial sums, were allocated anyway: 4 K/V-sized tensors)."""
    ra = importlib.import_module("overlapkernels.ops.ring_attention")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 16, 4, generator=g, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, 1, 16, 4, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    shapes = []
    own_empty, own_like = torch.empty, torch.empty_like
    monkeypatch.setattr(ra.torch, "empty", lambda *a, **kw: (shapes.append(tuple(a[0]) if a else None),
                                                             own_empty(*a, **kw))[1])
    monkeypatch.setattr(ra.torch, "empty_like", lambda t, **kw: (shapes.append(tuple(t.shape)), own_like(t, **kw))[1])
    out, lse = ra.ring_forward(q.detach(), k.detach(), v.detach(), None, True, 0.5, "contiguous", "torch")
    ra.ring_backward(q.detach(), k.detach(), v.detach(), None, out, lse, torch.ones_like(out), None, None, True, 0.5,
                     "contiguous", "torch")
    assert tuple(k.shape) not in shapes, shapes


def test_autocast_runs_in_its_dtype_and_gradients_reach_fp32_leaves():
    """Inside torch.autocast: bf16, as SDPA; the backward (run inside too) must not autocast its own
    fp32 math: everything equals the same call on inputs cast by hand, bitwise."""
    q, k, v, do = _inputs(torch.float32, "bshd")
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = local_attention(*leaves, causal=True, segment_ids=_ids())
        assert out.dtype == torch.bfloat16
        out.float().backward(do)
    assert all(x.grad.dtype == torch.float32 for x in leaves)
    by_hand = [x.bfloat16().requires_grad_() for x in (q, k, v)]
    want = local_attention(*by_hand, causal=True, segment_ids=_ids())
    want.backward(do.bfloat16())
    assert torch.equal(out, want)
    for name, got, ref in zip(("dq", "dk", "dv"), leaves, by_hand):
        assert torch.equal(got.grad, ref.grad.float()), name
    exact = _sdpa(*(x.double() for x in by_hand), True, _ids(), "bshd")  # and bf16 is near the truth
    torch.testing.assert_close(out.double(), exact, atol=2e-2, rtol=2e-2)


def test_bad_input_is_refused_by_name():
    q, k, v, _ = _inputs(torch.float64, "bshd")
    with pytest.raises(TypeError, match=r"segment_ids\.dtype=torch\.float32: expected an integer tensor"):
        local_attention(q, k, v, segment_ids=_ids().float())
    with pytest.raises(ValueError, match=r"segment_ids\.shape=\(2, 39\): expected \[B, S_local\] = \[2, 40\]"):
        local_attention(q, k, v, segment_ids=_ids()[:, 1:])
    with pytest.raises(TypeError, match=r"causal='yes': expected a bool"):
        local_attention(q, k, v, causal="yes")
    with pytest.raises(ValueError, match=r"qkv_format='bhsd': expected one of"):
        local_attention(q, k, v, qkv_format="bhsd")
    with pytest.raises(ValueError, match=r"k\.dtype=torch\.float32 does not match q\.dtype=torch\.float64"):
        local_attention(q, k.float(), v)
    with pytest.raises(ValueError, match=r"query heads must be a multiple of the key/value heads"):
        local_attention(q[:, :, :3], k, v)


def test_profiles_name_it_and_a_second_derivative_is_refused_by_name(monkeypatch):
    """Its NVTX ranges (and so `profile report`'s rows) say attention, not ring attention."""
    names = []
    monkeypatch.setattr(la, "span", lambda name: names.append(name) or span(name))
    ring_module = importlib.import_module("overlapkernels.ops.ring_attention")
    monkeypatch.setattr(ring_module, "span", lambda name: names.append(name) or span(name))
    q, k, v, _ = _inputs(torch.float64, "bshd")
    q.requires_grad_()
    out = local_attention(q, k, v, causal=True, segment_ids=_ids())
    torch.autograd.grad(out.sum(), q)
    assert names == ["ok/attention", "ok/attention/step0/compute", "ok/attention/backward",
                     "ok/attention/backward/step0/compute"], names
    with pytest.raises(RuntimeError, match=r"^local_attention: create_graph=True \(a second derivative\) is not "
                                           r"supported through it: its backward runs the flash kernels'"):
        torch.autograd.grad(local_attention(q, k, v).sum(), q, create_graph=True)


def test_the_torch_backend_is_the_reference_module():
    """On CPU and for float64 the torch reference runs (the kernels take no float64)."""
    assert ra.default_backend(torch.zeros(1, dtype=torch.float32)) == "torch"
    assert ra._backend("torch") is attention_ref


def test_the_default_scale_is_one_over_sqrt_head_dim_down_to_a_head_dim_of_one():
    for dim in (1, 9):
        q, k, v, _ = _inputs(torch.float64, "bshd", dim=dim)
        out = local_attention(q, k, v, causal=True)
        want = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k.repeat_interleave(2, 2),
                                                                           v.repeat_interleave(2, 2))),
                                              is_causal=True).transpose(1, 2)
        torch.testing.assert_close(out, want, atol=1e-12, rtol=1e-12, msg=f"head dim {dim}")
