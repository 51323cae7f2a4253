"""fsdp.shard composed with the other parallelisms (TP + SP layers, the GPT, CP peers) on gloo
ranks vs the dense model on the whole batch, and gradient clipping over all of them (ours under
fsdp.shard, and under torch's FSDP2)."""
import math
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkernels as ok
from overlapkernels.runtime import fsdp
from overlapkernels.runtime.grad_norm import dtensor_replicas
from test_fsdp_gloo import D_IN, OPTIMIZERS


def _tp_dp_on_rank(layout=None, stage=3, clip=None):
    """GPT with TP=2 (+SP) inside (or CP=2: ring attention, every gradient partial over CP),
    ZeRO over DP=2, vs the dense GPT on the whole batch."""
    from overlapkernels.layers import TransformerBlock
    from overlapkernels.models import GPT, GPTConfig, gather_dense_state_dict, shard_dense_state_dict

    config = GPTConfig(vocab_size=16, hidden=8, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden=16,
                       max_seq_len=8, method="decomposed")
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randint(0, 16, (4, 8), generator=g), torch.randint(0, 16, (4, 8), generator=g))
               for _ in range(2)]
    adamw = OPTIMIZERS["sgd"]  # scale-sensitive: a missing average or a double TP sum would show
    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=torch.float64)
    dense_opt = adamw(dense.parameters())
    start = {k: v.clone() if torch.is_tensor(v) else v for k, v in dense.state_dict().items()}
    dense_norms = []
    for tokens, targets in batches:
        dense_opt.zero_grad()
        dense.loss(tokens, targets).backward()
        if clip is not None:
            dense_norms.append(torch.nn.utils.clip_grad_norm_(dense.parameters(), clip))
            assert dense_norms[-1] > clip  # the clip bites
        dense_opt.step()

    dims = ok.init_parallel(**(layout or dict(tp=2)))
    model = GPT(config, dims, dtype=torch.float64)
    model.load_state_dict(shard_dense_state_dict(model, start))
    sharded = fsdp.shard(model, dims.dp_group, stage=stage, units=(TransformerBlock,), optimizer=adamw)
    mine = slice(dims.dp_rank * 2, (dims.dp_rank + 1) * 2)
    for step, (tokens, targets) in enumerate(batches):
        sharded.module.loss(tokens[mine], targets[mine]).backward()
        if clip is not None:  # the whole model's norm: DP shards, TP partitions and CP replicas each once
            norm = sharded.clip_grad_norm_(clip, dims=dims)
            torch.testing.assert_close(norm, dense_norms[step], atol=1e-12, rtol=1e-12)
        sharded.step()
    # stage 3 has freed the model's parameters (its state_dict() refuses): shard onto an unsharded twin
    want = shard_dense_state_dict(GPT(config, dims, dtype=torch.float64), dense.state_dict())
    for name, t in sharded.full_state_dict().items():
        if torch.is_tensor(t):
            torch.testing.assert_close(t, want[name], atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    # the export from the sharded model (over DP, then TP): the dense model's state dict, key for key
    exported, reference = gather_dense_state_dict(sharded), dense.state_dict()
    assert list(exported) == list(reference)
    for name, t in reference.items():
        if torch.is_tensor(t):
            torch.testing.assert_close(exported[name], t, atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    with pytest.raises(ValueError, match=r"grads=True\) of an fsdp.shard model"):
        gather_dense_state_dict(sharded, grads=True)
    return True


def test_tp2_by_dp2_with_the_tp_layers(rank_pool):
    assert rank_pool(4).run(_tp_dp_on_rank) == [True] * 4


@pytest.mark.parametrize("layout, stage", [(dict(tp=2), 1), (dict(tp=2), 3), (dict(cp=2), 2)])
def test_clip_grad_norm_matches_the_dense_model(rank_pool, layout, stage):
    assert rank_pool(4).run(_tp_dp_on_rank, layout, stage, 0.05) == [True] * 4


@pytest.mark.parametrize("stage", [1, 3])
def test_cp2_by_dp2_sums_context_parallel_gradients(rank_pool, stage):
    """Stage 3 frees the full gradients during backward: only fsdp can sum them over CP."""
    assert rank_pool(4).run(_tp_dp_on_rank, dict(cp=2), stage) == [True] * 4


# -- sequence parallelism: any model built from the layers, not only the GPT -----------------------
H = 8


class SPNet(nn.Module):
    """Every kind of sequence-parallel parameter: RMSNorm and LayerNorm weights, the row bias."""

    def __init__(self, group, sp):
        from overlapkernels.layers import ColumnParallelLinear, LayerNorm, RMSNorm, RowParallelLinear

        super().__init__()
        self.norm = RMSNorm(H, sequence_parallel=sp, group=group, dtype=torch.float64)
        self.fc1 = ColumnParallelLinear(H, 2 * H, group, sequence_parallel=sp, method="baseline", dtype=torch.float64)
        self.fc2 = RowParallelLinear(2 * H, H, group, sequence_parallel=sp, method="baseline", dtype=torch.float64)
        self.ln = LayerNorm(H, sequence_parallel=sp, group=group, dtype=torch.float64)

    def forward(self, x):
        return self.ln(x + self.fc2(torch.tanh(self.fc1(self.norm(x)))))


def _sp_layers_on_rank(stage):
    """TP=2 (+SP) x DP=2, 2 SGD steps, vs the same layers on one rank over the whole batch."""
    from overlapkernels.layers import allreduce_sequence_parallel_grads
    from overlapkernels.models import shard_dense_state_dict

    sgd = OPTIMIZERS["sgd"]
    g = torch.Generator().manual_seed(5)
    batches = [torch.randn(4, 4, H, generator=g, dtype=torch.float64) for _ in range(2)]  # [S, B, H]
    torch.manual_seed(0)
    dense = SPNet(ok.init_parallel().tp_group, False)
    with torch.no_grad():  # norms start at 1 and biases at 0: make every term visible
        for p in dense.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.1)
    start = {k: v.clone() if torch.is_tensor(v) else v for k, v in dense.state_dict().items()}
    dense_opt = sgd(dense.parameters())
    for x in batches:
        dense_opt.zero_grad()
        dense(x).pow(2).mean().backward()
        dense_opt.step()

    dims = ok.init_parallel(tp=2)
    twin = SPNet(dims.tp_group, True)  # unsharded: stage 3 frees the sharded model's parameters
    model = SPNet(dims.tp_group, True)
    model.load_state_dict(shard_dense_state_dict(model, start, dims.tp_group))
    sharded = fsdp.shard(model, dims.dp_group, stage=stage, optimizer=sgd)
    for x in batches:
        rows, cols = x.chunk(2, 0)[dims.tp_rank], slice(dims.dp_rank * 2, dims.dp_rank * 2 + 2)
        # mean over all elements: this rank's sum over the whole count, times DP (fsdp averages over DP)
        (sharded(rows[:, cols]).pow(2).sum() * 2 / x.numel()).backward()
        if stage == 1:  # what a plain-TP client does: fsdp already sums tagged parameters, so a no-op
            assert allreduce_sequence_parallel_grads(model) == 0
        sharded.step()
    want = shard_dense_state_dict(twin, dense.state_dict(), dims.tp_group)
    for name, t in sharded.full_state_dict().items():
        if torch.is_tensor(t):
            torch.testing.assert_close(t, want[name], atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_sequence_parallel_layers_tp2_by_dp2(rank_pool, stage):
    assert rank_pool(4).run(_sp_layers_on_rank, stage) == [True] * 4


def _untagged_sp_on_rank():
    from overlapkernels.layers import RMSNorm

    model = nn.Sequential(nn.Linear(4, 4), RMSNorm(4, sequence_parallel=True))  # no group: fsdp cannot sum it
    fsdp.shard(model, stage=1)  # stage 1 keeps full gradients: the client may still sum them itself
    try:
        fsdp.shard(model, stage=2)
    except ValueError as exc:
        return str(exc)


def test_sequence_parallel_parameter_without_group_is_refused(rank_pool):
    for message in rank_pool(2).run(_untagged_sp_on_rank):
        assert "parameter '1.weight' has sequence_parallel=True but no sequence_parallel_group: with stage=2" \
            in message, message


# -- CP peers, and clipping -------------------------------------------------------------------------
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(D_IN, D_IN)
        self.b = nn.Linear(D_IN, D_IN)  # a data-dependent branch: an MoE expert that got no tokens here

    def forward(self, x, use_b):
        y = self.a(x)
        return self.b(y) if use_b else y


def _doubled_cp_sum(unit, original):
    """A planted bug: a unit's CP-summed gradient shard added twice (peers still agree)."""
    before = unit.master.grad.clone()
    original(unit)
    if unit.cp_group is not None:
        unit.master.grad += unit.master.grad - before


def _cp_branch_on_rank(stage, plant=None):
    """CP peers own the same shards and sum them: when only one of them has a gradient for a unit,
    the other must still take part (no hang), and every rank steps by the CP sum of the DP means,
    as one process computes it by hand. Ranks r = 2 * dp_rank + cp_rank; only CP rank 0 routes
    through b. ``plant``: a wrapper of FlatUnit.finish_reduce that breaks it (returns "caught" when
    the comparison sees it)."""
    from overlapkernels.runtime.fsdp.flat_unit import FlatUnit

    rank = dist.get_rank()
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp, cp = dp_groups[rank % 2], cp_groups[rank // 2]
    torch.manual_seed(0)
    model = _Branchy().double()
    for p in model.parameters():
        p.context_parallel_group = cp
    sharded = fsdp.shard(model, dp, stage=stage, prefetch=0, optimizer=OPTIMIZERS["sgd"])
    xs = [torch.randn(2, D_IN, dtype=torch.float64, generator=torch.Generator().manual_seed(r)) for r in range(4)]
    original = FlatUnit.finish_reduce
    if plant is not None:
        FlatUnit.finish_reduce = lambda unit: plant(unit, original)
    try:
        sharded(xs[rank], rank % 2 == 0).sum().backward()
        sharded.step()
    finally:
        FlatUnit.finish_reduce = original
    state = sharded.full_state_dict()

    torch.manual_seed(0)
    ref = _Branchy().double()
    params = list(ref.parameters())
    grads = [torch.autograd.grad(ref(xs[r], r % 2 == 0).sum(), params, allow_unused=True, materialize_grads=True)
             for r in range(4)]
    for i, p in enumerate(params):  # the DP mean of each CP rank (over r = c, c + 2), summed over CP;
        dp_means = [grads[c][i] / 2 + grads[c + 2][i] / 2 for c in range(2)]  # sums of 2 terms: exact
        p.grad = dp_means[0] + dp_means[1]
    b_before = ref.b.weight.detach().clone()
    OPTIMIZERS["sgd"](params).step()
    assert not torch.equal(ref.b.weight, b_before)  # b has a gradient (from one CP side only)
    want = ref.state_dict()
    assert list(state) == list(want)
    differ = [k for k in want if not torch.equal(state[k], want[k])]
    if plant is not None:
        return "caught" if differ else "missed"
    assert not differ, f"not equal to the single-process step on the CP-summed DP mean: {differ}"
    mine = torch.cat([state[k].reshape(-1) for k in sorted(state)])
    peers = [torch.empty_like(mine) for _ in range(2)]
    dist.all_gather(peers, mine, group=cp)
    assert torch.equal(peers[0], peers[1])  # CP replicas agree
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_context_parallel_peers_step_by_the_cp_sum_when_only_one_has_a_gradient(rank_pool, stage):
    assert rank_pool(4).run(_cp_branch_on_rank, stage) == [True] * 4


def test_planted_doubled_cp_sum_is_caught(rank_pool):
    """Peers agree on a doubled CP sum and b still moves: only the reference sees it."""
    assert rank_pool(4).run(_cp_branch_on_rank, 2, _doubled_cp_sum) == ["caught"] * 4


@pytest.mark.parametrize("max_norm, norm_type, exc, pattern", [
    (0.0, 2.0, ValueError, r"max_norm=0.0: expected a positive number"),
    (1.0, -1, ValueError, r"norm_type=-1: expected a positive number or math.inf"),
    ("1", 2.0, TypeError, r"max_norm must be a number, got str"),
])
def test_clip_grad_norm_bad_arguments_raise_before_communicating(max_norm, norm_type, exc, pattern):
    with pytest.raises(exc, match=pattern):  # no process group here: it must not get that far
        ok.clip_grad_norm_([nn.Parameter(torch.ones(2))], max_norm, norm_type, dims=None)


def _nonfinite_norm_on_rank(bad_rank, value, norm_type):
    from nccl_like import nccl_rules

    p = nn.Parameter(torch.ones(4, dtype=torch.float64))
    p.grad = torch.ones(4, dtype=torch.float64)
    if dist.get_rank() == bad_rank:
        p.grad[1] = value
    with nccl_rules():  # a NaN reaching NCCL's MAX (fmax) would be dropped: refused here
        norm = ok.clip_grad_norm_([p], 1.0, norm_type, dims=None)
    return norm.item()


@pytest.mark.parametrize("norm_type", [2.0, math.inf])
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_nan_or_inf_gradient_on_any_rank_reaches_every_rank(rank_pool, norm_type, bad_rank):
    """The inf norm all-reduces with MAX, which NCCL computes with fmax: it dropped a NaN from any
    rank (gloo from any but rank 0), so the other ranks clipped on as if all were finite."""
    nan = rank_pool(2).run(_nonfinite_norm_on_rank, bad_rank, math.nan, norm_type)
    assert all(math.isnan(n) for n in nan), nan
    assert rank_pool(2).run(_nonfinite_norm_on_rank, bad_rank, math.inf, norm_type) == [math.inf] * 2


def _torch_options_on_rank():
    """torch's error_if_nonfinite and foreach: with a NaN on one rank every rank raises (the norm is
    the same everywhere) before scaling anything; foreach True, False or None clips exactly as
    torch does (replicated gradients, dims=None: the norm is each rank's own)."""
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(5, generator=g, dtype=torch.float64), torch.randn(3, 2, generator=g)]
    want = [nn.Parameter(t.clone()) for t in grads]
    for w, t in zip(want, grads):
        w.grad = t.clone() * 4
    torch.nn.utils.clip_grad_norm_(want, 0.5)
    got = []
    for foreach in (True, False, None):
        params = [nn.Parameter(t.clone()) for t in grads]
        for q, t in zip(params, grads):
            q.grad = t.clone() * 4
        ok.clip_grad_norm_(params, 0.5, dims=None, foreach=foreach)
        for q, w in zip(params, want):  # our norm sums in fp64, torch's in each tensor's dtype
            torch.testing.assert_close(q.grad, w.grad, atol=0, rtol=1e-6)
        got.append([q.grad for q in params])
    assert all(torch.equal(a, b) for other in got[1:] for a, b in zip(got[0], other)), "foreach changed the result"
    said = []
    p = nn.Parameter(torch.ones(4, dtype=torch.float64))
    p.grad = torch.ones(4, dtype=torch.float64)
    p.grad[2] = math.nan if dist.get_rank() == 1 else 1.0
    before = p.grad.clone()
    sharded = fsdp.shard(nn.Sequential(nn.Linear(D_IN, 3)).double(), stage=2)
    sharded(torch.full((2, D_IN), math.inf if dist.get_rank() == 0 else 1.0, dtype=torch.float64)).sum().backward()
    for clip in (lambda: ok.clip_grad_norm_([p], 1.0, dims=None, error_if_nonfinite=True),
                 lambda: sharded.clip_grad_norm_(1.0, error_if_nonfinite=True)):
        try:
            clip()
        except RuntimeError as exc:
            said.append(str(exc))
    return said, torch.equal(p.grad, before) if dist.get_rank() == 0 else bool(p.grad[2].isnan())


def test_clip_grad_norm_takes_torchs_error_if_nonfinite_and_foreach(rank_pool):
    for said, untouched in rank_pool(2).run(_torch_options_on_rank):
        assert said == [f"the total norm of the gradients is {value}, so they cannot be clipped; set "
                        "error_if_nonfinite=False to scale them by it anyway" for value in ("nan", "inf")], said
        assert untouched


def _clip_in_no_sync_on_rank():
    sharded = fsdp.shard(nn.Sequential(nn.Linear(D_IN, 3)).double(), stage=2)
    with sharded.no_sync():
        sharded(torch.ones(2, D_IN, dtype=torch.float64)).sum().backward()
        try:
            sharded.clip_grad_norm_(1.0)
        except RuntimeError as exc:
            return str(exc)
    return "clipped"


def test_clip_grad_norm_inside_no_sync_is_refused(rank_pool):
    assert rank_pool(2).run(_clip_in_no_sync_on_rank) == ["clip_grad_norm_ inside no_sync(): clip once, after the "
                                                          "last backward of the step"] * 2


def _clip_bad_modules_on_rank():
    """fsdp.clip_grad_norm_'s modules are ShardedModules; without dims they share one group."""
    from comm_guard import no_communication

    whole = fsdp.shard(nn.Sequential(nn.Linear(D_IN, 3)).double(), stage=1)
    alone = fsdp.shard(nn.Sequential(nn.Linear(D_IN, 3)).double(), dist.new_group([dist.get_rank()]), stage=1)
    said = []
    for modules in ([], [whole, nn.Linear(2, 2)], whole.module, [whole, alone]):
        try:
            with no_communication():
                fsdp.clip_grad_norm_(modules, 1.0)
        except (TypeError, ValueError) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    return said


def test_fsdp_clip_grad_norm_refuses_bad_modules_before_communicating(rank_pool):
    said = rank_pool(2).run(_clip_bad_modules_on_rank)
    assert said[0][:3] == ["TypeError: modules=[]: expected a ShardedModule (fsdp.shard) or a non-empty list of them",
                           "TypeError: modules[1]=Linear: expected a ShardedModule (fsdp.shard)",
                           "TypeError: modules=Sequential: expected a ShardedModule (fsdp.shard) or a non-empty list "
                           "of them"], said[0]
    assert said[0][3] == ("ValueError: clip_grad_norm_: the modules are sharded over different groups [(0,), (0, 1)]; "
                          "pass dims= (a ParallelDims) so the norm spans the world"), said[0][3]
    assert said[1][3].startswith("ValueError: clip_grad_norm_: the modules are sharded over different groups [(0, 1), "
                                 "(1,)]"), said[1][3]


class _Mesh:
    def __init__(self, *sizes):
        self.sizes = sizes

    def size(self, i):
        return self.sizes[i]


def _dtensor_grad(placements, *mesh_sizes):
    return SimpleNamespace(placements=placements, device_mesh=_Mesh(*mesh_sizes))


def test_dtensor_gradient_shards_count_once_per_copy():
    """torch's FSDP2 under ok.clip_grad_norm_: this rank's local shard of a DTensor gradient is held
    by the copies its mesh does not shard over (each copy's share is divided by their number)."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    dims = SimpleNamespace(tp_size=2, cp_size=2, dp_size=4)
    # FSDP2 over DP: a TP-split weight's shard is also held by its CP peer; a replicated one by TP peers too
    assert dtensor_replicas(_dtensor_grad([Shard(0)], 4), True, dims) == 2
    assert dtensor_replicas(_dtensor_grad([Shard(0)], 4), False, dims) == 4
    # torchtitan's dp_shard_cp mesh (FSDP2 over DP x CP), and HSDP (replicate over 2, shard over 2)
    assert dtensor_replicas(_dtensor_grad([Shard(0)], 8), True, dims) == 1
    assert dtensor_replicas(_dtensor_grad([Replicate(), Shard(0)], 2, 2), True, dims) == 4
    with pytest.raises(ValueError, match=r"sharded over 3 ranks, which does not divide its 8 copies \(DP x CP of"):
        dtensor_replicas(_dtensor_grad([Shard(0)], 3), True, dims)
    with pytest.raises(ValueError, match=r"still a partial sum \(Partial\); clip after the gradients are reduced"):
        dtensor_replicas(_dtensor_grad([Partial()], 4), True, dims)
