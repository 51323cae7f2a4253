"""Megatron's parameter tags and the layers' memory of them: the sequence-parallel gradient sum,
clipping and the dense export, also under torch's FSDP2 (which drops the tags), and tied weights."""
import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.layers import ColumnParallelLinear, RowParallelLinear, allreduce_sequence_parallel_grads
from overlapkernels.models import gather_dense_state_dict, shard_dense_state_dict
from test_layers_gloo import F64, TOL, _close, _groups, _randn


def _sp_tags_on_rank():
    """Layers tag their sequence-parallel parameters with the TP group, and the helper sums over
    that group by default (over the world, in TP=2 x DP=2, it would also sum over DP)."""
    from overlapkernels.layers import LayerNorm, RMSNorm

    dims = ok.init_parallel(tp=2)
    tp = dims.tp_group
    row = RowParallelLinear(4, 4, tp, sequence_parallel=True, dtype=F64)
    norms = [RMSNorm(4, sequence_parallel=True, group=tp, dtype=F64),
             LayerNorm(4, sequence_parallel=True, group=tp, dtype=F64)]
    tagged = [row.bias] + [p for n in norms for p in n.parameters()]
    assert all(p.sequence_parallel and p.sequence_parallel_group is tp for p in tagged)
    assert not hasattr(row.weight, "sequence_parallel_group")
    assert not hasattr(RMSNorm(4, sequence_parallel=True).weight, "sequence_parallel_group")  # no group given
    assert not hasattr(RMSNorm(4, group=tp).weight, "sequence_parallel_group")  # not sequence parallel
    module = torch.nn.ModuleList([row, *norms])
    for p in module.parameters():
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    assert allreduce_sequence_parallel_grads(module) == len(tagged)
    tp_sum = sum(r + 1 for r in dist.get_process_group_ranks(tp))
    assert all(torch.equal(p.grad, torch.full_like(p, float(tp_sum))) for p in tagged)
    assert torch.equal(row.weight.grad, torch.full_like(row.weight, float(dist.get_rank() + 1)))  # untouched
    # an explicit group wins over the tags: the world's sum, not the TP group's
    for p in tagged:
        p.grad = torch.full_like(p, float(dist.get_rank() + 1))
    assert allreduce_sequence_parallel_grads(module, dist.group.WORLD) == len(tagged)
    world_sum = sum(range(1, dist.get_world_size() + 1))
    assert all(torch.equal(p.grad, torch.full_like(p, float(world_sum))) for p in tagged)
    return True


def test_sequence_parallel_tags_and_helper_group(rank_pool):
    assert rank_pool(4).run(_sp_tags_on_rank) == [True] * 4


def _tp_sum(t, group):
    t = t.clone()
    dist.all_reduce(t, group=group)
    return t


def _block_under_fsdp2_on_rank(reshard_after_backward):
    """Our TP + SP block composed with torch's FSDP2 over DP (tp=2 x dp=2), as torchtitan-style
    clients do. FSDP2 swaps in DTensor parameters, dropping the attributes that tag the norms'
    partial gradients; the helper still finds them by name and sums each rank's local shard over
    TP, also when the module holds FSDP2's unsharded parameters after backward (no gradient there).
    ``ok.clip_grad_norm_(model)`` and the dense state-dict helpers likewise find the TP-split weights'
    dropped tags by name: the block's norm, each weight counted once, its dense weights and
    gradients, and a dense import into a wrapped block. Reference: the same block unwrapped, fed the whole batch."""
    from torch.distributed.fsdp import fully_shard

    from overlapkernels.layers import TransformerBlock

    dims = ok.init_parallel(tp=2, dp=2)
    tp, dp = dims.tp_group, dims.dp_size

    def make():
        torch.manual_seed(0)
        block = TransformerBlock(16, 4, 2, 32, tp, sequence_parallel=True, dtype=F64)
        with torch.no_grad():
            for i, p in enumerate(block.parameters()):  # norms start at 1: randomise so every term is tested
                p.copy_(p + 0.1 * _randn(*p.shape, seed=1000 + i))  # (by index: same shapes, other values)
        return block

    x = _randn(8, 4, 16, seed=3).chunk(2, dim=0)[dims.tp_rank]  # [S/tp, B, H]: SP splits the sequence
    ref, wrapped = make(), make()
    ref(x).sum().backward()
    allreduce_sequence_parallel_grads(ref)
    fully_shard(wrapped, mesh=dims.mesh["dp"])
    wrapped.set_reshard_after_backward(reshard_after_backward)
    wrapped(x.chunk(dp, dim=1)[dims.dp_rank]).sum().backward()  # DP splits the batch; FSDP2 averages
    partial = None
    if reshard_after_backward:  # the module holds the sharded parameters: their gradients before the sum
        partial = {n: p.grad.full_tensor() * dp for n, p in wrapped.named_parameters()}
    touched = allreduce_sequence_parallel_grads(wrapped)
    # the block's whole gradient norm, by hand: TP-split weights summed over TP, the rest counted once
    want = dict(ref.named_parameters())
    squares = sum((p.grad.double() ** 2).sum() if not getattr(p, "tensor_model_parallel", False)
                  else _tp_sum((p.grad.double() ** 2).sum(), tp) for p in want.values())
    ref_norm = squares.sqrt() / dp  # FSDP2 averages the DP ranks' gradients of their halves of the batch
    # our clip finds the TP tags FSDP2 dropped (by name) and the gradients on its sharded parameters
    norm = ok.clip_grad_norm_(wrapped, ref_norm.item() / 4, dims=dims)
    _close("norm", norm, ref_norm)
    coef = (ref_norm / 4) / (ref_norm + 1e-6)  # torch's clip coefficient: every gradient scaled by it
    # the dense export: DTensors gathered over DP, then TP-split weights (tags found by name) over TP
    want_dense, want_grads = gather_dense_state_dict(ref, tp), gather_dense_state_dict(ref, tp, grads=True)
    got_dense, got_grads = gather_dense_state_dict(wrapped, tp), gather_dense_state_dict(wrapped, tp, grads=True)
    assert list(got_dense) == list(want_dense) and list(got_grads) == list(want_grads)
    for name, want_value in want_dense.items():  # weights, and Megatron's _extra_state (None) as they are
        assert torch.equal(got_dense[name], want_value) if torch.is_tensor(want_value) else got_dense[name] is None
    for name in want_grads:
        _close(f"dense grad {name}", got_grads[name] * dp, want_grads[name] * coef)
    wrapped.reshard()  # (a no-op when already resharded) the sharded parameters, with their gradients
    summed = {n: p.grad.full_tensor() * dp for n, p in wrapped.named_parameters()}
    for name in summed:
        _close(f"grad {name}", summed[name], want[name].grad * coef)
    norms = [n for n in summed if "norm" in n]
    # the planted bug (tags lost, nothing summed) is what the comparison catches
    stale = partial and [n for n in norms if not torch.allclose(partial[n], want[n].grad, **TOL)]
    try:  # the parameters alone lost the TP tags: refused, not silently wrong
        ok.clip_grad_norm_(wrapped.parameters(), 1.0, dims=dims)
        refused = None
    except TypeError as exc:
        refused = str(exc).split(":")[0]
    # and the dense import into a wrapped block (zeroed first): every weight back, exactly
    fresh = make()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fully_shard(fresh, mesh=dims.mesh["dp"])
    fresh.load_state_dict(shard_dense_state_dict(fresh, want_dense, tp), strict=True)
    back = gather_dense_state_dict(fresh, tp)
    imported = all(torch.equal(back[n], v) for n, v in want_dense.items() if torch.is_tensor(v))
    return touched, norms, stale, refused, imported


@pytest.mark.parametrize("reshard_after_backward", [True, False])
def test_sequence_parallel_grads_under_torch_fsdp2(rank_pool, reshard_after_backward):
    for touched, norms, stale, refused, imported in rank_pool(4).run(_block_under_fsdp2_on_rank,
                                                                     reshard_after_backward):
        assert touched == 2 and norms == ["attn_norm.weight", "mlp_norm.weight"]
        assert stale == (norms if reshard_after_backward else None)
        assert refused == "clip_grad_norm_" and imported


def _tied_under_fsdp2_on_rank():
    """A weight two modules share (a tied embedding and head): FSDP2 keeps one sharded parameter for
    it, and both names must find it, whichever module remembers its tags."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    from overlapkernels import _compat

    first, second = nn.Linear(4, 4), nn.Linear(4, 4)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    fully_shard(model, mesh=ok.init_parallel().mesh["dp"])
    model.set_reshard_after_backward(False)
    model(torch.ones(2, 4)).sum().backward()
    found = _compat.fsdp2_sharded_params(model)
    # after backward the modules hold the unsharded parameter; the gradient is on the sharded one
    return (found[(id(first), "weight")] is found[(id(second), "weight")], first.weight.grad is None,
            hasattr(found[(id(second), "weight")].grad, "to_local"))


def test_tied_parameters_under_torch_fsdp2_are_found_by_every_name(rank_pool):
    assert rank_pool(2).run(_tied_under_fsdp2_on_rank) == [(True, True, True)] * 2


def _tied_dense_export_on_rank():
    """A TP weight two layers share: the dense dict holds the whole weight under both names."""
    from torch import nn

    tp, one, world, rank = _groups()
    torch.manual_seed(0)
    model = nn.ModuleDict({"a": ColumnParallelLinear(4, 2 * world, tp, bias=False, dtype=F64),
                           "b": ColumnParallelLinear(4, 2 * world, tp, bias=False, dtype=F64)})
    model["b"].weight = model["a"].weight
    dense = gather_dense_state_dict(model, tp)
    shards = [torch.empty_like(model["a"].weight) for _ in range(world)]
    dist.all_gather(shards, model["a"].weight.detach(), group=tp)
    return sorted(dense), dense["a.weight"] is dense["b.weight"], torch.equal(dense["b.weight"], torch.cat(shards))


def test_tied_tensor_parallel_weight_exports_dense_under_each_name(rank_pool):
    names = ["a._extra_state", "a.weight", "b._extra_state", "b.weight"]
    assert rank_pool(2).run(_tied_dense_export_on_rank) == [(names, True, True)] * 2


def _clip_without_dims_on_rank():
    """dims=None: pure data parallelism over the world; replicated gradients count once."""
    from torch import nn

    p = nn.Parameter(torch.zeros(3, dtype=F64))
    p.grad = torch.tensor([3.0, 4.0, 0.0], dtype=F64)  # the same on every rank, as DDP leaves it
    return float(ok.clip_grad_norm_([p], 10.0, dims=None)), float(ok.clip_grad_norm_([p], 10.0, 1.0, dims=None))


def test_clip_grad_norm_without_dims_is_data_parallel(rank_pool):
    assert rank_pool(2).run(_clip_without_dims_on_rank) == [(5.0, 7.0)] * 2


def _fsdp2_over_the_tp_axis_on_rank():
    """FSDP2 wrapped over the TP axis by mistake: the mesh has the right size to pass a count check,
    but its ranks hold other TP shards; the norm is refused by name, not computed from a mix."""
    from torch.distributed.fsdp import fully_shard

    dims = ok.init_parallel(tp=2, dp=2)
    layer = fully_shard(ColumnParallelLinear(4, 8, dims.tp_group, dtype=F64, method="baseline"), mesh=dims.mesh["tp"])
    layer(_randn(3, 2, 4, seed=0)).sum().backward()
    try:
        ok.clip_grad_norm_(layer, 1.0, dims=dims)
    except ValueError as exc:
        return str(exc).split(";")[0]


def test_fsdp2_mesh_over_other_model_parts_is_refused(rank_pool):
    for message in rank_pool(4).run(_fsdp2_over_the_tp_axis_on_rank):
        assert message.startswith("clip_grad_norm_: a DTensor gradient's mesh spans ranks [") and \
            message.endswith("which hold other parts of the model (another pipeline stage or TP shard)"), message


def _one_stage_refuses_on_rank():
    """Only pipeline stage 1 wraps its layer over the wrong axis: its ranks raise, and the stage-0
    ranks, which had nothing to refuse, get a NaN norm instead of waiting in the all-reduce."""
    from torch.distributed.fsdp import fully_shard

    dims = ok.init_parallel(tp=2, pp=2)
    layer = ColumnParallelLinear(4, 8, dims.tp_group, dtype=F64, method="baseline")
    fully_shard(layer, mesh=dims.mesh["tp" if dims.pp_rank == 1 else "dp"])
    layer(_randn(3, 2, 4, seed=0)).sum().backward()
    try:
        norm = ok.clip_grad_norm_(layer, 1.0, dims=dims)
    except ValueError as exc:
        return dims.pp_rank, "refused" if "hold other parts of the model" in str(exc) else str(exc)
    return dims.pp_rank, "nan" if torch.isnan(norm) and torch.isnan(layer.weight.grad.to_local()).all() else str(norm)


def test_a_rank_refusing_its_gradients_leaves_no_rank_waiting(rank_pool):
    outcomes = sorted(rank_pool(4).run(_one_stage_refuses_on_rank))
    assert outcomes == [(0, "nan"), (0, "nan"), (1, "refused"), (1, "refused")]


def _tags_of(module) -> dict:
    return {name: (getattr(p, "tensor_model_parallel", None), getattr(p, "partition_dim", None),
                   getattr(p, "sequence_parallel", None), getattr(p, "sequence_parallel_group", None))
            for name, p in module.named_parameters()}


def _meta_built_block_on_rank():
    """Built on the meta device, then materialised (to_empty, or load_state_dict(assign=True)):
    torch puts new Parameter objects in place, which lost every tag - and fsdp.shard, reading the
    tags, no longer summed the SP norms' partial gradients over TP: after one step the TP ranks'
    copies of a replicated norm weight differed (by 2e-2), silently. Also: nothing drawn on the
    host for a meta build (it drew every full weight, then kept a slice)."""
    from overlapkernels.layers import TransformerBlock
    from overlapkernels.runtime import fsdp

    dims = ok.init_parallel(tp=2)
    drawn = []

    def counting_init(t):
        drawn.append(tuple(t.shape))
        torch.nn.init.normal_(t, std=0.02)

    def block(device=None):
        return TransformerBlock(16, 2, 2, 32, dims.tp_group, sequence_parallel=True, method="baseline", dtype=F64,
                                device=device, init_method=counting_init)

    torch.manual_seed(0)
    built = block()
    start, want_tags, host_draws = built.state_dict(), _tags_of(built), len(drawn)
    x = torch.randn(4, 2, 16, dtype=F64, generator=torch.Generator().manual_seed(1)).chunk(2, 0)[dist.get_rank()]
    results = {}
    for how in ("cpu", "to_empty", "assign"):
        drawn.clear()
        if how == "cpu":
            model = block()
            model.load_state_dict(start)
        else:
            model = block("meta")
            results[f"{how} draws"] = len(drawn)
            if how == "to_empty":
                model = model.to_empty(device="cpu")
                model.load_state_dict(start)
            else:
                model.load_state_dict({k: v if v is None else v.clone() for k, v in start.items()}, assign=True)
        results[f"{how} tags"] = _tags_of(model) == want_tags
        sharded = fsdp.shard(model, dims.dp_group, stage=2, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
        sharded(x).pow(2).sum().backward()
        sharded.step()
        w = model.attn_norm.weight.detach().clone()
        peers = [torch.empty_like(w) for _ in range(2)]
        dist.all_gather(peers, w, group=dims.tp_group)
        results[f"{how} replicated"] = torch.equal(peers[0], peers[1])
    return host_draws, results


def test_tags_survive_meta_device_construction(rank_pool):
    for host_draws, results in rank_pool(2).run(_meta_built_block_on_rank):
        assert host_draws == 7  # q, k, v, out, gate, up, down: the CPU build draws each full weight once
        assert results == {"cpu tags": True, "cpu replicated": True, "to_empty draws": 0, "to_empty tags": True,
                           "to_empty replicated": True, "assign draws": 0, "assign tags": True,
                           "assign replicated": True}, results


def _reset_parameters_on_rank():
    """After a meta build and to_empty, reset_parameters() redraws each layer as construction did:
    with the same seed, the same values (one full weight per seed, this rank's slice)."""
    from overlapkernels.layers import (ParallelMLP, ParallelSelfAttention, RMSNorm, TransformerBlock,
                                       VocabParallelEmbedding)

    dims = ok.init_parallel(tp=2)
    tp = dims.tp_group
    makers = {"column": lambda **kw: ColumnParallelLinear(8, 6, tp, **kw),
              "row": lambda **kw: RowParallelLinear(8, 6, tp, **kw),
              "embedding": lambda **kw: VocabParallelEmbedding(10, 4, tp, **kw),
              "attention": lambda **kw: ParallelSelfAttention(16, 2, 2, tp, **kw),
              "mlp": lambda **kw: ParallelMLP(8, 12, tp, **kw),
              "norm": lambda **kw: RMSNorm(8, **kw),
              "block": lambda **kw: TransformerBlock(16, 2, 2, 32, tp, **kw)}
    same = {}
    for name, make in makers.items():
        torch.manual_seed(7)
        built = make(dtype=F64)
        with torch.no_grad():  # a norm's weight starts at ones: move it so the reset has work to do
            for p in built.parameters():
                if name == "norm":
                    p.mul_(3)
        empty = make(dtype=F64, device="meta").to_empty(device="cpu")
        torch.manual_seed(7)
        empty.reset_parameters()
        want = make(dtype=F64) if name == "norm" else built
        same[name] = all(torch.equal(a, b) for a, b in zip(empty.state_dict().values(), want.state_dict().values())
                         if torch.is_tensor(a))
    return same


def test_reset_parameters_redraws_a_meta_build_as_construction_did(rank_pool):
    for same in rank_pool(2).run(_reset_parameters_on_rank):
        assert same == dict.fromkeys(["column", "row", "embedding", "attention", "mlp", "norm", "block"], True), same


def _gpt_reset_on_rank(pp):
    """The GPT, whole or one of two pipeline stages, built on meta and reset: each stage draws (and
    drops) the layers the other keeps, as construction does, so values match a direct build."""
    from overlapkernels.models import GPT, GPTConfig

    dims = ok.init_parallel(tp=2 if pp == 1 else 1, pp=pp)
    config = GPTConfig(vocab_size=16, hidden=16, num_layers=4, num_heads=2, num_kv_heads=2, ffn_hidden=24,
                       max_seq_len=8)
    stage = (dims.pp_rank, pp) if pp > 1 else None
    torch.manual_seed(11)
    built = GPT(config, dims, dtype=F64, pipeline_stage=stage)
    empty = GPT(config, dims, dtype=F64, device="meta", pipeline_stage=stage).to_empty(device="cpu")
    torch.manual_seed(11)
    empty.reset_parameters()
    got, want = empty.state_dict(), built.state_dict()
    return sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want if torch.is_tensor(want[k]))


@pytest.mark.parametrize("pp", [1, 2])
def test_gpt_reset_parameters_matches_a_direct_build(rank_pool, pp):
    assert rank_pool(2).run(_gpt_reset_on_rank, pp) == [True, True]
