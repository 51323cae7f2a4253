"""A sharded wrapper's life beyond the happy path: a dropped wrapper frees its buffers, a backward
that raised (before or after posting its reductions) can be skipped with zero_grad or followed by a
step that still matches the dense model. Training itself: test_fsdp_gloo.py."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_HID, D_IN, OPTIMIZERS, _batches, _loss


class _FailingBackward(nn.Module):
    """Identity; while ``armed``, its backward raises: a backward that fails midway, after the unit
    behind it has posted its reduction and half of its own unit has gradients."""

    armed = False

    def forward(self, x):
        if self.armed:
            x = x * 1.0
            x.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("planted")))
        return x


def _three_units():
    """Units "0", "1" (two Linears, the failing point between them) and "2"."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D_IN, D_HID),
                         nn.Sequential(nn.Linear(D_HID, D_HID), nn.Tanh(), _FailingBackward(), nn.Linear(D_HID, D_HID)),
                         nn.Linear(D_HID, 3)).double()


def _failed_backward(model, x, y=None):
    model[1][2].armed = True
    out = model(x)
    model[1][2].armed = False
    try:
        (out.sum() if y is None else _loss(out, y)).backward()
    except RuntimeError as exc:
        assert "planted" in str(exc), exc  # only the planted failure, not another one hidden by it
    else:
        raise AssertionError("the planted backward did not raise")


class _WaitSpy:
    def __init__(self, work, waited):
        self.work, self.waited = work, waited

    def wait(self):
        self.waited.append(self)
        return self.work.wait()


def _lifecycle_on_rank(stage):
    """A dropped wrapper is freed (torch keeps post-accumulate hooks alive from C++: a strong
    reference to the wrapper there would leak it, its model and its optimizer state); the
    optimizer's own zero_grad() and a backward that raised midway (a reduction already posted) are
    recovered from with zero_grad(), which lets the posted reduction finish before dropping it."""
    import gc
    import weakref

    def make():
        return fsdp.shard(_three_units(), stage=stage, prefetch=0, optimizer=OPTIMIZERS["sgd"])

    x = torch.randn(4, D_IN, dtype=torch.float64, generator=torch.Generator().manual_seed(dist.get_rank()))
    dropped = make()
    dropped(x).sum().backward()
    dropped.step()
    model_ref = weakref.ref(dropped.module)
    del dropped
    gc.collect()
    assert model_ref() is None, "a dropped fsdp wrapper kept its model alive"

    ref, sharded = make(), make()
    for _ in range(2):
        ref(x).sum().backward()
        ref.step()
    _failed_backward(sharded.module, x)
    waited = []
    for unit in sharded.all_units:
        unit.pending_reduce = [(work if work is None else _WaitSpy(work, waited), out, flat)
                               for work, out, flat in unit.pending_reduce]
    posted = sum(work is not None for unit in sharded.all_units for work, _, _ in unit.pending_reduce)
    sharded.zero_grad()  # skip the failed step
    assert posted == (1 if stage >= 2 else 0) and len(waited) == posted, (posted, len(waited))
    sharded.optimizer.zero_grad()  # the optimizer's own (set_to_none) must not break the next step
    for _ in range(2):
        sharded(x).sum().backward()
        sharded.step()
    for (name, want), got in zip(ref.full_state_dict().items(), sharded.full_state_dict().values()):
        assert torch.equal(got, want), name
    return True


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dropped_wrappers_are_freed_and_failed_steps_can_be_skipped(rank_pool, stage):
    assert rank_pool(2).run(_lifecycle_on_rank, stage) == [True, True]


def _step_after_a_failed_backward_on_rank(stage):
    """No zero_grad() after a backward that raised midway: the next forward re-arms the
    end-of-backward work (the failed one never ran it), the gradients the failure left count as
    torch counts them (they add to the next backward's), and at stages 2-3 every unit is again
    reduced during backward, its full gradients dropped. Returns, per parameter, whether it still
    held a full gradient after that backward."""
    world, rank = dist.get_world_size(), dist.get_rank()
    (x, y), = _batches(1, 2, world)
    mine = slice(rank * 2, (rank + 1) * 2)
    sharded = fsdp.shard(_three_units(), stage=stage, prefetch=1, optimizer=OPTIMIZERS["sgd"])
    dense = _three_units()
    dense_opt = OPTIMIZERS["sgd"](dense.parameters())
    _failed_backward(sharded.module, x[mine], y[mine])
    _failed_backward(dense, x, y)
    _loss(sharded(x[mine]), y[mine]).backward()
    kept = [p.grad is not None for p in sharded.module.parameters()]
    sharded.step()
    _loss(dense(x), y).backward()
    dense_opt.step()
    got = sharded.full_state_dict()
    for name, want in dense.state_dict().items():
        torch.testing.assert_close(got[name], want, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return kept


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_after_a_failed_backward_without_zero_grad(rank_pool, stage):
    for kept in rank_pool(2).run(_step_after_a_failed_backward_on_rank, stage):
        assert kept == [stage == 1] * 8, kept


class _StepThenRaise(torch.optim.SGD):
    """SGD whose step updates every master, then raises (a post-step NaN check, an out-of-memory
    making a later group's state) on the ranks in ``failing``."""

    failing = ()

    def step(self, closure=None):
        super().step(closure)
        if dist.get_rank() in self.failing:
            raise RuntimeError("planted: after the update")


def _optimizer_raising_after_its_update_on_rank(stage, failing):
    """The ranks must agree on the parameters afterwards, and these must be the masters (at stages
    1/2 a master is the parameters' own shard, so a rank that stopped before publishing kept its own
    slice updated and its peers' slices old); a rank whose step went through must not wait for ever."""
    _StepThenRaise.failing = failing
    torch.manual_seed(0)
    model = _three_units()
    sharded = fsdp.shard(model, stage=stage, optimizer=lambda ps: _StepThenRaise(ps, lr=0.5))
    x = torch.randn(4, D_IN, dtype=torch.float64) * (1 + dist.get_rank())
    sharded(x).sum().backward()
    try:
        sharded.step()
        said = "stepped"
    except RuntimeError as exc:
        said = str(exc)
    sharded.zero_grad()
    return (said, *_parameters_alike_and_the_masters(model, sharded))


def _parameters_alike_and_the_masters(model, sharded) -> tuple:
    """(every rank's parameters are equal, they equal the masters)."""
    mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    masters = torch.cat([t.reshape(-1) for t in sharded.full_state_dict().values()])
    return all(torch.equal(t, everyone[0]) for t in everyone), torch.equal(mine, masters)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("failing", [(0, 1), (0,)], ids=["every rank", "one rank"])
def test_an_optimizer_raising_after_its_update_leaves_the_ranks_alike(rank_pool, stage, failing):
    said = ["planted: after the update" if r in failing else "stepped" for r in range(2)]
    assert rank_pool(2).run(_optimizer_raising_after_its_update_on_rank, stage, failing, timeout=60) == \
        [(s, True, True) for s in said]


def _failed_load_on_rank(path, stage):
    """A load that fails on every rank (a rank's checkpoint file gone) after some masters took the
    checkpoint's values: the ranks still compute with one set of parameters, the masters."""
    import os

    torch.manual_seed(0)
    model = _three_units()
    sharded = fsdp.shard(model, stage=stage, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))
    x = torch.randn(4, D_IN, dtype=torch.float64)
    for step in range(2):  # saved after the first step: the checkpoint differs from the parameters
        sharded(x).sum().backward()
        sharded.step()
        if step == 0:
            fsdp.save(sharded, path)
    dist.barrier()
    if dist.get_rank() == 0:
        for name in os.listdir(path):
            if name.startswith("__1_") and name.endswith(".distcp"):
                os.remove(os.path.join(path, name))
    dist.barrier()
    try:
        fsdp.load(sharded, path)
        said = "loaded"
    except RuntimeError:
        said = "raised"
    return (said, *_parameters_alike_and_the_masters(model, sharded))


@pytest.mark.parametrize("stage", [1, 2])
def test_a_failed_load_leaves_the_ranks_alike(rank_pool, tmp_path, stage):
    assert rank_pool(2).run(_failed_load_on_rank, str(tmp_path / "ckpt"), stage, timeout=60) == [("raised", True, True)] * 2
