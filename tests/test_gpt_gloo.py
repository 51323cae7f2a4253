"""The small GPT under TP (+SP), CP and both vs the same GPT at TP = CP = 1 from the same dense
weights: same loss, same gathered gradients after one backward."""
import math
import re
import warnings

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from comm_guard import no_communication
from overlapkernels.layers import ParallelSelfAttention
from overlapkernels.models import GPT, GPTConfig, gather_dense_state_dict, shard_dense_state_dict

CONFIG = dict(vocab_size=32, hidden=16, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden=32, max_seq_len=16)


def _gpt_on_rank(layout_kwargs, sequence_parallel, method, kv_heads=2, compiled=False, clip=None,
                 planted_missing_sync=False, documents=False, planted_lost_grad=False, cp_attention="ring"):
    """``documents``: rows packing documents (segment_ids) that cross the CP ranks' parts;
    ``planted_lost_grad``: the final norm's weight loses its gradient (what a detached weight does)."""
    config = GPTConfig(**{**CONFIG, "num_kv_heads": kv_heads}, sequence_parallel=sequence_parallel, method=method,
                       cp_attention=cp_attention)
    g = torch.Generator().manual_seed(42)
    tokens = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=g)
    targets = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=g)
    targets[1, 3] = -100  # an ignored position
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 2], [5, 3, 3, 3, 3, 3, 3, 3]]) if documents else None

    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=torch.float64)
    dense_loss = dense.loss(tokens, targets, ids)
    dense_loss.backward()
    if clip is not None:  # (max_norm, norm_type): clipped in place, so dense_grads below are the clipped ones
        dense_norm = torch.nn.utils.clip_grad_norm_(dense.parameters(), *clip)
        assert dense_norm > clip[0]  # the clip bites
    dense_grads = {n: p.grad for n, p in dense.named_parameters()}
    assert all(g is not None for g in dense_grads.values())  # every dense parameter is in the loss

    dims = ok.init_parallel(**layout_kwargs)
    model = GPT(config, dims, dtype=torch.float64)
    model.load_state_dict(shard_dense_state_dict(model, dense.state_dict()))
    # compiled: torch.compile must run the ops (which take ProcessGroups) eagerly between compiled
    # regions, not fail tracing them, their backwards too - the whole step compiled, backward() inside
    # (dynamo went on to trace the frames backward() reaches); aot_eager: dynamo + autograd without
    # inductor's C++ build
    def step(tokens, targets):
        loss = model.loss(tokens, targets, ids)
        loss.backward()
        return loss

    loss = (torch.compile(step, backend="aot_eager") if compiled else step)(tokens, targets)
    if not planted_missing_sync:
        model.sync_grads()
    if clip is not None:  # the whole model's norm, each element once though TP/CP/DP ranks hold copies
        # both forms: the parameters (each carries its TP tag), and the model (whose layers remember
        # the tags by name: the form torch's FSDP2 needs)
        norm = ok.clip_grad_norm_(model if dims.cp_size > 1 else model.parameters(), *clip, dims=dims)
        torch.testing.assert_close(norm, dense_norm, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(loss, dense_loss, atol=1e-12, rtol=1e-12)
    if planted_lost_grad:
        model.norm.weight.grad = None
    grads = gather_dense_state_dict(model, grads=True)  # (a parameter without a gradient is left out)
    assert sorted(grads) == sorted(dense_grads), sorted(set(dense_grads) ^ set(grads))
    for name, grad in grads.items():
        torch.testing.assert_close(grad, dense_grads[name], atol=1e-11, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    # and back: the gathered state dict loads strictly into a dense GPT (_extra_state included)
    again = GPT(config, ok.init_parallel(), dtype=torch.float64)
    with torch.no_grad():
        for p in again.parameters():
            p.zero_()
    exported = gather_dense_state_dict(model)
    again.load_state_dict(exported, strict=True)
    assert torch.equal(again.loss(tokens, targets, ids), dense_loss.detach())
    # a snapshot: training on does not change it (unsplit tensors, norms and biases, are copies too)
    before = {k: v.clone() for k, v in exported.items() if torch.is_tensor(v)}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    changed = [k for k, v in before.items() if not torch.equal(exported[k], v)]
    assert not changed, f"the export aliases live parameters: {changed}"
    return float(loss)


@pytest.mark.parametrize("layout_kwargs, sequence_parallel, method, kv_heads, compiled", [
    (dict(tp=2), True, "decomposed", 2, False), (dict(tp=2), False, "baseline", 2, False),
    (dict(cp=2), True, "auto", 2, False), (dict(tp=2, cp=2), True, "decomposed", 2, False),
    (dict(tp=4), True, "decomposed", 4, False), (dict(cp=4), False, "auto", 1, False),
    (dict(tp=2, cp=2), True, "decomposed", 2, True),
])
def test_gpt_matches_dense(rank_pool, layout_kwargs, sequence_parallel, method, kv_heads, compiled):
    losses = rank_pool(4).run(_gpt_on_rank, layout_kwargs, sequence_parallel, method, kv_heads, compiled)
    assert len(set(losses)) == 1  # every rank reports the same global loss


@pytest.mark.parametrize("layout_kwargs, sequence_parallel", [
    (dict(cp=2), False), (dict(tp=2, cp=2), True), (dict(tp=2), True), (dict(cp=4), True)])
def test_gpt_with_packed_documents_matches_dense(rank_pool, layout_kwargs, sequence_parallel):
    """segment_ids through the GPT: ring attention's document mask under CP, SDPA's without CP."""
    losses = rank_pool(4).run(_gpt_on_rank, layout_kwargs, sequence_parallel, "auto", 2, False, None, False, True)
    assert len(set(losses)) == 1


@pytest.mark.parametrize("layout_kwargs, sequence_parallel, kv_heads, documents", [
    (dict(cp=2), False, 2, False), (dict(tp=2, cp=2), True, 2, True), (dict(cp=4), True, 1, True),
    (dict(cp=4), False, 4, False)])
def test_gpt_with_ulysses_attention_matches_dense(rank_pool, layout_kwargs, sequence_parallel, kv_heads, documents):
    """cp_attention="ulysses": the heads of each TP rank split over CP (tp=2 x cp=2: 2 query heads and
    1 key/value head per TP rank, copied to both CP ranks; cp=4 with MQA: copied to all four)."""
    losses = rank_pool(4).run(_ulysses_gpt_on_rank, layout_kwargs, sequence_parallel, kv_heads, documents)
    assert len(set(losses)) == 1


def _ulysses_gpt_on_rank(layout_kwargs, sequence_parallel, kv_heads, documents):
    """_gpt_on_rank with the layers' ring_attention refused and their ulysses_attention calls counted:
    matching the dense GPT through the ring would say nothing of ulysses."""
    import overlapkernels.layers.attention as attention_module

    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return ok.ulysses_attention(*args, **kwargs)

    def refused(*args, **kwargs):
        raise AssertionError("cp_attention='ulysses' ran ring_attention")

    saved = attention_module.ring_attention, attention_module.ulysses_attention
    attention_module.ring_attention, attention_module.ulysses_attention = refused, counted
    try:
        loss = _gpt_on_rank(layout_kwargs, sequence_parallel, "auto", kv_heads, False, None, False, documents, False,
                            "ulysses")
    finally:
        attention_module.ring_attention, attention_module.ulysses_attention = saved
    assert calls, "the layers never called ulysses_attention"
    return loss


def test_ulysses_heads_that_do_not_split_over_cp_are_refused_at_construction(rank_pool):
    assert rank_pool(4).run(_unsplittable_heads_on_rank) == [True] * 4


def _unsplittable_heads_on_rank():
    dims = ok.init_parallel(tp=2, cp=2)
    with pytest.raises(ValueError, match=re.escape("ulysses_attention: each TP rank (2 heads / TP 2) has 1 heads, not "
                                                   "divisible by the group size 2")), no_communication():
        GPT(GPTConfig(**{**CONFIG, "num_heads": 2, "num_kv_heads": 2, "hidden": 8}, cp_attention="ulysses"), dims)
    with pytest.raises(ValueError, match=r"GPTConfig.cp_attention='rings': expected one of \['ring', 'ulysses'\]"):
        GPTConfig(**CONFIG, cp_attention="rings")
    return True


@pytest.mark.usefixtures("world_of_one")
def test_a_packed_row_trains_as_its_documents_apart():
    """With segment ids, a row packing documents of 3 and 5 tokens gives the loss and gradients of the
    two run apart (RoPE's scores depend on distances only, so positions 3.. act as 0..); without ids
    the second document attends to the first and the loss moves."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG), ok.init_parallel(), dtype=torch.float64)
    g = torch.Generator().manual_seed(7)
    tokens, targets = (torch.randint(0, CONFIG["vocab_size"], (1, 8), generator=g) for _ in range(2))
    packed = model.loss(tokens, targets, torch.tensor([[4, 4, 4, 9, 9, 9, 9, 9]]))
    packed.backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    apart = (3 * model.loss(tokens[:, :3], targets[:, :3]) + 5 * model.loss(tokens[:, 3:], targets[:, 3:])) / 8
    apart.backward()
    torch.testing.assert_close(packed, apart, atol=1e-12, rtol=1e-12)
    for name, p in model.named_parameters():
        torch.testing.assert_close(packed_grads[name], p.grad, atol=1e-12, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    with torch.no_grad():
        assert abs(float(model.loss(tokens, targets)) - float(packed)) > 1e-3
    # the ids reach blocks that recompute their forward in backward too
    recomputed = GPT(GPTConfig(**CONFIG, activation_checkpointing=True), ok.init_parallel(), dtype=torch.float64)
    recomputed.load_state_dict(model.state_dict())
    ids = torch.tensor([[4, 4, 4, 9, 9, 9, 9, 9]])
    loss = recomputed.loss(tokens, targets, ids)
    ids.fill_(0)  # the caller's buffer refilled before backward: the recompute keeps the forward's ids
    loss.backward()
    for name, p in recomputed.named_parameters():
        torch.testing.assert_close(p.grad, packed_grads[name], atol=1e-12, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout_kwargs, sequence_parallel, clip", [
    (dict(tp=2), True, (0.05, 2.0)),          # TP-partitioned, SP-replicated and DP-replicated (dp=2) grads
    (dict(tp=2, cp=2), False, (0.05, 2.0)),   # + CP replicas, norms without SP replicated over TP
    (dict(tp=2, cp=2), True, (1e-3, math.inf)),
])
def test_clip_grad_norm_is_the_dense_models(rank_pool, layout_kwargs, sequence_parallel, clip):
    """ok.clip_grad_norm_ equals torch's on the dense model, and so do the clipped gradients."""
    losses = rank_pool(4).run(_gpt_on_rank, layout_kwargs, sequence_parallel, "baseline", 2, False, clip)
    assert len(set(losses)) == 1  # every rank reports the same global loss


@pytest.mark.usefixtures("world_of_one")
def test_clip_grad_norm_skips_parameters_without_gradients():
    """A frozen (or unused) parameter has no gradient: it adds nothing to the norm and keeps none."""
    with_grad, frozen = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.ones(3))
    with_grad.grad = torch.tensor([3.0, 4.0])
    norm = ok.clip_grad_norm_([with_grad, frozen], 1.0, dims=None)
    assert norm.item() == pytest.approx(5.0) and frozen.grad is None
    torch.testing.assert_close(with_grad.grad, torch.tensor([0.6, 0.8]))


def _planted_missing_gradient_sync_on_rank():
    with pytest.raises(AssertionError):  # CP and DP ranks' partial gradients never summed
        _gpt_on_rank(dict(cp=2), False, "baseline", planted_missing_sync=True)
    with pytest.raises(AssertionError, match=r"\[.norm\.weight.\]"):  # a gradient lost is not skipped
        _gpt_on_rank(dict(tp=2), True, "baseline", planted_lost_grad=True)
    return True


def test_planted_missing_gradient_sync_is_caught(rank_pool):
    assert rank_pool(4).run(_planted_missing_gradient_sync_on_rank) == [True] * 4


def test_gpt_bad_sequence_length(rank_pool):
    assert rank_pool(2).run(_bad_seq_on_rank) == [True, True]


def _bad_seq_on_rank():
    model = GPT(GPTConfig(**CONFIG), ok.init_parallel(cp=2), dtype=torch.float64)
    try:
        model.loss(torch.zeros(1, 6, dtype=torch.long), torch.zeros(1, 6, dtype=torch.long))
    except ValueError as exc:
        assert "sequence length 6 cannot be split: it must be divisible by 4 (CP size 2, layout 'zigzag')" in str(exc)
    else:
        raise AssertionError("no ValueError")
    # the attention layer on its own, with an odd local length under zigzag CP: refused before any
    # communication (it used to fail inside RoPE)
    dims = ok.init_parallel(cp=2)
    attn = ParallelSelfAttention(16, 4, 2, dims.tp_group, cp_group=dims.cp_group, method="baseline",
                                 dtype=torch.float64)
    try:
        attn(torch.ones(3, 1, 16, dtype=torch.float64))
    except ValueError as exc:
        assert "local sequence length 3 (x.shape[0]=3) is odd: cp_layout='zigzag' over a CP group of 2" in str(exc)
    else:
        raise AssertionError("no ValueError from ParallelSelfAttention")
    # the forward on token ids refuses what loss refuses: more tokens than max_seq_len (over CP)
    try:
        model(torch.zeros(1, 9, dtype=torch.long))  # 9 local ids x CP 2 = 18 > 16
    except ValueError as exc:
        assert "sequence length 18 > max_seq_len=16" in str(exc)
    else:
        raise AssertionError("no ValueError for a sequence longer than max_seq_len")
    # loss refuses what is not a [B, S] pair, naming the argument, on every rank before the forward
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^targets shape \(8,\) must equal tokens shape \(1, 8\) \(\[B, S\]\)$"):
        model.loss(ids, ids[0])
    with pytest.raises(ValueError, match=r"^tokens must be \[B, S\], got shape \(8,\)$"):
        model.loss(ids[0], ids[0])
    with pytest.raises(ValueError, match=r"^sequence length 18 > max_seq_len=16$"):  # (nor divisible by 4)
        model.loss(torch.zeros(1, 18, dtype=torch.long), torch.zeros(1, 18, dtype=torch.long))
    # segment ids: a [B, S] like the tokens, integers, sized to what the layer attends over
    with pytest.raises(ValueError, match=r"^segment_ids must be integer ids shaped as the tokens \(1, 8\), got "
                                         r"torch.int64 \(1, 4\)$"):
        model.loss(ids, ids, ids[:, :4])
    with no_communication():
        with pytest.raises(ValueError, match=r"ParallelSelfAttention: segment_ids.shape=\(1, 2\), expected \[B, S_local\] "
                                             r"= \[1, 4\] \(x is \[S, B, hidden\]\)"):
            attn(torch.ones(4, 1, 16, dtype=torch.float64), torch.zeros(1, 2, dtype=torch.long))
        with pytest.raises(TypeError, match=r"segment_ids.dtype=torch.float32: expected integer ids"):
            attn(torch.ones(4, 1, 16, dtype=torch.float64), torch.zeros(1, 4))
        with pytest.raises(ValueError, match=r"ParallelSelfAttention: segment_ids is on meta but x is on cpu"):
            attn(torch.ones(4, 1, 16, dtype=torch.float64), torch.zeros(1, 4, dtype=torch.long, device="meta"))
        with pytest.raises(ValueError, match=r"segment_ids was laid out with layout='contiguous'"):  # cp_layout zigzag
            attn(torch.ones(4, 1, 16, dtype=torch.float64),
                 ok.shard_sequence(torch.zeros(1, 8, dtype=torch.long), dims.cp_group, dim=1, layout="contiguous"))
    for bad in (0, True, 2.0):
        try:
            GPTConfig(**{**CONFIG, "num_heads": bad})
        except ValueError as exc:
            assert f"GPTConfig.num_heads={bad!r}: expected an integer >= 1" in str(exc)
        else:
            raise AssertionError(f"num_heads={bad!r} accepted")
    for name, bad, said in (("ignore_index", 0.5, "GPTConfig.ignore_index=0.5: expected an int"),
                            ("ignore_index", None, "GPTConfig.ignore_index=None: expected an int"),
                            ("sequence_parallel", "no", "GPTConfig.sequence_parallel='no': expected a bool")):
        with pytest.raises(TypeError, match=f"^{re.escape(said)}"):
            GPTConfig(**{**CONFIG, name: bad})
    numpy = pytest.importorskip("numpy")  # numpy's integers are sizes too, as the layers take them
    assert GPTConfig(**{**CONFIG, "num_heads": numpy.int64(CONFIG["num_heads"])}).num_heads == CONFIG["num_heads"]
    one = torch.ones(1)
    dist.all_reduce(one)
    return True


def _bad_ids_under_cp_on_rank():
    """Under CP each rank holds part of the sequence: a bad id in rank 1's part only failed rank 1
    (its embedding or loss) while rank 0 waited for it in the ring or the loss's all-reduce."""
    model = GPT(GPTConfig(**CONFIG), ok.init_parallel(cp=2), dtype=torch.float64)
    said = []
    for which, value in (("tokens", 32), ("targets", 40)):
        batch = {"tokens": torch.zeros(1, 8, dtype=torch.long), "targets": torch.zeros(1, 8, dtype=torch.long)}
        batch[which][0, 2] = value  # zigzag over 2 ranks: positions 2-3 and 4-5 are rank 1's
        try:
            model.loss(batch["tokens"], batch["targets"])
        except (ValueError, IndexError) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    return said


def test_bad_ids_in_one_cp_ranks_part_are_refused_on_every_rank(rank_pool):
    assert rank_pool(2).run(_bad_ids_under_cp_on_rank) == [[
        "IndexError: tokens hold ids outside [0, 32), e.g. 32",
        "ValueError: target holds ids outside [0, 32) that are not ignore_index=-100, e.g. 40"]] * 2


_STAGE_RANGE = r": expected \(stage, num_stages\) of integers with 0 <= stage < num_stages$"


@pytest.mark.parametrize("pipeline_stage, match", [
    ((2, 2), r"^pipeline_stage=\(2, 2\)" + _STAGE_RANGE), ((-1, 2), r"^pipeline_stage=\(-1, 2\)" + _STAGE_RANGE),
    ((0, 0), r"^pipeline_stage=\(0, 0\)" + _STAGE_RANGE), ((0, 1.0), r"^pipeline_stage=\(0, 1.0\)" + _STAGE_RANGE),
    ((0, 3), r"^pipeline_stage=\(0, 3\): num_layers=2 must split evenly into 3 stages$"),
])
def test_bad_pipeline_stage_is_refused(pipeline_stage, match):
    """Before any layer is built (dims is not even read)."""
    with pytest.raises(ValueError, match=match):
        GPT(GPTConfig(**CONFIG), None, pipeline_stage=pipeline_stage)


def _dense_state_dict_refusals_on_rank():
    dims = ok.init_parallel(tp=2)
    model = GPT(GPTConfig(**CONFIG, method="baseline"), dims, dtype=torch.float64)
    good = GPT(GPTConfig(**CONFIG), ok.init_parallel(), dtype=torch.float64).state_dict()
    messages = []
    # a vocabulary that does not split over TP (33: chunks 17 and 16) or has fewer rows than ranks (1:
    # no chunk for rank 1): every rank refuses alike, not only those whose chunk is off
    for rows in (33, 1):
        try:
            shard_dense_state_dict(model, {**good, "embed.weight": torch.zeros(rows, 16, dtype=torch.float64)})
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append("accepted")
    with pytest.raises(ValueError, match=r"^model has no \.dims \(ParallelDims\): build it as GPT\(config, dims\)$"):
        shard_dense_state_dict(torch.nn.Linear(2, 2), good)
    # gradients: a parameter without one (frozen here, TP-split or not) is left out on every rank
    frozen = {"blocks.0.attn.q_weight", "norm.weight"}
    for name, p in model.named_parameters():
        p.requires_grad_(name not in frozen)
    assert gather_dense_state_dict(model, grads=True) == {}  # before backward: none yet
    model.loss(torch.zeros(2, 8, dtype=torch.long), torch.ones(2, 8, dtype=torch.long)).backward()
    assert set(gather_dense_state_dict(model, grads=True)) == {n for n, _ in model.named_parameters()} - frozen
    return messages


def test_dense_state_dict_refusals(rank_pool):
    for messages in rank_pool(2).run(_dense_state_dict_refusals_on_rank):
        assert messages == [f"embed.weight: dense shape ({rows}, 16) does not shard to (16, 16) (over 2 TP ranks: "
                            "expected (32, 16))" for rows in (33, 1)]


def _gpt_under_fsdp2_on_rank(layout_kwargs, reshard_after_backward):
    """The GPT with CP (and TP + SP) wrapped by torch's FSDP2 over DP: sync_grads sums the CP-partial
    gradients on FSDP2's shards (also when the modules hold unsharded parameters after backward),
    and the global norm and the dense export equal the dense model's. Every DP rank feeds the whole batch,
    so FSDP2's average over DP is the dense gradient."""
    from torch.distributed.fsdp import fully_shard

    config = GPTConfig(**CONFIG, sequence_parallel=True, method="baseline")
    g = torch.Generator().manual_seed(42)
    tokens, targets = (torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=g) for _ in range(2))
    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=torch.float64)
    dense.loss(tokens, targets).backward()
    dims = ok.init_parallel(**layout_kwargs)
    model = GPT(config, dims, dtype=torch.float64)
    model.load_state_dict(shard_dense_state_dict(model, dense.state_dict()))
    for block in model.blocks.values():
        fully_shard(block, mesh=dims.mesh["dp"])
    fully_shard(model, mesh=dims.mesh["dp"])
    model.set_reshard_after_backward(reshard_after_backward)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.loss(tokens, targets).backward()
    # our ops' results are not views, so FSDP2 can hook every module's output (none returned a view)
    assert not [w for w in caught if "returned a view tensor" in str(w.message)], [str(w.message) for w in caught]
    model.sync_grads()
    dense_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in dense.parameters()]))
    # the whole model's norm (1e9: nothing clipped): TP shards, CP and TP replicas and DP shards each once
    torch.testing.assert_close(ok.clip_grad_norm_(model, 1e9, dims=dims), dense_norm, atol=1e-12, rtol=1e-12)
    for name, grad in gather_dense_state_dict(model, grads=True).items():
        want = dict(dense.named_parameters())[name].grad
        torch.testing.assert_close(grad, want, atol=1e-11, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("layout_kwargs, reshard_after_backward", [(dict(cp=2), True), (dict(cp=2), False),
                                                                    (dict(tp=2, cp=2), True)])
def test_gpt_context_parallel_under_torch_fsdp2(rank_pool, layout_kwargs, reshard_after_backward):
    assert rank_pool(4).run(_gpt_under_fsdp2_on_rank, layout_kwargs, reshard_after_backward) == [True] * 4


def _gpt_fsdp2_over_dp_and_cp_on_rank():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dims = ok.init_parallel(cp=2)
    model = fully_shard(GPT(GPTConfig(**CONFIG, method="baseline"), dims, dtype=torch.float64),
                        mesh=init_device_mesh("cpu", (4,)))  # DP x CP: FSDP2 averages over CP already
    tokens = torch.zeros(2, 8, dtype=torch.long)
    model.loss(tokens, tokens).backward()
    try:
        model.sync_grads()
    except ValueError as exc:
        return str(exc).split(";")[0]


def test_gpt_under_fsdp2_over_a_mesh_with_cp_peers_is_refused(rank_pool):
    assert rank_pool(4).run(_gpt_fsdp2_over_dp_and_cp_on_rank) == [
        "sync_grads: torch's FSDP2 shards these parameters over a mesh that holds CP peers (it averaged their "
        "partial gradients, 1/cp of the sum)"] * 4


def _deepcopy_on_rank():
    """copy.deepcopy of a model holding our layers (an EMA copy, a DPO reference, a teacher) failed:
    torch cannot copy a ProcessGroup. The copy shares the groups (parameter tags too), owns its
    parameters, computes what the original computes, and is not moved by the original's training."""
    import copy

    dims = ok.init_parallel(tp=2, cp=dist.get_world_size() // 2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CONFIG), dims, dtype=torch.float64)
    wrapped = torch.nn.Sequential(model)  # reached through a plain container too
    twin = copy.deepcopy(wrapped)[0]
    shared = [(twin.dims.tp_group is dims.tp_group),
              all(getattr(p, "sequence_parallel_group", None) is getattr(q, "sequence_parallel_group", None)
                  for p, q in zip(twin.parameters(), model.parameters())),
              any(getattr(p, "sequence_parallel_group", None) is dims.tp_group for p in twin.parameters())]
    distinct = all(p.data_ptr() != q.data_ptr() and torch.equal(p, q)
                   for p, q in zip(twin.parameters(), model.parameters()))
    g = torch.Generator().manual_seed(1)
    tokens, targets = (torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=g) for _ in range(2))
    before = twin.loss(tokens, targets).detach()
    same = torch.equal(model.loss(tokens, targets).detach(), before)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    return shared, distinct, same, torch.equal(twin.loss(tokens, targets).detach(), before)


def test_a_model_of_our_layers_deep_copies_sharing_its_groups(rank_pool):
    assert rank_pool(4).run(_deepcopy_on_rank) == [([True] * 3, True, True, True)] * 4
