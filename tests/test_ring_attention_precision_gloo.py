"""Ring attention in 16 bits is as accurate on 4 ranks (8 in test_node_worlds.py) as on 2: the block
merges, dQ and the dK/dV partial sums that travel the ring all stay in fp32, so on the torch backend
(CPU) every result is the exact value (fp64, from the 16-bit inputs) rounded once to 16 bits,
whatever the ring's length; on the Triton kernels (which round P and dS to 16 bits for their dots,
as flash kernels do) the ring adds nothing to one rank's error.
"Exact" for dQ and dK takes flash's delta = rowsum(dO * O) from the rounded output O that the
backward is given, as every flash backward does (the exact O would add an error of up to ~12 u that
no ring causes and that hides what one does). ring-flash-attention's backward error grows with the
ring (REFERENCES.md: its partial sums travel in 16 bits); planted 16-bit hops, 16-bit block partial
sums and 16-bit merges break the bound."""
import importlib

import pytest
import torch

import overlapkernels as ok
from overlapkernels.comm.ring import Ring
from overlapkernels.kernels import attention_ref

ra = importlib.import_module("overlapkernels.ops.ring_attention")

B, H, H_KV, S, D = 1, 4, 2, 256, 32  # GQA: each K/V head's gradient sums two query heads
# unit roundoff 2^-p of round-to-nearest with p significant bits: |fl(y) - y| <= u |y|
UNIT_ROUNDOFF = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
RESULTS = ("out", "dq", "dk", "dv")


def _inputs(dtype, seq=S):
    """q, k, v, dout of the full sequence in ``dtype`` (the same on every rank), [B, S, heads, D]."""
    g = torch.Generator().manual_seed(7)
    shapes = ((B, seq, H, D), (B, seq, H_KV, D), (B, seq, H_KV, D), (B, seq, H, D))
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]


def _exact(q, k, v, dout, out_rounded):
    """Causal attention of the 16-bit inputs in fp64 -> out, dq, dk, dv, the backward's delta from
    ``out_rounded`` (the full output the op returned); [B, S, heads, D] as the inputs."""
    q, k, v, dout, out_rounded = (x.double().transpose(1, 2) for x in (q, k, v, dout, out_rounded))
    groups, scale, seq = H // H_KV, D ** -0.5, q.shape[2]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = (scale * q @ k.transpose(-1, -2)).masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), -torch.inf)
    p = scores.softmax(-1)
    ds = p * (dout @ v.transpose(-1, -2) - (dout * out_rounded).sum(-1, keepdim=True))
    per_kv_head = lambda x: x.reshape(B, H_KV, groups, seq, D).sum(2)  # noqa: E731
    results = (p @ v, scale * ds @ k, per_kv_head(scale * ds.transpose(-1, -2) @ q),
               per_kv_head(p.transpose(-1, -2) @ dout))
    return [x.transpose(1, 2) for x in results]


def _excess(dtype, results, exact, part=lambda x: x) -> list:
    """Per result (out, dq, dk, dv), max over ``part`` of |result - exact| / (u |exact| + u / 20
    max|exact|): <= 1 when the result is the exact value rounded once (the second term: fp32's own
    error)."""
    u, worst = UNIT_ROUNDOFF[dtype], []
    for name, got, want in zip(RESULTS, results, exact):
        assert got.dtype == dtype, name
        want_part = part(want)
        bound = u * want_part.abs() + u / 20 * want.abs().max()
        worst.append(float(((got.detach().double() - want_part).abs() / bound).max()))
    return worst


def _worst_excess_on_rank(dtype, plant=None, seq=S):
    """The excess of this rank's part of ring attention's results."""
    inputs = _inputs(dtype, seq)
    shard = lambda x: ok.shard_sequence(x, dim=1, layout="zigzag")  # noqa: E731
    q, k, v = (shard(x).requires_grad_() for x in inputs[:3])
    restore = plant(dtype) if plant else None
    try:
        out = ok.ring_attention(q, k, v, causal=True, layout="zigzag")
        out.backward(shard(inputs[3]))
    finally:
        if restore:
            restore()
    exact = _exact(*inputs, ok.unshard_sequence(out.detach(), dim=1, layout="zigzag"))
    return _excess(dtype, (out, q.grad, k.grad, v.grad), exact, shard)


def worst_excess(pool, dtype, plant=None) -> dict:
    """{result: its worst excess over every rank of ``pool``} (> 1: more than one rounding)."""
    per_rank = pool.run(_worst_excess_on_rank, dtype, plant)
    return {name: max(rank[i] for rank in per_rank) for i, name in enumerate(RESULTS)}


def _gradients_hop_in_16_bits(dtype):
    """ring-flash-attention's way: each dK/dV partial sum rounded to the input dtype before its hop."""
    exchange = Ring.exchange

    def rounding(self, send, dst, recv, src, tag):
        if tag == ra.GRAD_TAG:
            send = [t.to(dtype).to(t.dtype) for t in send]
        return exchange(self, send, dst, recv, src, tag=tag)

    Ring.exchange = rounding
    return lambda: setattr(Ring, "exchange", exchange)


def _block_partials_in_16_bits(dtype):
    """Each block's dQ, dK and dV rounded to the input dtype before they are added up."""
    block_backward = attention_ref.block_backward
    attention_ref.block_backward = lambda *a, **kw: [t.to(dtype).to(t.dtype) for t in block_backward(*a, **kw)]
    return lambda: setattr(attention_ref, "block_backward", block_backward)


def _merges_in_16_bits(dtype):
    acc_dtype = attention_ref.acc_dtype
    attention_ref.acc_dtype = lambda d: d if d == dtype else acc_dtype(d)
    return lambda: setattr(attention_ref, "acc_dtype", acc_dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("world", [2, 4])
def test_sixteen_bit_results_are_the_exact_ones_rounded_once_at_any_ring_length(rank_pool, world, dtype):
    worst = worst_excess(rank_pool(world), dtype)
    assert max(worst.values()) <= 1.0, worst


@pytest.mark.parametrize("plant, caught", [(_gradients_hop_in_16_bits, {"dk", "dv"}),
                                           (_block_partials_in_16_bits, {"dq", "dk", "dv"}),
                                           (_merges_in_16_bits, set(RESULTS))])
def test_planted_sixteen_bit_sums_break_the_bound(rank_pool, plant, caught):
    worst = worst_excess(rank_pool(4), torch.bfloat16, plant)
    assert {name for name, excess in worst.items() if excess > 1.0} == caught, worst


KERNEL_SEQ = 96  # the interpreter is slow: several tiles a rank still


def _on_the_kernels_on_rank(dtype):
    """The Triton kernels (the interpreter; CUDA's path) round P and dS to 16 bits before their dots,
    as flash kernels do, so their results are not one rounding from the exact ones: the ring must
    add nothing to what they give on one rank (local_attention over the whole sequence)."""
    backend = ra.default_backend
    ra.default_backend = lambda q: "triton"  # (ring_attention's and local_attention's checks choose it)
    try:
        ring = _worst_excess_on_rank(dtype, seq=KERNEL_SEQ)
        inputs = _inputs(dtype, KERNEL_SEQ)
        q, k, v = (x.clone().requires_grad_() for x in inputs[:3])
        out = ok.local_attention(q, k, v, causal=True)
        out.backward(inputs[3])
        alone = _excess(dtype, (out, q.grad, k.grad, v.grad), _exact(*inputs, out.detach()))
    finally:
        ra.default_backend = backend
    return ring, alone


def test_on_the_kernels_the_ring_adds_nothing_to_one_ranks_error(rank_pool):
    per_rank = rank_pool(2).run(_on_the_kernels_on_rank, torch.float16)
    alone = dict(zip(RESULTS, per_rank[0][1]))
    ring = {name: max(rank[0][i] for rank in per_rank) for i, name in enumerate(RESULTS)}
    assert all(ring[name] <= 1.1 * alone[name] for name in RESULTS), (ring, alone)
