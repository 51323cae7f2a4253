"""Ring attention in 16 bits is as accurate on 2 or 4 ranks (8 in test_node_worlds.py) as on one: the
block merges, dQ and the dK/dV partial sums that travel the ring all stay in fp32. So the output and
dV are the exact values (fp64, from the 16-bit inputs) rounded once to 16 bits, whatever the ring's
length; dQ and dK also carry the error every flash backward has, delta = rowsum(dO * O) taken from
the rounded output, which the ring must not add to. ring-flash-attention's backward error grows with
the ring (REFERENCES.md: its partial sums travel in 16 bits); a planted 16-bit hop, or merges in 16
bits, break these bounds."""
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


def _inputs(dtype):
    """q, k, v, dout of the full sequence in ``dtype`` (the same on every rank), [B, S, heads, D]."""
    g = torch.Generator().manual_seed(7)
    shapes = ((B, S, H, D), (B, S, H_KV, D), (B, S, H_KV, D), (B, S, H, D))
    return [torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype) for shape in shapes]


def _exact(q, k, v, dout):
    """Causal attention of the 16-bit inputs in fp64 -> out, dq, dk, dv (the truth to round once)."""
    q, k, v = (x.double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    groups = H // H_KV
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(groups, 1),
                                                           v.repeat_interleave(groups, 1), is_causal=True)
    out.backward(dout.double().transpose(1, 2))
    return [x.transpose(1, 2) for x in (out.detach(), q.grad, k.grad, v.grad)]


def _worst_excess_on_rank(dtype, plant=None):
    """Per result (out, dq, dk, dv), max over this rank's part of |result - exact| / (u |exact| +
    u / 20 max|exact|): <= 1 when the result is the exact value rounded once (the second term:
    fp32's own error). With group=None: this process's world (of one in the test below)."""
    inputs = _inputs(dtype)
    exact = _exact(*inputs)
    shard = lambda x: ok.shard_sequence(x, dim=1, layout="zigzag")  # noqa: E731
    q, k, v = (shard(x).requires_grad_() for x in inputs[:3])
    restore = plant(dtype) if plant else None
    try:
        out = ok.ring_attention(q, k, v, causal=True, layout="zigzag")
        out.backward(shard(inputs[3]))
    finally:
        if restore:
            restore()
    u, worst = UNIT_ROUNDOFF[dtype], []
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), exact):
        assert got.dtype == dtype, name
        want_local = shard(want)
        bound = u * want_local.abs() + u / 20 * want.abs().max()
        worst.append(float(((got.detach().double() - want_local).abs() / bound).max()))
    return worst


def _gradients_hop_in_16_bits(dtype):
    """ring-flash-attention's way: each dK/dV partial sum rounded to the input dtype before its hop."""
    exchange = Ring.exchange

    def rounding(self, send, dst, recv, src, tag):
        if tag == ra.GRAD_TAG:
            send = [t.to(dtype).to(t.dtype) for t in send]
        return exchange(self, send, dst, recv, src, tag=tag)

    Ring.exchange = rounding
    return lambda: setattr(Ring, "exchange", exchange)


def _merges_in_16_bits(dtype):
    acc_dtype = attention_ref.acc_dtype
    attention_ref.acc_dtype = lambda d: d if d == dtype else acc_dtype(d)
    return lambda: setattr(attention_ref, "acc_dtype", acc_dtype)


def worst_excess(pool, dtype, plant=None) -> dict:
    per_rank = pool.run(_worst_excess_on_rank, dtype, plant)
    return dict(zip(("out", "dq", "dk", "dv"), (max(rank[i] for rank in per_rank) for i in range(4))))


def beyond_the_bounds(ring: dict, alone: dict) -> list:
    """The results of a ring that break their bounds (``alone``: the same on one rank)."""
    return [name for name in ring if ring[name] > (1.0 if name in ("out", "dv") else 1.1 * alone[name])]


def excess_alone(dtype) -> dict:
    """The excess on this process's world of one (one block, no ring)."""
    return dict(zip(("out", "dq", "dk", "dv"), _worst_excess_on_rank(dtype)))


@pytest.fixture(scope="module")
def on_one_rank(world_of_one):
    return {dtype: excess_alone(dtype) for dtype in UNIT_ROUNDOFF}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("world", [2, 4])
def test_sixteen_bit_results_are_as_accurate_at_any_ring_length(rank_pool, on_one_rank, world, dtype):
    ring = worst_excess(rank_pool(world), dtype)
    assert not beyond_the_bounds(ring, on_one_rank[dtype]), (ring, on_one_rank[dtype])


# (a 16-bit hop shows in dV; in bf16 dK's delta error hides it)
@pytest.mark.parametrize("plant, caught", [(_gradients_hop_in_16_bits, {"dv"}),
                                           (_merges_in_16_bits, {"out", "dq", "dk", "dv"})])
def test_planted_sixteen_bit_accumulation_breaks_the_bounds(rank_pool, on_one_rank, plant, caught):
    ring = worst_excess(rank_pool(4), torch.bfloat16, plant)
    assert caught <= set(beyond_the_bounds(ring, on_one_rank[torch.bfloat16])), (ring, on_one_rank[torch.bfloat16])
