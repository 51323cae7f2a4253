"""fsdp.save / fsdp.load on gloo ranks: bit-identical resume (a leftover of an interrupted save
included), buffers (per-rank shapes too) and frozen parameters, resharding to other world sizes, per-rank optimizer state,
and one checkpoint for a TP x DP job. Saves that fail partway: test_fsdp_checkpoint_atomic_gloo.py;
storage and metadata that misbehave: test_fsdp_checkpoint_storage_gloo.py."""
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import overlapkernels as ok
from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_IN, OPTIMIZERS, _batches, _loss, _net, _reference
from test_fsdp_parallel_gloo import H, SPNet


def _checkpoint_on_rank(path, stage, plant=False):
    """``plant``: after the load, one element of rank 0's master shard is one ulp off; returns
    "caught" when the bit-identity check sees it."""
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _batches(4, 4, world)

    def run(sharded, steps):
        for x, y in steps:
            mine = slice(rank * 4, (rank + 1) * 4)
            _loss(sharded(x[mine]), y[mine]).backward()
            sharded.step()

    def decay_lr(sharded):  # as an LR schedule would: the saved lr is not the one make() sets
        for group in sharded.optimizer.param_groups:
            group["lr"] = 5e-3

    make = lambda: fsdp.shard(_net(), stage=stage, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))  # noqa: E731
    straight = make()
    run(straight, batches[:2])
    decay_lr(straight)
    run(straight, batches[2:])
    first = make()
    run(first, batches[:2])
    decay_lr(first)
    fsdp.save(first, path)
    fsdp.save(first, path)  # overwriting a checkpoint goes through the same atomic switch
    resumed = make()
    fsdp.load(resumed, path)
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [5e-3] * len(resumed.optimizer.param_groups)
    if plant and rank == 0:
        with torch.no_grad():
            master = resumed.all_units[0].master
            master[0] = torch.nextafter(master[0], master[0] + 1)
    run(resumed, batches[2:])
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    if plant:
        return "caught" if not all(torch.equal(a[k], b[k]) for k in a) else "missed"
    assert all(torch.equal(a[k], b[k]) for k in a), "resume is not bit-identical"
    # an interrupted save (temp dir left behind, old checkpoint moved aside) stays loadable
    if rank == 0:
        os.makedirs(path + ".tmp", exist_ok=True)
        os.replace(path, path + ".old")
    dist.barrier()
    again = make()
    fsdp.load(again, path)
    c = again.full_state_dict()
    d = first.full_state_dict()
    assert all(torch.equal(c[k], d[k]) for k in c)
    # another model shape is refused by name
    other = fsdp.shard(nn.Sequential(nn.Linear(2, 2)).double(), stage=stage)
    try:
        fsdp.load(other, path)
    except ValueError as exc:
        assert "holds units" in str(exc)
    else:
        raise AssertionError("no ValueError")
    return True


@pytest.mark.parametrize("stage", [2, 3])
def test_checkpoint_resume_is_bit_identical_and_atomic(rank_pool, tmp_path, stage):
    assert rank_pool(2).run(_checkpoint_on_rank, str(tmp_path / "ckpt"), stage) == [True, True]


def test_planted_one_ulp_error_after_load_is_caught(rank_pool, tmp_path):
    assert rank_pool(2).run(_checkpoint_on_rank, str(tmp_path / "ckpt"), 2, True) == ["caught", "caught"]


class BufferNet(nn.Module):
    """Persistent buffers of both kinds: BatchNorm statistics (each rank sees its own batch, so they
    differ between ranks) and a call counter (the same on every rank)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(D_IN, 6)
        self.norm = nn.BatchNorm1d(6)
        self.out = nn.Linear(6, 3)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))
        self.register_buffer("cache", torch.ones(2), persistent=False)  # not in state_dict: not saved

    def forward(self, x):
        self.calls += 1
        return self.out(torch.relu(self.norm(self.inp(x))))


def _buffers_on_rank(path, stage):
    world, rank = dist.get_world_size(), dist.get_rank()
    batches = _batches(4, 4, world)

    def make():
        torch.manual_seed(0)
        return fsdp.shard(BufferNet().double(), stage=stage, optimizer=OPTIMIZERS["sgd"])

    def run(sharded, steps):
        for x, y in steps:
            _loss(sharded(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
            sharded.step()

    straight, first = make(), make()
    run(straight, batches)
    run(first, batches[:2])
    fsdp.save(first, path + "/")  # a trailing slash names the same checkpoint
    resumed = make()
    fsdp.load(resumed, path)
    run(resumed, batches[2:])
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    assert "norm.running_mean" in a and "calls" in a and int(b["calls"]) == 4
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"resume is not bit-identical in {differ}"
    return True


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_keeps_buffers(rank_pool, tmp_path, stage):
    assert rank_pool(2).run(_buffers_on_rank, str(tmp_path / "ckpt"), stage) == [True, True]


def _frozen_save_on_rank(path, stage):
    """A frozen first layer (a backbone trained before: values no fresh model has) is saved and
    loaded like a buffer: fsdp leaves it out of every unit, and it came back as the new model's."""
    model = _net()
    model.inp.requires_grad_(False)
    with torch.no_grad():
        model.inp.weight.copy_(torch.arange(model.inp.weight.numel(), dtype=torch.float64).view_as(model.inp.weight))
    sharded = fsdp.shard(model, stage=stage, optimizer=OPTIMIZERS["sgd"])
    fsdp.save(sharded, path)
    return [p.clone() for p in model.inp.parameters()]


def _frozen_load_on_rank(path, stage):
    model = _net()
    model.inp.requires_grad_(False)
    with torch.no_grad():
        model.inp.bias.add_(1)  # fresh values unlike the saved ones, in both tensors
    fsdp.load(fsdp.shard(model, stage=stage, optimizer=OPTIMIZERS["sgd"]), path)
    return [p.clone() for p in model.inp.parameters()]


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_keeps_frozen_parameters(rank_pool, tmp_path, stage):
    """Saved on 2 ranks, loaded on 2 and on 1 (the same on every rank, so saved once and
    reshardable). Before, a resumed job silently kept its fresh frozen weights."""
    path = str(tmp_path / "ckpt")
    saved = rank_pool(2).run(_frozen_save_on_rank, path, stage)
    for loaded in rank_pool(2).run(_frozen_load_on_rank, path, stage) + rank_pool(1).run(_frozen_load_on_rank, path,
                                                                                          stage):
        for got, want in zip(loaded, saved[0]):
            torch.testing.assert_close(got, want, atol=0, rtol=0)


class _HistNet(nn.Module):
    """A per-rank buffer whose shape differs between ranks (each rank's own histogram)."""

    def __init__(self, bins):
        super().__init__()
        self.fc = nn.Linear(D_IN, 2)
        self.register_buffer("hist", torch.full((bins,), float(dist.get_rank())))

    def forward(self, x):
        return self.fc(x)


def _hist_sharded(bins):
    torch.manual_seed(0)
    return fsdp.shard(_HistNet(bins).double(), stage=2, optimizer=OPTIMIZERS["sgd"])


def _per_rank_buffer_shapes_on_rank(path):
    """Saved and loaded at each rank's own shape; a model whose buffer changed on rank 1 alone, or
    whose buffers are others than the checkpoint's, is refused on every rank (rank 0 must not go on
    into dcp.load and wait there for rank 1)."""
    rank = dist.get_rank()
    fsdp.save(_hist_sharded(rank + 1), path)
    same = _hist_sharded(rank + 1)
    same.module.hist.zero_()
    fsdp.load(same, path)
    assert same.module.hist.tolist() == [float(rank)] * (rank + 1)
    more = _hist_sharded(rank + 1)
    more.module.register_buffer("extra", torch.zeros(1))
    said = []
    for sharded in (_hist_sharded(5 if rank == 1 else rank + 1), more):
        try:
            fsdp.load(sharded, path)
        except ValueError as exc:
            said.append(str(exc))
    return said


def _per_rank_buffers_on_one_rank(path):
    try:
        fsdp.load(_hist_sharded(1), path)
    except ValueError as exc:
        return str(exc)
    return "loaded"


def test_per_rank_buffer_shapes_reload_and_a_mismatch_on_one_rank_fails_on_all(rank_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    want = [f"checkpoint {path!r}: buffer hist was saved as float64 [2]; this model's is float64 [5]",
            f"checkpoint {path!r} holds buffers and frozen parameters ['hist']; this model has ['extra', 'hist']"]
    assert rank_pool(2).run(_per_rank_buffer_shapes_on_rank, path) == [want, want]
    # buffers that differ between the ranks that saved them cannot be resharded
    assert rank_pool(1).run(_per_rank_buffers_on_one_rank, path) == [
        f"checkpoint {path!r}: buffers ['hist'] differ between the ranks that saved it (e.g. BatchNorm statistics "
        "without SyncBatchNorm), so they reload only on 2 ranks, not 1"]


def _reshard_save_on_rank(path, stage, opt_name):
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = 8 // world
    sharded = fsdp.shard(_net(), stage=stage, optimizer=OPTIMIZERS[opt_name])
    for x, y in _batches(4, per_rank, world)[:2]:
        _loss(sharded(x[rank * per_rank:(rank + 1) * per_rank]), y[rank * per_rank:(rank + 1) * per_rank]).backward()
        sharded.step()
    fsdp.save(sharded, path)
    return True


def _reshard_resume_on_rank(path, stage, opt_name):
    world, rank = dist.get_world_size(), dist.get_rank()
    per_rank = 8 // world
    sharded = fsdp.shard(_net(), stage=stage, optimizer=OPTIMIZERS[opt_name])
    fsdp.load(sharded, path)
    for x, y in _batches(4, per_rank, world)[2:]:  # the same global batches, split over this world
        _loss(sharded(x[rank * per_rank:(rank + 1) * per_rank]), y[rank * per_rank:(rank + 1) * per_rank]).backward()
        sharded.step()
    got, want = sharded.full_state_dict(), _reference(4, per_rank, world, opt_name)
    for name in want:  # parameters and optimizer state came back right, or steps 3-4 would differ
        torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return True


@pytest.mark.parametrize("opt_name", ["adamw", "sgd"])
def test_checkpoint_reshards_to_other_world_sizes(rank_pool, tmp_path, opt_name):
    """Saved on 2 ranks, resumed on 4 (where the 1-element root unit leaves 3 ranks empty shards)
    and on 1: the run continues exactly as the single-process reference."""
    path = str(tmp_path / "ckpt")
    assert rank_pool(2).run(_reshard_save_on_rank, path, 3, opt_name) == [True] * 2
    assert rank_pool(4).run(_reshard_resume_on_rank, path, 2, opt_name) == [True] * 4
    assert rank_pool(1).run(_reshard_resume_on_rank, path, 3, opt_name) == [True]


def _per_rank_state_on_rank(path, load_only):
    rank = dist.get_rank()
    sharded = fsdp.shard(_net(), stage=2, optimizer=OPTIMIZERS["sgd"])
    first = sharded.all_units[0].master
    if not load_only:
        _loss(sharded(torch.ones(2, D_IN, dtype=torch.float64)), torch.zeros(2, 3, dtype=torch.float64)).backward()
        sharded.step()
        # a statistic per rank and not shaped like the shard (as block-quantised optimizers keep)
        sharded.optimizer.state[first]["absmax"] = torch.full((rank + 1,), float(rank))
        # values that are no tensors (an optimizer counting its steps in an int): kept, not dropped
        sharded.optimizer.state[first]["count"] = 3
        sharded.optimizer.state[first]["history"] = [0.5, None, float("nan")]  # NaN == NaN here: saved once
        sharded.optimizer.state[first]["seen_by"] = [rank, 1.5]  # differs between ranks
        if rank == 1:
            sharded.optimizer.state[first]["only_on_1"] = 7  # absent on rank 0: it stays absent there
        # tensors inside a value: refused on every rank before anything is written (as JSON they would
        # bloat the metadata and come back on the CPU)
        sharded.optimizer.state[first]["stack"] = [torch.zeros(2)] if rank == 0 else []
        with pytest.raises(TypeError, match=r"^fsdp.save: optimizer state '0/stack' is a list with tensors inside"):
            fsdp.save(sharded, path)
        assert not os.path.exists(path) and not os.path.exists(path + ".tmp")
        del sharded.optimizer.state[first]["stack"]
        fsdp.save(sharded, path)
        with open(os.path.join(path, fsdp.checkpoint.META)) as f:
            assert json.load(f)["format"] == 3  # older versions refuse it by format, not by a KeyError
    fresh = fsdp.shard(_net(), stage=2, optimizer=OPTIMIZERS["sgd"])
    try:
        fsdp.load(fresh, path)
    except ValueError as exc:
        return str(exc)
    got = fresh.optimizer.state[fresh.all_units[0].master]
    assert torch.equal(got["absmax"], torch.full((rank + 1,), float(rank))), got["absmax"]
    assert torch.equal(got["momentum_buffer"], sharded.optimizer.state[first]["momentum_buffer"]) or load_only
    assert type(got["count"]) is int and got["count"] == 3, got["count"]
    history = got["history"]
    assert history[:2] == [0.5, None] and math.isnan(history[2]), history
    assert got["seen_by"] == [rank, 1.5], got["seen_by"]
    assert ("only_on_1" in got) == (rank == 1) and got.get("only_on_1", 7) == 7, got
    return "ok"


def test_per_rank_optimizer_state_stays_per_rank(rank_pool, tmp_path):
    """State that differs between ranks and is not shaped like the shard cannot be resharded: it
    comes back rank by rank at the same world size (not one rank's copy for all, as a single key
    would give), and another world size is refused naming the state. Values that are no tensors
    come back too (they were dropped: a resumed optimizer restarted its own step count)."""
    path = str(tmp_path / "ckpt")
    assert rank_pool(2).run(_per_rank_state_on_rank, path, False) == ["ok", "ok"]
    refused = rank_pool(4).run(_per_rank_state_on_rank, path, True)
    assert all("optimizer state ['0/absmax', '0/only_on_1', '0/seen_by'] differs between ranks" in r
               and "only on 2 ranks, not 4" in r
               for r in refused), refused


def _tp_dp_checkpoint_on_rank(path, save):
    """One checkpoint for the job: every rank passes the same path under TP=2 x DP."""
    dims = ok.init_parallel(tp=2)
    sgd = OPTIMIZERS["sgd"]
    g = torch.Generator().manual_seed(6)
    batches = [torch.randn(4, 4, H, generator=g, dtype=torch.float64) for _ in range(4)]

    def make():
        torch.manual_seed(0)
        return fsdp.shard(SPNet(dims.tp_group, True), dims.dp_group, stage=3, optimizer=sgd)

    def train(sharded, steps):
        per = 4 // dims.dp_size
        for x in steps:
            rows = x.chunk(2, 0)[dims.tp_rank][:, dims.dp_rank * per:(dims.dp_rank + 1) * per]
            (sharded(rows).pow(2).sum() * dims.dp_size / x.numel()).backward()
            sharded.step()

    if save:  # on 4 ranks: save after 2 steps, and check that a load gives back exactly that state
        first = make()
        train(first, batches[:2])
        # a value only the tp-rank-1 dp group cannot keep: the whole world refuses (the other dp group
        # must not go on into the world-wide metadata exchange and wait there)
        state = first.optimizer.state[first.all_units[0].master]
        state["note"] = {1j} if dims.tp_rank == 1 else 0
        with pytest.raises(TypeError, match=r"^fsdp.save: optimizer state '0/note' is a set the checkpoint cannot"):
            fsdp.save(first, path)
        del state["note"]
        fsdp.save(first, path)
        saved = first.full_state_dict()
        train(first, batches[2:])
        fsdp.load(first, path)
        assert all(torch.equal(saved[k], v) for k, v in first.full_state_dict().items() if torch.is_tensor(v))
    straight = make()
    train(straight, batches)
    resumed = make()
    fsdp.load(resumed, path)  # on 2 ranks (DP=1): the same parts, resharded over DP
    train(resumed, batches[2:])
    a, b = straight.full_state_dict(), resumed.full_state_dict()
    for k in a:
        if torch.is_tensor(a[k]):
            torch.testing.assert_close(b[k], a[k], atol=1e-12, rtol=1e-12, msg=lambda m, n=k: f"{n}: {m}")
    return True


def _tp1_load_on_rank(path):
    try:
        fsdp.load(fsdp.shard(SPNet(ok.init_parallel().tp_group, False), stage=2), path)
    except ValueError as exc:
        return str(exc)


def test_checkpoint_under_tp2_by_dp2(rank_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    assert rank_pool(4).run(_tp_dp_checkpoint_on_rank, path, True) == [True] * 4
    assert rank_pool(2).run(_tp_dp_checkpoint_on_rank, path, False) == [True] * 2
    for message in rank_pool(2).run(_tp1_load_on_rank, path):  # TP=1: another model split, refused
        assert "holds 2 model parts (one per tp/pp/cp coordinate and chunk); this job has 1" in message, message


def _same_numels_other_shapes_on_rank(path):
    """Units of as many elements in other shapes (a transposed Linear): the numel check passed and
    the weights loaded reshaped, silently. Each parameter's name and shape are now compared."""
    saved = fsdp.shard(nn.Sequential(nn.Linear(2, 3, bias=False), nn.Linear(3, 4)).double(), stage=2)
    fsdp.save(saved, path)
    other = fsdp.shard(nn.Sequential(nn.Linear(3, 2, bias=False), nn.Linear(3, 4)).double(), stage=2)
    try:
        fsdp.load(other, path)
    except ValueError as exc:
        return str(exc).split(": ", 1)[1]
    return "loaded"


def test_a_checkpoint_of_other_parameter_shapes_is_refused_by_name(rank_pool, tmp_path):
    want = ("unit '0' holds parameters [['0.weight', [3, 2]]] ([name, shape]); this model has "
            "[['0.weight', [2, 3]]]")
    assert rank_pool(2).run(_same_numels_other_shapes_on_rank, str(tmp_path / "ckpt")) == [want, want]


class _Wrapped(nn.Module):
    """Renames its child's parameters (as activation checkpointing's wrapper does), same layout."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _renamed_by_a_wrapper_on_rank(path):
    saved = fsdp.shard(nn.Sequential(nn.Linear(2, 3)).double(), stage=2)
    fsdp.save(saved, path)
    wrapped = fsdp.shard(nn.Sequential(_Wrapped(nn.Linear(2, 3))).double(), stage=2)
    fsdp.load(wrapped, path)
    return torch.equal(wrapped.full_state_dict()["0.inner.weight"], saved.full_state_dict()["0.weight"])


def test_a_checkpoint_loads_into_the_same_layout_under_other_names(rank_pool, tmp_path):
    """Names only help the refusal's message: the shapes decide (a wrapper renames parameters)."""
    assert rank_pool(2).run(_renamed_by_a_wrapper_on_rank, str(tmp_path / "ckpt")) == [True, True]
