"""fsdp.GradScaler vs torch.amp.GradScaler on the dense model: the same scales, the same skipped
step, the same parameters; an overflow that lands in one rank's shard skips the step on every rank."""
import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_IN, Net, _loss

SCALER = dict(init_scale=2.0 ** 10, growth_factor=2.0, backoff_factor=0.5, growth_interval=2)
STEPS, PER_RANK, POISONED_STEP, CLIPPED_STEP, MAX_NORM = 5, 4, 1, 3, 0.05


class PoisonableNet(Net):
    """``poison`` * the root's ``scale`` parameter, kept as ``extra`` for the loss: set to inf on one
    rank, only that element's gradient overflows, so after the reduction only the rank owning it
    sees the inf. (The root unit's, as it stays gathered through the forward at stage 3.)"""

    poison = 0.0

    def forward(self, x):
        self.extra = self.poison * self.scale
        return super().forward(x)


def _model():
    torch.manual_seed(0)
    return PoisonableNet().double()


def _batches(world):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(PER_RANK * world, D_IN, generator=g, dtype=torch.float64),
             torch.randn(PER_RANK * world, 3, generator=g, dtype=torch.float64)) for _ in range(STEPS)]


def _sgd(params):  # (AdamW would be blind to a gradient left scaled: m / sqrt(v))
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _dense(world):
    """torch's scaler on the whole batch; rank 0's poison enters the mean loss as it does the
    averaged gradients."""
    model = _model()
    opt, scaler = _sgd(model.parameters()), torch.amp.GradScaler("cpu", **SCALER)
    scales = []
    for step, (x, y) in enumerate(_batches(world)):
        model.poison = float("inf") if step == POISONED_STEP else 0.0
        opt.zero_grad()
        scaler.scale(_loss(model(x), y) + model.extra / world).backward()
        if step == CLIPPED_STEP:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model.state_dict(), scales, scaler.state_dict()


def _train_on_rank(stage, with_dims=False):
    """``with_dims``: the ParallelDims form (the overflow agreed over the world, as with TP/PP/CP)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dims = ok.init_parallel() if with_dims else None
    sharded = fsdp.shard(_model(), dims.dp_group if dims else None, stage=stage, optimizer=_sgd)
    scaler = fsdp.GradScaler(**SCALER)
    scales, stepped = [], []
    for step, (x, y) in enumerate(_batches(world)):
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        sharded.module.poison = float("inf") if step == POISONED_STEP and rank == 0 else 0.0
        out = sharded(x[mine])
        scaler.scale(_loss(out, y[mine]) + sharded.module.extra).backward()
        if step == CLIPPED_STEP:
            scaler.unscale_(sharded, dims=dims)
            assert sharded.clip_grad_norm_(MAX_NORM, dims=dims) > MAX_NORM  # the clip bites, on true gradients
        stepped.append(scaler.step(sharded, dims=dims))
        scaler.update()
        scales.append(scaler.get_scale())
    want, want_scales, want_state = _dense(world)
    got = sharded.full_state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert scales == want_scales and stepped == [step != POISONED_STEP for step in range(STEPS)], (scales, stepped)
    assert scaler.state_dict() == want_state  # torch's keys and values: checkpoints interchange
    return scales


@pytest.mark.parametrize("stage, with_dims", [(1, False), (2, False), (3, False), (3, True)])
def test_scaled_training_equals_torch_scaler_on_the_dense_model(rank_pool, stage, with_dims):
    scales = rank_pool(2).run(_train_on_rank, stage, with_dims)
    assert scales[0] == scales[1] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10, 2.0 ** 10]


def _misuse_on_rank():
    said = []
    sharded = fsdp.shard(_model(), stage=2, optimizer=_sgd)
    scaler = fsdp.GradScaler(**SCALER)
    x = torch.randn(2, D_IN, dtype=torch.float64)
    try:
        scaler.update()  # nothing stepped
    except RuntimeError as exc:
        said.append(str(exc))
    other = fsdp.shard(_model(), stage=2, optimizer=_sgd)
    scaler.scale(sharded(x).sum() + other(x).sum()).backward()
    scaler.unscale_(sharded)
    try:  # `other` was not unscaled: it would step from scaled gradients
        scaler.step([sharded, other])
    except RuntimeError as exc:
        said.append(str(exc).split(";")[0])
    for call in (lambda: scaler.unscale_(sharded), lambda: scaler.step(sharded.module)):
        try:
            call()
        except (RuntimeError, TypeError) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    assert scaler.step(sharded) is True
    try:
        scaler.step(sharded)
    except RuntimeError as exc:
        said.append(str(exc))
    scaler.update()
    return said


def test_misuse_is_refused_by_name(rank_pool):
    said = rank_pool(2).run(_misuse_on_rank)
    assert said[0] == said[1] == [
        "update() without a step(): no overflow check was recorded this step",
        "step(): other modules or another dims= than unscale_() was given this step",
        "RuntimeError: unscale_() has already been called since the last update()",
        "TypeError: modules=PoisonableNet: expected a ShardedModule (fsdp.shard) or a non-empty list of them",
        "step() has already been called since the last update()"]


@pytest.mark.parametrize("kwargs, message", [
    (dict(init_scale=0), "init_scale=0: expected a number > 0"),
    (dict(growth_factor=1.0), "growth_factor=1.0: expected a number > 1"),
    (dict(backoff_factor=1.5), r"backoff_factor=1.5: expected a number in \(0, 1\)"),
    (dict(growth_interval=0), "growth_interval=0: expected an integer >= 1"),
    (dict(growth_interval=2.5), "growth_interval=2.5: expected an integer >= 1"),
])
def test_bad_arguments_are_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        fsdp.GradScaler(**kwargs)
    with pytest.raises(TypeError, match="enabled=1: expected a bool"):
        fsdp.GradScaler(enabled=1)


def test_disabled_scaler_passes_through():
    scaler = fsdp.GradScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss and scaler.get_scale() == 1.0 and scaler.state_dict() == {}


def _float16_on_rank(init_scale):
    """float16 compute and reduction, as the scaler is for: torch's default scale is too large for this
    model's float16 gradients, which overflow for real; the scaler backs off until they fit (three
    halvings), every rank alike."""
    world, rank = dist.get_world_size(), dist.get_rank()
    sharded = fsdp.shard(_model(), stage=3, optimizer=_sgd, param_dtype=torch.float16, reduce_dtype=torch.float16)
    scaler = fsdp.GradScaler(init_scale=init_scale, growth_interval=1000)
    before = {k: v.clone() for k, v in sharded.full_state_dict().items()}
    stepped = []
    for x, y in _batches(world) * 2:
        mine = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        scaler.scale(_loss(sharded(x[mine].half()).float(), y[mine].float())).backward()
        stepped.append(scaler.step(sharded))
        scaler.update()
    after = sharded.full_state_dict()
    assert all(torch.isfinite(v).all() for v in after.values() if v.is_floating_point())
    return stepped, scaler.get_scale(), [k for k in before if not torch.equal(before[k], after[k])]


def test_float16_overflow_backs_off_on_every_rank_alike(rank_pool):
    (stepped, scale, changed), other = rank_pool(2).run(_float16_on_rank, 2.0 ** 16)  # torch's default
    assert other[0] == stepped and other[1] == scale  # one decision, one scale, on both ranks
    skipped = stepped.index(True)
    assert skipped > 0 and all(stepped[skipped:]), stepped  # it overflowed at first, then fits
    assert scale == 2.0 ** (16 - skipped) and changed  # backed off once a skip; trained once it fit


def test_state_dict_round_trips_through_torchs_scaler():
    """A torch.amp.GradScaler checkpoint loads into ours and back, growth tracker included, whether
    or not the scale tensor exists yet (it is made at the first scale())."""
    theirs = torch.amp.GradScaler("cpu", **SCALER)
    theirs.load_state_dict({**theirs.state_dict(), "scale": 256.0, "_growth_tracker": 1})
    ours = fsdp.GradScaler()
    ours.load_state_dict(theirs.state_dict())
    assert ours.state_dict() == theirs.state_dict() and ours.get_scale() == 256.0
    assert float(ours.scale(torch.tensor(2.0))) == 512.0 and ours.state_dict() == theirs.state_dict()
