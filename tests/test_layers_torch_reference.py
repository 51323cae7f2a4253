"""Every layer and the GPT vs an independent plain-torch reference written from the spec (issue 5).

Why this file exists: the other layer/GPT tests compare each parallel module with its "dense twin",
the same class on a 1-rank group. The twin shares every line of maths with what it tests, so a bug
in that maths (RoPE convention, softmax scale, norm formula or eps, MLP gating, residual wiring,
final norm, LM head, loss averaging) passes all of them. Here each module runs on a 1-rank group
and is recomputed from its own parameters with nothing but F.linear, einsum, softmax and explicit
RMSNorm / LayerNorm / RoPE / SwiGLU / cross-entropy; outputs, input and weight gradients must
agree at 1e-12 (fp64). The last test shows that tolerance catches small planted errors.

Conventions the reference pins (the issue names the parts, the code chooses these, all standard):
- RMSNorm as Megatron's / Llama's: x / sqrt(mean(x^2) + eps) * w, eps = 1e-5 inside the root
  (Megatron's default layernorm_epsilon); LayerNorm as torch's (biased variance, eps 1e-5).
- RoPE in the half-rotation form (GPT-NeoX, HF Llama's rotate_half): channel i pairs with i + D/2,
  angle pos * base^(-2i/D), base 10000, positions 0..S-1. Written here as a complex rotation.
- GQA as Llama's repeat_kv / Megatron's grouping: query head h reads KV head h // (H / H_kv).
- Attention: causal, scale 1/sqrt(head_dim). SwiGLU MLP: down(silu(x W_gate^T) * (x W_up^T)).
- Block: pre-norm, x + attn(norm(x)) then + mlp(norm(.)); GPT: embedding, blocks, final RMSNorm,
  an untied bias-free LM head; loss = mean cross-entropy over non-ignored tokens.
"""
import math

import pytest
import torch
import torch.nn.functional as F

import overlapkernels as ok
from overlapkernels.layers import (ColumnParallelLinear, LayerNorm, ParallelMLP, ParallelSelfAttention, RMSNorm,
                                   RowParallelLinear, TransformerBlock)
from overlapkernels.models import GPT, GPTConfig

F64 = torch.float64
TOL = dict(atol=1e-12, rtol=1e-12)
EPS = 1e-5
S, B, HIDDEN, HEADS, FFN = 6, 2, 16, 4, 24


def _close(name, got, want):
    torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"{name}: {m}")


def _randn(*shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@pytest.fixture(scope="module")
def dims(world_of_one):
    return ok.init_parallel()


def _randomise(module, seed=1):
    """Norm gains start at 1 and biases at 0: draw every parameter so every term counts."""
    with torch.no_grad():
        for i, p in enumerate(module.parameters()):
            p.copy_(_randn(*p.shape, seed=seed + i) * 0.5)
    return module


def _sub(params, prefix):
    return {n[len(prefix):]: p for n, p in params.items() if n.startswith(prefix)}


# ---- the reference: plain torch only, written from the conventions in the module docstring ----

def ref_rms(x, w, eps=EPS):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def ref_layer_norm(x, w, b, eps=EPS):
    centred = x - x.mean(-1, keepdim=True)
    return centred / torch.sqrt((centred * centred).mean(-1, keepdim=True) + eps) * w + b


def ref_rope(x, base=10000.0, interleaved=False):
    """x [S, B, H, D]: pair (i, i + D/2) as the complex number x_i + j x_{i+D/2}, turned by
    pos * base^(-2i/D). ``interleaved`` pairs (2i, 2i+1) (GPT-J): only for the planted error."""
    s, d = x.shape[0], x.shape[-1]
    angle = torch.arange(s, dtype=F64)[:, None] * base ** (-2 * torch.arange(d // 2, dtype=F64) / d)
    turn = torch.polar(torch.ones_like(angle), angle)[:, None, None, :]
    if interleaved:
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (d // 2, 2)).contiguous()) * turn).flatten(-2)
    z = torch.complex(x[..., : d // 2], x[..., d // 2:]) * turn
    return torch.cat([z.real, z.imag], -1)


def ref_attention(x, p, heads, kv_heads, *, base=10000.0, causal=True, interleaved=False, kv_of=None):
    s, b, hidden = x.shape
    d = hidden // heads
    q = ref_rope(F.linear(x, p["q_weight"]).view(s, b, heads, d), base, interleaved)
    k = ref_rope(F.linear(x, p["k_weight"]).view(s, b, kv_heads, d), base, interleaved)
    v = F.linear(x, p["v_weight"]).view(s, b, kv_heads, d)
    kv_of = torch.arange(heads) // (heads // kv_heads) if kv_of is None else kv_of
    scores = torch.einsum("sbhd,tbhd->bhst", q, k[:, :, kv_of]) / math.sqrt(d)
    if causal:
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    ctx = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v[:, :, kv_of])
    return F.linear(ctx.reshape(s, b, hidden), p["out.weight"])


def ref_mlp(x, p):
    gate = F.linear(x, p["gate_weight"])
    return F.linear(gate * torch.sigmoid(gate) * F.linear(x, p["up_weight"]), p["down.weight"])


def ref_block(x, p, heads, kv_heads):
    x = x + ref_attention(ref_rms(x, p["attn_norm.weight"]), _sub(p, "attn."), heads, kv_heads)
    return x + ref_mlp(ref_rms(x, p["mlp_norm.weight"]), _sub(p, "mlp."))


def ref_gpt_logits(tokens, p, config):
    x = p["embed.weight"][tokens].transpose(0, 1)  # [S, B, hidden]
    for i in range(config.num_layers):
        x = ref_block(x, _sub(p, f"blocks.{i}."), config.num_heads, config.num_kv_heads)
    return F.linear(ref_rms(x, p["norm.weight"]), p["lm_head.weight"])  # [S, B, V]


# ---- the checks ----

def _check(module, ref, x):
    """module(x) vs ref(x, leaf copies of the module's parameters): output, input grad, every
    parameter's grad (a parameter the reference does not use fails: its grad is None)."""
    params = {n: p.detach().clone().requires_grad_() for n, p in _randomise(module).named_parameters()}
    xm, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = module(xm), ref(xr, params)
    _close("output", out, want)
    upstream = _randn(*out.shape, seed=99)
    (out * upstream).sum().backward()
    (want * upstream).sum().backward()
    _close("input grad", xm.grad, xr.grad)
    for name, p in module.named_parameters():
        _close(f"grad {name}", p.grad, params[name].grad)


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("method", ["baseline", "decomposed"])
def test_linears(dims, sp, method):
    tp, x = dims.tp_group, _randn(S, B, HIDDEN, seed=0)
    col = ColumnParallelLinear(HIDDEN, 12, tp, sequence_parallel=sp, method=method, dtype=F64)
    _check(col, lambda x, p: F.linear(x, p["weight"], p["bias"]), x)
    row = RowParallelLinear(HIDDEN, 10, tp, sequence_parallel=sp, method=method, dtype=F64)
    _check(row, lambda x, p: F.linear(x, p["weight"], p["bias"]), x)


def test_rmsnorm_normalises_16_bit_input_in_fp32():
    """bf16 in: normalised in fp32 and rounded once (as Megatron's and Llama's), bit for bit."""
    x = (_randn(64, 4, 256, seed=0) * 3 + 1).bfloat16()
    norm = RMSNorm(256, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(_randn(256, seed=1).bfloat16())
    x32 = x.float()
    want = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)).bfloat16() * norm.weight
    assert torch.equal(norm(x), want)


def test_norms(dims):
    x = _randn(S, B, HIDDEN, seed=0) * 0.05  # small rows: eps is not negligible
    _check(RMSNorm(HIDDEN, dtype=F64), lambda x, p: ref_rms(x, p["weight"]), x)
    _check(LayerNorm(HIDDEN, dtype=F64), lambda x, p: ref_layer_norm(x, p["weight"], p["bias"]), x)


@pytest.mark.parametrize("sp", [False, True])
def test_mlp(dims, sp):
    mlp = ParallelMLP(HIDDEN, FFN, dims.tp_group, sequence_parallel=sp, dtype=F64)
    _check(mlp, ref_mlp, _randn(S, B, HIDDEN, seed=0))


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # MHA, GQA, MQA
@pytest.mark.parametrize("sp", [False, True])
def test_attention(dims, kv_heads, sp):
    attn = ParallelSelfAttention(HIDDEN, HEADS, kv_heads, dims.tp_group, sequence_parallel=sp, dtype=F64)
    _check(attn, lambda x, p: ref_attention(x, p, HEADS, kv_heads), _randn(S, B, HIDDEN, seed=0))


def test_rope_base_and_norm_eps_are_the_layers_own(dims):
    """Non-default rope_base and eps reach the maths (at the defaults a dropped argument is invisible)."""
    attn = ParallelSelfAttention(HIDDEN, HEADS, 2, dims.tp_group, rope_base=500.0, dtype=F64)
    _check(attn, lambda x, p: ref_attention(x, p, HEADS, 2, base=500.0), _randn(S, B, HIDDEN, seed=0))
    x = _randn(S, B, HIDDEN, seed=0) * 0.05  # small rows: eps matters
    _check(RMSNorm(HIDDEN, eps=1e-2, dtype=F64), lambda x, p: ref_rms(x, p["weight"], eps=1e-2), x)
    _check(LayerNorm(HIDDEN, eps=1e-2, dtype=F64), lambda x, p: ref_layer_norm(x, p["weight"], p["bias"], eps=1e-2), x)


def test_attention_without_num_kv_heads_is_multi_head(dims):
    attn = ParallelSelfAttention(HIDDEN, HEADS, group=dims.tp_group, dtype=F64)
    assert attn.k_weight.shape == attn.v_weight.shape == attn.q_weight.shape
    _check(attn, lambda x, p: ref_attention(x, p, HEADS, HEADS), _randn(S, B, HIDDEN, seed=0))


def test_block(dims):
    block = TransformerBlock(HIDDEN, HEADS, 2, FFN, dims.tp_group, dtype=F64)
    _check(block, lambda x, p: ref_block(x, p, HEADS, 2), _randn(S, B, HIDDEN, seed=0))


def test_gpt_logits_loss_and_grads(dims):
    config = GPTConfig(vocab_size=32, hidden=HIDDEN, num_layers=2, num_heads=HEADS, num_kv_heads=2, ffn_hidden=FFN,
                       max_seq_len=16)
    model = _randomise(GPT(config, dims, dtype=F64))
    assert model.lm_head.weight is not model.embed.weight  # untied, as the reference assumes
    g = torch.Generator().manual_seed(7)
    tokens, targets = (torch.randint(0, config.vocab_size, (B, 8), generator=g) for _ in range(2))
    targets[1, 3] = targets[0, 0] = config.ignore_index  # ignored positions leave the mean

    params = {n: p.detach().clone().requires_grad_() for n, p in model.named_parameters()}
    want_logits = ref_gpt_logits(tokens, params, config)
    logits = model(tokens)
    _close("logits", logits, want_logits)

    def ce(lg):  # [S, B, V] vs [B, S] targets: mean over the non-ignored tokens
        return F.cross_entropy(lg.transpose(0, 1).reshape(-1, config.vocab_size), targets.reshape(-1),
                               ignore_index=config.ignore_index)

    loss, want_loss = model.loss(tokens, targets), ce(want_logits)
    _close("loss vs F.cross_entropy(own logits)", loss, ce(logits.detach()))
    _close("loss vs reference", loss, want_loss)
    loss.backward()
    want_loss.backward()
    for name, p in model.named_parameters():
        _close(f"grad {name}", p.grad, params[name].grad)


@pytest.mark.parametrize("planted", ["weight+1e-6", "rope base 10001", "interleaved rope", "not causal",
                                     "kv head h % H_kv"])
def test_planted_error_is_caught(dims, planted):
    """The 1e-12 comparison is not vacuous: each small deviation of the reference fails ``_close``."""
    attn = _randomise(ParallelSelfAttention(HIDDEN, HEADS, 2, dims.tp_group, dtype=F64))
    x = _randn(S, B, HIDDEN, seed=0)
    p = {n: t.detach().clone() for n, t in attn.named_parameters()}
    with torch.no_grad():
        out = attn(x)
    _close("as written", out, ref_attention(x, p, HEADS, 2))  # passes before planting
    kw = {}
    if planted == "weight+1e-6":
        p["k_weight"][3, 5] += 1e-6
    elif planted == "rope base 10001":
        kw["base"] = 10001.0
    elif planted == "interleaved rope":
        kw["interleaved"] = True
    elif planted == "not causal":
        kw["causal"] = False
    else:  # query heads dealt round-robin to KV heads instead of in consecutive groups
        kw["kv_of"] = torch.arange(HEADS) % 2
    with pytest.raises(AssertionError, match="planted"):
        _close("planted", out, ref_attention(x, p, HEADS, 2, **kw))
