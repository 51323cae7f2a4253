"""fsdp.shard (ZeRO 1/2/3) on gloo ranks vs single-process training on the concatenated batch.
Composed with TP, SP and CP, and gradient clipping: test_fsdp_parallel_gloo.py; mixed precision:
test_fsdp_precision_gloo.py."""
import contextlib

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkernels as ok
from overlapkernels.runtime import fsdp

D_IN, D_HID = 6, 10


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x):
        return x + torch.tanh(self.norm(self.fc(x)))


class Net(nn.Module):
    """Units by default: inp, blocks (one unit holding 3 blocks), out; plus a root parameter."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, D_HID)
        self.blocks = nn.Sequential(*[Block(D_HID) for _ in range(3)])
        self.out = nn.Linear(D_HID, 3)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.out(self.blocks(self.inp(x))) * self.scale


def _net(dtype=torch.float64):
    torch.manual_seed(0)
    return Net().to(dtype)


def _batches(steps, per_rank, world, dtype=torch.float64):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(per_rank * world, D_IN, generator=g, dtype=dtype),
             torch.randn(per_rank * world, 3, generator=g, dtype=dtype)) for _ in range(steps)]


def _loss(out, y):
    return ((out - y) ** 2).mean()


# AdamW is blind to the scale of the gradient (m / sqrt(v)): a missing 1/N average would pass an
# AdamW-only parity test. SGD with momentum is not, so every parity test runs both.
OPTIMIZERS = {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
              "sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)}


def _reference(steps, per_rank, world, opt_name="adamw"):
    model = _net()
    opt = OPTIMIZERS[opt_name](model.parameters())
    for x, y in _batches(steps, per_rank, world):
        opt.zero_grad()
        _loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


def _train_on_rank(stage, prefetch, units, steps=3, per_rank=4, opt_name="adamw"):
    world, rank = dist.get_world_size(), dist.get_rank()
    sharded = fsdp.shard(_net(), stage=stage, prefetch=prefetch, units=units, optimizer=OPTIMIZERS[opt_name])
    for x, y in _batches(steps, per_rank, world):
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        _loss(sharded(x[mine]), y[mine]).backward()
        sharded.step()
    got = sharded.full_state_dict()
    want = _reference(steps, per_rank, world, opt_name)
    assert list(got) == list(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    in_flat = [u.master.untyped_storage().data_ptr() == u.flat.untyped_storage().data_ptr() for u in sharded.all_units]
    return sharded.memory_stats(), [(u.numel, u is sharded.root) for u in sharded.all_units], in_flat


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_training_equals_single_process(rank_pool, world, stage):
    for prefetch in (0, 1, 2):
        rank_pool(world).run(_train_on_rank, stage, prefetch, None)
    rank_pool(world).run(_train_on_rank, stage, 1, (Block,))  # per-block units by class
    rank_pool(world).run(_train_on_rank, stage, 1, None, opt_name="sgd")


def test_memory_follows_zero_accounting(rank_pool):
    """Exact bytes from each unit's size (fp64, 4 ranks, AdamW): a unit of n elements is padded to
    4 * ceil(n / 4) and each rank keeps a quarter of it as its fp64 master shard: at stage 3 apart
    from the freed buffers, at stages 1/2 inside the full buffers (ZeRO's Psi, not Psi (1 + 1/4))."""
    for stage in (1, 2, 3):
        stats, units, master_in_flat = rank_pool(4).run(_train_on_rank, stage, 1, (Block,))[0]
        padded = [-(-n // 4) * 4 * 8 for n, _ in units]  # bytes of each unit's full buffer
        master = sum(padded) // 4
        full_params = sum(b for b, (_, root) in zip(padded, units) if stage < 3 or root)
        assert master_in_flat == [stage < 3] * len(units)  # the shard's own memory, not a copy
        assert stats["param_bytes"] == (master if stage == 3 else 0) + full_params, (stage, stats)
        assert stats["grad_bytes"] == (sum(padded) if stage == 1 else master), (stage, stats)
        assert stats["optim_bytes"] == 2 * master, (stage, stats)  # AdamW: exp_avg + exp_avg_sq
        assert len(units) > 2 and sum(root for _, root in units) == 1  # per-block units and a root


def _no_sync_on_rank(stage, no_sync=True):
    """``no_sync=False``: the first micro-batch is reduced too, and must still add to the second."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sharded = fsdp.shard(_net(), stage=stage, optimizer=OPTIMIZERS["sgd"])
    (x, y), = _batches(1, 4, world)
    mine = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    sharded.comm_stats(reset=True)
    with sharded.no_sync() if no_sync else contextlib.nullcontext():  # two micro-batches: halves of this rank's part
        _loss(sharded(mine[0][:2]), mine[1][:2]).mul(0.5).backward()
    # no_sync means no reduction (reduce-scattering every micro-step gives the same sum, so only
    # the byte count tells): at every stage
    assert (sharded.comm_stats()["reduced_bytes"] == 0) == (no_sync or stage == 1)
    _loss(sharded(mine[0][2:]), mine[1][2:]).mul(0.5).backward()
    sharded.step()
    assert sharded.comm_stats()["reduced_bytes"] > 0  # in that backward (stages 2-3) or the step (stage 1)
    want = _reference(1, 4, world, "sgd")
    for name, t in sharded.full_state_dict().items():
        torch.testing.assert_close(t, want[name], atol=1e-12, rtol=1e-12)
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_no_sync_accumulation(rank_pool, stage):
    assert rank_pool(2).run(_no_sync_on_rank, stage) == [True, True]
    assert rank_pool(2).run(_no_sync_on_rank, stage, False) == [True, True]  # accumulation without no_sync


def _explicit_reduction_on_rank(stage):
    """``reduce_grads()`` reduces what ``no_sync`` held, at once and only once (the step, or the
    next synced backward, has nothing of it left); refused inside a backward. A nested ``no_sync``
    gives the outer one's state back."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sharded = fsdp.shard(_net(), stage=stage, optimizer=OPTIMIZERS["sgd"])
    (x, y), = _batches(1, 4, world)
    x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    out = sharded(x[:2])
    out.register_hook(lambda grad: sharded.reduce_grads())
    with pytest.raises(RuntimeError, match=r"reduce_grads\(\) inside a backward"):
        out.sum().backward()
    sharded.zero_grad()
    states = [sharded.requires_gradient_sync]
    with sharded.no_sync(reshard_after_backward=False):
        with sharded.no_sync():
            states.append((sharded.requires_gradient_sync, sharded._keep_gathered))
        states.append((sharded.requires_gradient_sync, sharded._keep_gathered))
        _loss(sharded(x[:2]), y[:2]).mul(0.5).backward()
    states.append(sharded.requires_gradient_sync)
    sharded.comm_stats(reset=True)
    sharded.reduce_grads()
    reduced = sharded.comm_stats()["reduced_bytes"]
    left = [p.grad is not None for p in sharded.module.parameters()]
    _loss(sharded(x[2:]), y[2:]).mul(0.5).backward()
    sharded.step()
    psi = sum(u.flat_bytes for u in sharded.all_units)
    want = _reference(1, 4, world, "sgd")
    for name, t in sharded.full_state_dict().items():
        torch.testing.assert_close(t, want[name], atol=1e-12, rtol=1e-12)
    return states, reduced == psi, sharded.comm_stats()["reduced_bytes"] == 2 * psi, any(left)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_reduce_grads_reduces_what_no_sync_held(rank_pool, stage):
    for states, once, twice, left in rank_pool(2).run(_explicit_reduction_on_rank, stage):
        assert states == [True, (False, False), (False, True), True] and once and twice and not left


def _accumulation_traffic_on_rank(reshard_after_backward, micro_steps=4):
    """Stage 3, ``micro_steps`` micro-batches (all but the last under no_sync): the bytes gathered
    and reduced per step, the peak of gathered parameters, and the result vs single-process SGD."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sharded = fsdp.shard(_net(), stage=3, prefetch=1, optimizer=OPTIMIZERS["sgd"])
    with pytest.raises(TypeError, match="reshard_after_backward=0: expected a bool"):
        with sharded.no_sync(reshard_after_backward=0):
            pass
    per_rank = 2 * micro_steps
    (x0, y0), (x, y) = _batches(2, per_rank, world)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    _loss(sharded(x0[mine]), y0[mine]).backward()  # a first step: shard() leaves the root gathered
    sharded.step()
    xs, ys = x[mine].chunk(micro_steps), y[mine].chunk(micro_steps)
    sharded.comm_stats(reset=True)
    sharded.peak_gathered_bytes = 0
    with sharded.no_sync(reshard_after_backward=reshard_after_backward):
        for i in range(micro_steps - 1):
            _loss(sharded(xs[i]), ys[i]).div(micro_steps).backward()
    _loss(sharded(xs[-1]), ys[-1]).div(micro_steps).backward()
    traffic = sharded.comm_stats()
    peak = sharded.peak_gathered_bytes
    sharded.step()
    want = _reference(2, per_rank, world, "sgd")
    for name, t in sharded.full_state_dict().items():
        torch.testing.assert_close(t, want[name], atol=1e-12, rtol=1e-12)
    assert all(u.flat.untyped_storage().size() == 0 for u in sharded.all_units)  # step freed them all
    all_bytes = sum(u.flat_bytes for u in sharded.all_units)
    root_bytes = sharded.root.flat_bytes
    return traffic, peak, all_bytes, root_bytes


def test_accumulation_can_keep_stage_3_gathered(rank_pool):
    """DeepSpeed's "too many all-gathers": by default each of k micro-steps gathers every unit for
    its forward and again for its backward (the root, which stays gathered until step, once a step);
    no_sync(reshard_after_backward=False) gathers once for the micro-steps inside and once more for
    the last backward, holding the full parameters meanwhile. Either way one reduce-scatter per step
    and the same result."""
    k = 4
    (traffic, peak, psi, root), _ = rank_pool(2).run(_accumulation_traffic_on_rank, True, k)
    assert traffic == {"gathered_bytes": 2 * k * (psi - root) + root, "reduced_bytes": psi}, (traffic, psi, root)
    assert peak < psi
    (traffic, peak, psi, root), _ = rank_pool(2).run(_accumulation_traffic_on_rank, False, k)
    assert traffic == {"gathered_bytes": 2 * psi - root, "reduced_bytes": psi}, (traffic, psi, root)
    assert peak == psi


def _zero_grad_in_kept_accumulation_on_rank():
    """zero_grad() inside no_sync(reshard_after_backward=False) drops the gradients and returns the
    units to their shards (the root stays: a backward still to come reads it ungathered); a
    zero_grad() between a forward and its backward leaves that backward exact."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sharded = fsdp.shard(_net(), stage=3, prefetch=1, optimizer=OPTIMIZERS["sgd"])
    (x, y), = _batches(1, 4, world)
    x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
    with sharded.no_sync(reshard_after_backward=False):
        _loss(sharded(x), y).backward()
        kept = [u.gathered for u in sharded.all_units]
        sharded.zero_grad()
        after = [u.gathered for u in sharded.all_units]
    out = sharded(x)
    sharded.zero_grad()
    _loss(out, y).backward()
    sharded.step()
    want = _reference(1, 4, world, "sgd")
    for name, t in sharded.full_state_dict().items():
        torch.testing.assert_close(t, want[name], atol=1e-12, rtol=1e-12)
    return kept, after, [u is sharded.root for u in sharded.all_units]


def test_zero_grad_frees_units_kept_gathered(rank_pool):
    kept, after, is_root = rank_pool(2).run(_zero_grad_in_kept_accumulation_on_rank)[0]
    assert all(kept) and after == is_root and sum(is_root) == 1, (kept, after)


def _peak_gathered_on_rank(prefetch):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, dtype=torch.float64) for _ in range(6)])  # six equal units, no root
    sharded = fsdp.shard(model, stage=3, prefetch=prefetch)
    sharded(torch.randn(3, 8, dtype=torch.float64)).sum().backward()
    sharded.step()
    return sharded.memory_stats()["peak_gathered_param_bytes"], sharded.units[0].flat_bytes, len(sharded.all_units)


@pytest.mark.parametrize("prefetch", [0, 1, 2])
def test_stage_3_holds_at_most_prefetch_plus_one_units(rank_pool, prefetch):
    """FSDP2's bound: a unit is freed after its forward and after its backward, so at most the unit
    in use and the ``prefetch`` units gathered ahead of it are ever materialised at once."""
    peak, unit_bytes, units = rank_pool(2).run(_peak_gathered_on_rank, prefetch)[0]
    assert units == 6 and peak == (prefetch + 1) * unit_bytes, (peak, unit_bytes)


def _gpt_default_units_on_rank():
    """GPT keeps its blocks in a ModuleDict, which is never called: its children must be the units.
    Stage 3 without prefetch, 2 SGD steps: each rank's loss, then the parameters after backward and
    step, vs the dense GPT on the concatenated batch."""
    from overlapkernels.models import GPT, GPTConfig

    world, rank = dist.get_world_size(), dist.get_rank()
    config = GPTConfig(vocab_size=16, hidden=8, num_layers=2, num_heads=2, num_kv_heads=2, ffn_hidden=16,
                       max_seq_len=8, method="baseline")
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 16, (2 * world, 8), generator=g) for _ in range(2)]
    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=torch.float64)
    dense_opt = OPTIMIZERS["sgd"](dense.parameters())
    torch.manual_seed(0)
    sharded = fsdp.shard(GPT(config, ok.init_parallel(), dtype=torch.float64), stage=3, prefetch=0,
                         optimizer=OPTIMIZERS["sgd"])
    assert [u.name for u in sharded.units] == ["embed", "blocks.0", "blocks.1", "norm", "lm_head"]
    loss_errors = []
    for tokens in batches:
        mine = tokens[rank * 2:(rank + 1) * 2]
        with torch.no_grad():
            want = float(dense.loss(mine, mine))
        got = sharded.module.loss(mine, mine)
        loss_errors.append(abs(float(got) - want))
        got.backward()
        sharded.step()
        dense_opt.zero_grad()
        dense.loss(tokens, tokens).backward()  # the mean over equal halves: the mean of their means
        dense_opt.step()
    got, want = sharded.full_state_dict(), dense.state_dict()
    assert list(got) == list(want)
    for name in want:
        if torch.is_tensor(want[name]):
            torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return max(loss_errors)


def test_gpt_default_units_stage3_without_prefetch(rank_pool):
    assert all(d < 1e-12 for d in rank_pool(2).run(_gpt_default_units_on_rank))


def _planted_on_rank():
    """Drop DDP's averaging (sum instead of mean over ranks): the parity check must catch it."""
    from overlapkernels.runtime.fsdp import flat_unit

    original = flat_unit.FlatUnit.finish_reduce

    def summed(self):  # finish_reduce without the 1/N of the mean
        for work, out, _ in self.pending_reduce:
            if work is not None:
                work.wait()
            self.master.grad += out.to(self.master_dtype) * self.world
        self.pending_reduce = []

    flat_unit.FlatUnit.finish_reduce = summed
    try:
        _train_on_rank(2, 0, None, opt_name="sgd")
    except AssertionError:
        return "caught"
    finally:
        flat_unit.FlatUnit.finish_reduce = original
    return "missed"


def test_planted_error_is_caught(rank_pool):
    assert rank_pool(2).run(_planted_on_rank) == ["caught", "caught"]


# -- stage 3 between steps: parameters are empty, state_dict refuses -----------------------------
def _stage3_outside_forward_on_rank():
    from overlapkernels.runtime.pipeline.weight_grad import WeightGradStore, deferring, enable_zero_bubble

    sgd = OPTIMIZERS["sgd"]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, 3)).double()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(D_IN, D_HID), nn.Tanh(), nn.Linear(D_HID, 3)).double()
    ref_opt = sgd(ref.parameters())
    sharded = fsdp.shard(enable_zero_bubble(model), stage=3, optimizer=sgd)
    refusals = []
    for what in (model.state_dict, sharded.state_dict, lambda: model.load_state_dict(ref.state_dict())):
        try:
            what()
        except RuntimeError as exc:
            refusals.append(str(exc))
    assert model[0].weight.shape == (0,)  # freed: empty, not a view of freed memory
    rank, world = dist.get_rank(), dist.get_world_size()
    for x, y in _batches(2, 2, world):
        store = WeightGradStore()
        with deferring(store):  # zero-bubble W assigns weight gradients after backward
            _loss(sharded(x[rank * 2:(rank + 1) * 2]), y[rank * 2:(rank + 1) * 2]).backward()
        store.run()
        sharded.step()
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step()
        assert model[2].weight.shape == (0,)
    with torch.no_grad():
        sharded(torch.ones(1, D_IN, dtype=torch.float64))
    assert model[0].weight.shape == (0,)
    got = sharded.full_state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return refusals


def test_stage3_parameters_outside_forward(rank_pool):
    for refusals in rank_pool(2).run(_stage3_outside_forward_on_rank):
        assert len(refusals) == 3, refusals
        assert "state_dict() of Linear (fsdp unit '0'): its parameters are sharded (stage 3)" in refusals[0]
        assert all("sharded.full_state_dict()" in r for r in refusals[:2])
        assert refusals[2].startswith("load_state_dict() into Sequential after fsdp.shard, of the trained parameters "
                                      "0.bias, 0.weight, 2.bias ...") and "use fsdp.load" in refusals[2], refusals[2]


def _state_dict_snapshot_on_rank(stage):
    """full_state_dict() is a snapshot, as torch's state_dict() after a copy would be for a
    checkpoint: a later in-place update of the model (a BatchNorm statistic, a step) must not reach it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6)).double()
    sharded = fsdp.shard(model, stage=stage, optimizer=OPTIMIZERS["sgd"])
    snapshot = sharded.full_state_dict()
    kept = {k: v.clone() for k, v in snapshot.items()}
    with torch.no_grad():
        sharded.module[1].running_mean.add_(7.0)
        sharded.module[1].num_batches_tracked.add_(1)
    sharded(torch.randn(3, 4, dtype=torch.float64)).sum().backward()
    sharded.step()
    return [k for k in kept if not torch.equal(snapshot[k], kept[k])]


@pytest.mark.parametrize("stage", [1, 3])
def test_full_state_dict_is_a_snapshot(rank_pool, stage):
    assert rank_pool(2).run(_state_dict_snapshot_on_rank, stage) == [[], []]


def _shapes_through_a_step_on_rank():
    sharded = fsdp.shard(_net(), stage=3, optimizer=OPTIMIZERS["sgd"])
    (x, y), = _batches(1, 4, 1)
    params = [p for u in sharded.units for p in u.params]
    full = [s for u in sharded.units for s in u.shapes]
    with torch.no_grad():
        sharded(x)
    seen = [[p.shape for p in params]]
    loss = _loss(sharded(x), y)
    seen.append([p.shape for p in params])  # between the forward and its backward
    loss.backward()
    seen.append([p.shape for p in params])
    sharded.step()
    seen.append([p.shape for p in params])
    empty = [torch.Size([0])] * len(params)
    return seen == [empty, full, full, empty] and all(p.untyped_storage().nbytes() == 0 for p in params)


def test_stage_3_parameters_keep_their_shapes_from_a_training_forward_to_step(rank_pool):
    """The module docstring's contract (flat_unit.py): freed units' parameters are size 0 outside a
    step, and keep their shapes over the empty storage from a forward with autograd to ``step`` - a
    deferred weight gradient (zero-bubble W) assigns ``.grad``, which torch allows only at the
    parameter's shape, after a later microbatch's forward freed the unit."""
    assert rank_pool(1).run(_shapes_through_a_step_on_rank) == [True]
