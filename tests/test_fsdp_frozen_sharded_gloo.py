"""fsdp.shard(stage=3, shard_frozen=True): frozen parameters (a LoRA base) sharded like trained ones,
on gloo ranks vs single-process training (fp64). Their units are gathered with their module and
freed during backward once every op that reads them has run: the inputs' gradients are complete
and the module's trained units are done (frozen_units.py). The model puts a frozen op where only
a trained parameter's gradient needs it, a frozen block called twice per forward, one without a
gradient-taking input and one under activation checkpointing. Also checkpoints, mixed precision,
fp8 and the refusals; the release on every order backward can take: test_fsdp_frozen_backward_gloo.py."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_IN, _batches, _loss

SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731


class LoRA(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(D_IN, D_IN).requires_grad_(False)  # the frozen pretrained weight
        self.lora_a, self.lora_b = nn.Linear(D_IN, 2, bias=False), nn.Linear(2, D_IN, bias=False)

    def forward(self, x):
        return torch.tanh(self.base(x) + self.lora_b(self.lora_a(x)))


class ShiftThroughFrozen(nn.Module):
    """The frozen op lies on the way to the trained ``shift`` only, not to the input (torch's engine
    runs it before the input's gradient is complete, by creation order; the rule does not count on
    that: test_the_release_rule)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D_IN, D_IN).requires_grad_(False)
        self.shift = nn.Parameter(torch.randn(D_IN))

    def forward(self, x):
        return x + self.proj(self.shift)


class Frozen(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, D_IN).requires_grad_(False)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = LoRA()        # its input (the batch) takes no gradient
        self.shift = ShiftThroughFrozen()
        self.frozen = Frozen()     # no trained parameter; called twice
        self.ckpt = LoRA()         # under activation checkpointing
        self.head = nn.Linear(D_IN, 3)

    def forward(self, x):
        h = self.first(x)
        h = self.frozen(self.shift(h))
        h = torch.utils.checkpoint.checkpoint(self.ckpt, h, use_reentrant=False)
        return self.head(self.frozen(h))


def _frozen(model):
    return {n: p for n, p in model.named_parameters() if not p.requires_grad}


def _train_on_rank(steps=3):
    """-> (parameters after training match the single-process run, frozen ones bitwise; frozen
    parameters are empty between steps; frozen units freed inside each backward, per module;
    what memory_stats counts for them)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    ref = Model().double()
    model = copy.deepcopy(ref)
    sharded = fsdp.shard(model, stage=3, optimizer=SGD, shard_frozen=True)
    ref_opt = SGD([p for p in ref.parameters() if p.requires_grad])
    freed_in_backward = []
    release = sharded._frozen_release.free

    def recording(index):
        if torch._C._current_autograd_node() is not None:
            freed_in_backward.append(index)
        release(index)

    sharded._frozen_release.free = recording
    emptied = []
    for x, y in _batches(steps, 2, world):
        _loss(sharded(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        sharded.step()
        emptied.append(all(p.numel() == 0 for p in _frozen(model).values()))
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step()
    full, want = sharded.full_state_dict(), ref.state_dict()
    close = all(torch.allclose(full[n], w, rtol=0, atol=1e-12) for n, w in want.items())
    frozen_exact = all(torch.equal(full[n], want[n]) for n in _frozen(ref))
    # (not "first": its input takes no gradient, so its frozen units wait for the end of backward)
    units = {u.name: u.module_index for u in sharded.frozen_units if u.name != "first#frozen"}
    frozen_bytes = sum(u.shard_numel * 8 for u in sharded.frozen_units)
    return (close, frozen_exact, emptied, sorted(set(freed_in_backward)) == sorted(units.values()), sorted(units),
            sharded.memory_stats()["param_bytes"] >= frozen_bytes)


def test_frozen_parameters_sharded_train_like_one_process(rank_pool):
    """Was: frozen parameters stayed whole on every rank at stage 3 (a LoRA base is most of the
    model); now sharded, gathered per module and freed inside backward - the frozen block called
    twice, the frozen op only a trained parameter's gradient reads and the checkpointed block
    included - with the same training as one process and the bases untouched."""
    for got in rank_pool(2).run(_train_on_rank):
        assert got == (True, True, [True] * 3, True, ["ckpt#frozen", "frozen#frozen", "shift#frozen"], True), got


def _mixed_precision_on_rank(shard_frozen):
    """fp32 bases, bf16 compute: shard_frozen gathers them as bf16 (what FrozenComputeCopies casts
    them to otherwise): the same outputs and trained weights either way, bitwise."""
    torch.manual_seed(0)
    sharded = fsdp.shard(Model(), stage=3, optimizer=SGD, param_dtype=torch.bfloat16, shard_frozen=shard_frozen)
    outs = []
    for x, y in _batches(2, 2, dist.get_world_size(), dtype=torch.float32):
        out = sharded(x)
        _loss(out.float(), y).backward()
        sharded.step()
        outs.append(out.detach())
    return outs, sharded.full_state_dict()


def test_sharded_frozen_parameters_compute_in_param_dtype_as_the_copies_did(rank_pool):
    for (outs, full), (want_outs, want_full) in zip(rank_pool(2).run(_mixed_precision_on_rank, True),
                                                    rank_pool(2).run(_mixed_precision_on_rank, False)):
        assert all(torch.equal(a, b) for a, b in zip(outs, want_outs))
        assert full.keys() == want_full.keys() and all(torch.equal(full[k], want_full[k]) for k in full)
        assert full["first.base.weight"].dtype == torch.float32


def _checkpoint_on_rank(path):
    """A checkpoint holds the frozen shards as it holds the masters: a model whose bases were
    initialised otherwise loads them back; state_dict() and load_state_dict() of them are refused."""
    torch.manual_seed(0)
    sharded = fsdp.shard(Model().double(), stage=3, optimizer=SGD, shard_frozen=True)
    x, y = _batches(1, 2, dist.get_world_size())[0]
    _loss(sharded(x), y).backward()
    sharded.step()
    fsdp.save(sharded, path)
    want = sharded.full_state_dict()
    torch.manual_seed(1)
    other = fsdp.shard(Model().double(), stage=3, optimizer=SGD, shard_frozen=True)
    differed = not torch.equal(other.full_state_dict()["first.base.weight"], want["first.base.weight"])
    fsdp.load(other, path)
    got = other.full_state_dict()
    refused = []
    for attempt in (lambda: other.module.first.state_dict(),
                    lambda: other.module.load_state_dict({"frozen.fc.weight": want["frozen.fc.weight"]}, strict=False)):
        try:
            attempt()
            refused.append(False)
        except RuntimeError as exc:
            refused.append("shard_frozen keeps only shards" in str(exc) or "freed between forward passes" in str(exc))
    whole = fsdp.shard(Model().double(), stage=3, optimizer=SGD)  # frozen ones whole: other units
    try:
        fsdp.load(whole, path)
        mismatch = "loaded"
    except ValueError as exc:
        mismatch = str(exc)
    return differed, all(torch.equal(got[k], want[k]) for k in want), refused, mismatch


def test_a_checkpoint_holds_the_sharded_frozen_parameters(rank_pool, tmp_path):
    for differed, same, refused, mismatch in rank_pool(2).run(_checkpoint_on_rank, str(tmp_path / "ckpt")):
        assert (differed, same, refused) == (True, True, [True, True])
        assert "holds units [['first', " in mismatch and "['first#frozen', 42]" in mismatch, mismatch
        assert mismatch.endswith("one was sharded with shard_frozen=True and the other without: shard the same way "
                                 "to load"), mismatch


@pytest.mark.usefixtures("world_of_one")
def test_a_sharded_frozen_parameter_unfrozen_later_is_refused_at_step():
    """It would take gradients that no master or optimizer state receives: trained silently not."""
    sharded = fsdp.shard(Model().double(), stage=3, optimizer=SGD, shard_frozen=True)
    sharded.module.frozen.fc.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"^fsdp step: parameters sharded as frozen \(shard_frozen\) in "
                                           r"\['frozen#frozen'\] take gradients now"):
        sharded.step()


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(stage=2, shard_frozen=True), ValueError, r"^shard_frozen=True with stage=2: only stage 3 shards parameters"),
    (dict(stage=3, shard_frozen=1), TypeError, r"^shard_frozen=1: expected a bool$"),
])
def test_bad_shard_frozen_is_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        fsdp.shard(Model(), **kwargs)


def _save_on_rank(path):
    torch.manual_seed(0)
    sharded = fsdp.shard(Model().double(), stage=3, optimizer=SGD, shard_frozen=True)
    fsdp.save(sharded, path)
    return sharded.full_state_dict()


def _load_on_rank(path):
    torch.manual_seed(1)
    sharded = fsdp.shard(Model().double(), stage=3, optimizer=SGD, shard_frozen=True)
    fsdp.load(sharded, path)
    return sharded.full_state_dict()


def test_sharded_frozen_parameters_reload_at_another_data_parallel_size(rank_pool, tmp_path):
    """Saved over 2 ranks (each frozen unit's shard a DTensor piece, like a master), loaded on 3."""
    path = str(tmp_path / "ckpt")
    want = rank_pool(2).run(_save_on_rank, path)[0]
    for got in rank_pool(3).run(_load_on_rank, path):
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


class Codebook(nn.Module):
    """An EMA codebook kept as a frozen Parameter, updated in place by its forward (VQ-VAE)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, D_IN)
        self.codes = nn.Parameter(torch.zeros(4, D_IN), requires_grad=False)

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.codes.mul_(0.9).add_(0.1 * x.detach().mean(0))
        return self.fc(x) + self.codes.mean(0)


@pytest.mark.usefixtures("world_of_one")
def test_a_forward_writing_a_sharded_frozen_parameter_is_refused():
    """Its only copy is the shard: the write went into the gathered buffer and was lost at the free,
    silently. Now the free raises naming the unit."""
    sharded = fsdp.shard(nn.Sequential(Codebook()).double(), stage=3, optimizer=SGD, shard_frozen=True)
    with pytest.raises(RuntimeError, match=r"^fsdp unit '0#frozen': a forward wrote its frozen parameters in place"):
        sharded(torch.randn(2, D_IN, dtype=torch.float64))
    sharded.zero_grad()  # and the model is usable again (the unit was freed before the raise)
    sharded.eval()
    assert sharded(torch.randn(2, D_IN, dtype=torch.float64)).shape == (2, D_IN)


class Fp8Base(nn.Module):
    """A frozen fp8 weight (gloo has no float8: the all-gather moves its bytes)."""

    def __init__(self):
        super().__init__()
        self.w8 = nn.Parameter(torch.randn(D_IN, D_IN).to(torch.float8_e4m3fn), requires_grad=False)
        self.lora = nn.Linear(D_IN, D_IN)

    def forward(self, x):
        return x @ self.w8.to(x.dtype) + self.lora(x)


@pytest.mark.usefixtures("world_of_one")
def test_a_frozen_fp8_weight_is_gathered_as_bytes_and_counted_alike():
    """Also: memory_stats counts frozen parameters whole (shard_frozen=False) or as shards alike."""
    x = torch.randn(3, D_IN)
    outs, stats = [], []
    for shard_frozen in (False, True):
        torch.manual_seed(0)
        sharded = fsdp.shard(nn.Sequential(Fp8Base()), stage=3, optimizer=SGD, shard_frozen=shard_frozen)
        outs.append(sharded(x))
        stats.append(sharded.memory_stats()["param_bytes"])
        assert sharded.full_state_dict()["0.w8"].dtype == torch.float8_e4m3fn
    assert torch.equal(outs[0], outs[1]) and stats[0] == stats[1], stats


class Fp8Seen(Fp8Base):
    def forward(self, x):
        self.seen = self.w8.dtype
        return super().forward(x)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("shard_frozen", [False, True])
def test_a_frozen_fp8_weight_is_not_cast_to_param_dtype(shard_frozen):
    """param_dtype casts the usual floating dtypes only: the forward reads the fp8 weight as it is,
    gathered (shard_frozen) or whole, as the bf16 model around it computes."""
    torch.manual_seed(0)
    sharded = fsdp.shard(nn.Sequential(Fp8Seen()), stage=3, optimizer=SGD, shard_frozen=shard_frozen,
                         param_dtype=torch.bfloat16)
    out = sharded(torch.randn(3, D_IN))
    assert out.dtype == torch.bfloat16 and sharded.module[0].seen == torch.float8_e4m3fn


@pytest.mark.usefixtures("world_of_one")
def test_zero_grad_frees_frozen_units_kept_gathered():
    """As the trained units (test_fsdp_gloo.py's): no_sync(reshard_after_backward=False) keeps the
    frozen units gathered too, and zero_grad() returns them to their shards."""
    torch.manual_seed(0)
    sharded = fsdp.shard(Model().double(), stage=3, optimizer=SGD, shard_frozen=True)
    (x, y), = _batches(1, 2, 1)
    with sharded.no_sync(reshard_after_backward=False):
        _loss(sharded(x), y).backward()
        kept = [u.gathered for u in sharded.frozen_units]
        sharded.zero_grad()
    assert kept and all(kept) and not any(u.gathered for u in sharded.frozen_units), kept
