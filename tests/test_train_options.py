"""Trainer's gradient clipping, loss scaling and activation checkpointing in 4-D compositions: the
norm spans every rank's part of the model, an overflow anywhere skips the step everywhere, and
recomputed blocks train as stored ones."""
import dataclasses
import math
import warnings

import numpy as np
import pytest
import torch

import overlapkernels as ok
from overlapkernels.models import GPT, GPTConfig, shard_dense_state_dict
from overlapkernels.layers.tags import PIPELINE_STAGE
from overlapkernels.models.train import Trainer
from overlapkernels.runtime import fsdp
from test_train_4d import CONFIG, _compose_on_rank, _recording_w


@pytest.mark.parametrize("layout, schedule, zero_stage", [
    (dict(tp=2, pp=2), "1f1b", 1), (dict(dp=2, pp=2), "zb-h1", 3), (dict(cp=2, tp=2), "1f1b", 2),
])
def test_clipping_and_loss_scaling_match_single_process(rank_pool, layout, schedule, zero_stage):
    """Clipped by the whole model's norm (torch's clip_grad_norm_ on the dense model): a norm over
    one rank's part, or counting a TP-replicated norm weight twice, would differ. Scaled by 2**10:
    exact in float64, so losses, norms and weights equal the unscaled single process's."""
    results = rank_pool(4).run(_compose_on_rank, layout, schedule, zero_stage=zero_stage, max_grad_norm=0.05,
                               init_scale=2.0 ** 10)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("layout, schedule, zero_stage", [
    (dict(tp=2, pp=2), "1f1b", 1), (dict(dp=2, pp=2), "zb-h1", 3), (dict(cp=2, tp=2), "1f1b", 2),
])
def test_activation_checkpointing_matches_single_process(rank_pool, layout, schedule, zero_stage):
    """Each block's forward recomputed in backward - its SP all-gathers, ring attention over CP,
    ZeRO-3's gathers and ZB-H1's deferred weight gradients with it - gives the same training."""
    results = rank_pool(4).run(_compose_on_rank, layout, schedule, zero_stage=zero_stage, recompute=True)
    assert all(r == results[0] for r in results)


def _overflow_on_one_rank(layout, zero_stage):
    """The first step's gradient gets an inf on one rank only (stage 0, the first DP/TP rank): every
    rank skips it and backs off; the second step (same batch) equals one single-process step."""
    config = GPTConfig(**CONFIG, method="decomposed")
    g = torch.Generator().manual_seed(3)
    tokens, targets = torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g)
    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=torch.float64)
    start = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in dense.state_dict().items()}
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1)  # noqa: E731
    opt = sgd(dense.parameters())
    want_loss = dense.loss(tokens, targets)
    want_loss.backward()
    opt.step()

    dims = ok.init_parallel(**layout)
    scaler = fsdp.GradScaler(init_scale=2.0 ** 10)
    # the schedule halves the lr after each step taken: the skipped step must not count
    halving = lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5 ** step)  # noqa: E731
    trainer = Trainer(config, dims, dtype=torch.float64, dense_state_dict=start, optimizer=sgd, grad_scaler=scaler,
                      max_grad_norm=np.float32(1e3), zero_stage=zero_stage,  # (numpy's floats too)
                      lr_scheduler=halving)
    twin = GPT(config, dims, dtype=torch.float64, pipeline_stage=(dims.pp_rank, dims.pp_size))
    if ok.init_parallel().rank == 0:  # one element of one gradient of one rank
        planted = []
        param = next(trainer.stage.parameters())

        def poison(grad):
            if not planted:
                planted.append(True)
                grad = grad.clone()
                grad.view(-1)[0] = math.inf
            return grad
        param.register_hook(poison)
    seen = []
    for _ in range(2):
        loss = trainer.step(tokens, targets)
        seen.append((loss, trainer.last_step_skipped, scaler.get_scale(), math.isfinite(trainer.last_grad_norm)))
        want = shard_dense_state_dict(twin, start if len(seen) == 1 else dense.state_dict())
        for name, t in trainer.sharded.full_state_dict().items():
            if torch.is_tensor(t):
                torch.testing.assert_close(t, want[name], atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    assert seen[0][0] == pytest.approx(float(want_loss), rel=1e-12)  # the unscaled loss, though skipped
    assert seen[1][0] == seen[0][0]
    assert trainer.lr_scheduler.get_last_lr() == [0.05]  # one step taken
    return [s[1:] for s in seen]


@pytest.mark.parametrize("layout, zero_stage", [(dict(dp=2, pp=2), 3), (dict(tp=2, cp=2), 1)])
def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(rank_pool, layout, zero_stage):
    for seen in rank_pool(4).run(_overflow_on_one_rank, layout, zero_stage):
        # skipped with the scale halved and a non-finite norm; then stepped, the scale kept
        assert seen == [(True, 2.0 ** 9, False), (False, 2.0 ** 9, True)]


class _FailsOnce(torch.optim.SGD):
    """An optimizer whose first step raises (on every rank alike: nothing communicates in it)."""
    failed = False

    def step(self, closure=None):
        if not _FailsOnce.failed:
            _FailsOnce.failed = True
            raise RuntimeError("planted: the optimizer failed")
        return super().step(closure)


def _step_after_a_failed_step_on_rank(zero_stage):
    """A step that raises between unscale_ and update leaves the scaler ready for the next step
    (it said "unscale_() has already been called" at every later step), the scale untouched, and
    no gradient behind: the next step updates the weights as a trainer's first step does (the
    failed step's reduced, unscaled shards were added into it)."""
    _FailsOnce.failed = False
    config, dims = GPTConfig(**CONFIG, method="decomposed"), ok.init_parallel(tp=2, pp=2)
    trainers = []
    for optimizer in (_FailsOnce, torch.optim.SGD):
        torch.manual_seed(0)
        trainers.append(Trainer(config, dims, grad_scaler=fsdp.GradScaler(init_scale=2.0 ** 10), zero_stage=zero_stage,
                                optimizer=lambda ps, opt=optimizer: opt(ps, lr=0.1, momentum=0.9)))
    g = torch.Generator().manual_seed(3)
    tokens, other = torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g)
    said = []
    for batch in (other, tokens):
        try:
            trainers[0].step(batch, batch)
            said.append((trainers[0].last_step_skipped, trainers[0].grad_scaler.get_scale()))
        except RuntimeError as exc:
            said.append(str(exc))
    trainers[1].step(tokens, tokens)
    mine, fresh = trainers[0].sharded.full_state_dict(), trainers[1].sharded.full_state_dict()
    said.append([k for k in mine if torch.is_tensor(mine[k]) and not torch.equal(mine[k], fresh[k])])
    return said


@pytest.mark.parametrize("zero_stage", [1, 3])
def test_a_failed_step_leaves_the_loss_scaler_ready_and_no_gradient(rank_pool, zero_stage):
    assert rank_pool(4).run(_step_after_a_failed_step_on_rank, zero_stage) == [
        ["planted: the optimizer failed", (False, 2.0 ** 10), []]] * 4


def _float16_training():
    """float16 weights with a scale far too large: the logits' gradients overflow float16 until the
    scale has backed off, alike on every rank; then the steps are taken and the loss falls."""
    config = GPTConfig(**CONFIG, method="decomposed")
    dims = ok.init_parallel(tp=2, pp=2)
    scaler = fsdp.GradScaler(init_scale=2.0 ** 21, growth_interval=3)
    trainer = Trainer(config, dims, dtype=torch.float16, grad_scaler=scaler, max_grad_norm=1.0,
                      optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-2))
    tokens = torch.randint(0, 16, (8, 8), generator=torch.Generator().manual_seed(1))
    history = []
    for _ in range(14):
        loss = trainer.step(tokens, (3 * tokens + 1) % 16)
        history.append((trainer.last_step_skipped, scaler.get_scale(), loss))
    assert all(math.isfinite(loss) for _, _, loss in history)
    return history


def test_float16_training_backs_off_then_learns(rank_pool):
    histories = rank_pool(4).run(_float16_training)
    assert all(h == histories[0] for h in histories)  # one decision, one scale, one loss on every rank
    skipped = [s for s, _, _ in histories[0]]
    scales = [scale for _, scale, _ in histories[0]]
    losses = [loss for _, _, loss in histories[0]]
    first_step = skipped.index(False)
    assert first_step >= 3 and not any(skipped[first_step:first_step + 3]), skipped  # backed off, then steady
    assert scales[:first_step] == [2.0 ** (20 - i) for i in range(first_step)]
    assert scales[first_step + 2] == 2 * scales[first_step]  # growth_interval=3 steps in a row: grown
    # a skipped step left every weight as it was: the next step's loss is the same, to the bit
    assert losses[:first_step + 1] == [losses[0]] * (first_step + 1), losses
    assert losses[-1] < 0.6 * losses[0], losses


def test_bad_clipping_and_scaler_arguments_are_refused():
    for bad in (0, -1.0, math.inf, math.nan, True, "1"):
        with pytest.raises(ValueError, match=rf"max_grad_norm={bad!r}: expected a finite number > 0".replace(".", r"\.")):
            Trainer(GPTConfig(**CONFIG), None, max_grad_norm=bad)
    for bad in (torch.amp.GradScaler("cpu"), 2.0 ** 16, True):
        with pytest.raises(TypeError, match=r"grad_scaler=.*: expected an overlapkernels\.runtime\.fsdp\.GradScaler"):
            Trainer(GPTConfig(**CONFIG), None, grad_scaler=bad)
    with pytest.raises(TypeError, match=r"lr_scheduler=float: expected a factory, callable\(optimizer\)"):
        Trainer(GPTConfig(**CONFIG), None, lr_scheduler=0.5)
    with pytest.raises(ValueError, match=r"^reduce_dtype='fp32': expected torch\.float64, float32"):
        Trainer(GPTConfig(**CONFIG), None, reduce_dtype="fp32")
    for bad in (0, "no", None):  # (0 is falsy: it must not pass for False)
        with pytest.raises(TypeError, match=rf"^reduce_per_microbatch={bad!r}: expected a bool$"):
            Trainer(GPTConfig(**CONFIG), None, reduce_per_microbatch=bad)


def _resume_on_rank(path):
    """Two steps, save, two more; a trainer drawn from another seed loads the checkpoint and takes
    the same two steps: the same losses, weights, step count, loss scale (grown every step) and lr
    schedule (MultiStepLR: its milestones are a Counter of ints, which JSON gives back with string
    keys - the resumed schedule then never decayed)."""
    config = GPTConfig(**CONFIG, method="decomposed")
    dims = ok.init_parallel(dp=2, pp=2)
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
               for _ in range(4)]

    def trainer(seed, schedule=True, scaler=True, **kwargs):
        torch.manual_seed(seed)
        decay = lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3], gamma=0.1)  # noqa: E731
        kwargs.setdefault("lr_scheduler", decay if schedule else None)
        return Trainer(config, dims, zero_stage=3, max_grad_norm=1.0,
                       grad_scaler=fsdp.GradScaler(init_scale=2.0 ** 10, growth_interval=1) if scaler else None,
                       **kwargs)

    first = trainer(0)
    for batch in batches[:2]:
        first.step(*batch)
    first.save(path)
    first_schedule = first.lr_scheduler.state_dict()
    want = [first.step(*batch) for batch in batches[2:]]
    second = trainer(1)
    second.load(path)
    assert second.steps == 2 and second.grad_scaler.get_scale() == 2.0 ** 12
    lrs = {group["lr"] for group in second.sharded.optimizer.param_groups}
    assert lrs == {1e-2} and second.lr_scheduler.state_dict() == first_schedule, lrs
    got = [second.step(*batch) for batch in batches[2:]]
    assert got == want, (got, want)
    assert second.grad_scaler.state_dict() == first.grad_scaler.state_dict() and second.steps == 4
    lrs = second.lr_scheduler.get_last_lr()
    assert lrs == first.lr_scheduler.get_last_lr() and lrs == pytest.approx([1e-3] * len(lrs)), lrs  # decayed at step 3
    # a trainer without a scaler or a schedule is told what it does not load
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer(2, schedule=False, scaler=False).load(path)
    told = sorted(str(w.message) for w in caught)
    assert told == [f"Trainer.load: {path!r} holds a {what} state and this trainer has no {what}: not loaded"
                    for what in ("loss scaler", "lr schedule")], told
    try:
        trainer(3, lr_scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt))
    except TypeError as exc:
        assert str(exc).startswith("lr_scheduler returned a ReduceLROnPlateau, whose step() needs a metric"), exc
    else:
        raise AssertionError("ReduceLROnPlateau accepted")
    mine, theirs = first.sharded.full_state_dict(), second.sharded.full_state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine if torch.is_tensor(mine[k]))
    return want


def test_a_trainer_resumes_from_its_checkpoint(rank_pool, tmp_path):
    results = rank_pool(4).run(_resume_on_rank, str(tmp_path / "ckpt"))
    assert all(r == results[0] for r in results)


def _reduce_dtype_on_rank():
    """float16 weights with fp32 reductions under ZeRO-1 (whose gradients wait for the step, summed
    over the microbatches in fp32 apart from .grad: fsdp's tests check those sums exactly) and loss
    scaling: every unit reduces in fp32, and the step is taken alike on every rank."""
    dims = ok.init_parallel(dp=2, pp=2)
    trainer = Trainer(GPTConfig(**CONFIG, method="decomposed"), dims, dtype=torch.float16, reduce_dtype=torch.float32,
                      grad_scaler=fsdp.GradScaler(init_scale=2.0 ** 8),
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    tokens = torch.randint(0, 16, (8, 8), generator=torch.Generator().manual_seed(2))
    loss = trainer.step(tokens, (3 * tokens + 1) % 16)
    units = {str(u.reduce_dtype) for chunk in trainer.chunks for u in chunk.all_units}
    return units, trainer.last_step_skipped, math.isfinite(loss), loss


def test_reduce_dtype_reaches_every_unit(rank_pool):
    results = rank_pool(4).run(_reduce_dtype_on_rank)
    assert all(r == results[0] for r in results)  # one loss, one decision
    assert results[0][:3] == ({"torch.float32"}, False, True), results[0]


def _interleaved_on_rank(layout, zero_stage, path, virtual, reduce_per_microbatch=True, schedule="interleaved-1f1b",
                         cp_attention="ring", recompute=False):
    """``virtual`` chunks per pipeline rank (chunk c of rank r is stage 2c + r of 2 x virtual, a layer
    each) under interleaved 1F1B, clipped and loss-scaled over all chunks: losses, norms and every
    chunk's weights equal the clipped single process's; the chunks go into one checkpoint that
    another trainer resumes. ``reduce_per_microbatch=False``: every chunk accumulates over the step.
    ``schedule="zb-v"``: two chunks in a V (rank r holds stages r and 3 - r; rank 0 the embedding
    and the head), their weight gradients left to W. ``cp_attention``: the GPT's (GPTConfig's);
    ``recompute``: the trainer's blocks checkpoint their activations (the reference stores them)."""
    config = GPTConfig(**{**CONFIG, "num_layers": 2 * virtual}, method="decomposed", cp_attention=cp_attention)
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randint(0, 16, (8, 8), generator=g), torch.randint(0, 16, (8, 8), generator=g))
               for _ in range(2)]
    torch.manual_seed(0)
    dense = GPT(config, ok.init_parallel(), dtype=torch.float64)
    start = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in dense.state_dict().items()}
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    opt = sgd(dense.parameters())
    want = []
    for tokens, targets in batches:
        opt.zero_grad()
        loss = dense.loss(tokens, targets)
        loss.backward()
        want.append((float(loss), float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.05))))
        opt.step()
    assert all(norm > 0.1 for _, norm in want)  # both steps clipped

    dims = ok.init_parallel(**layout)
    trainer = Trainer(dataclasses.replace(config, activation_checkpointing=recompute), dims, schedule=schedule,
                      num_virtual=virtual, dtype=torch.float64, dense_state_dict=start, optimizer=sgd, zero_stage=zero_stage, max_grad_norm=0.05,
                      grad_scaler=fsdp.GradScaler(init_scale=2.0 ** 10), reduce_per_microbatch=reduce_per_microbatch)
    assert trainer.stage is None and trainer.sharded is None and len(trainer.chunks) == virtual
    placed = [(2 * c + dims.pp_rank) if schedule != "zb-v" else (dims.pp_rank, 3 - dims.pp_rank)[c] for c in range(virtual)]
    assert [stage.__dict__[PIPELINE_STAGE] for stage in trainer.stages] == [(s, 2 * virtual) for s in placed]
    if schedule == "zb-v":  # rank 0: the embedding's stage and the head's
        assert [stage.first or stage.last for stage in trainer.stages] == [dims.pp_rank == 0] * 2
    assert [s for s in trainer.schedule.actions[dims.pp_rank] if s.op == "F"][0].stage == dims.pp_rank
    got, block_calls = [], []
    blocks = [block for stage in trainer.stages for block in stage.blocks.values()]
    for block in blocks:
        block.register_forward_pre_hook(lambda *_: block_calls.append(1))
    with _recording_w(torch.nn.ModuleList(trainer.stages), lose_grad=False) as deferred:
        for tokens, targets in batches:
            got.append((trainer.step(tokens, targets), trainer.last_grad_norm))
    assert [x for pair in got for x in pair] == pytest.approx([x for pair in want for x in pair], rel=1e-12), (got, want)
    # every block once per microbatch and step, or once more in backward (recomputed)
    assert len(block_calls) == len(blocks) * trainer.schedule.num_microbatches * len(batches) * (1 + recompute)
    # zb-v: each W (2 chunks x m microbatches x 2 steps) gave its chunk's linear weights their gradients
    assert len(deferred) == (2 * 2 * trainer.schedule.num_microbatches if schedule == "zb-v" else 0)
    assert all(names and all(n.endswith("weight") for n in names) for names in deferred), deferred
    for chunk, stage in zip(trainer.chunks, trainer.stages):
        twin = GPT(config, dims, dtype=torch.float64, pipeline_stage=stage.__dict__[PIPELINE_STAGE])
        expected = shard_dense_state_dict(twin, dense.state_dict())
        for name, t in chunk.full_state_dict().items():
            if torch.is_tensor(t):
                torch.testing.assert_close(t, expected[name], atol=1e-10, rtol=1e-10, msg=lambda m, n=name: f"{n}: {m}")
    trainer.save(path)
    torch.manual_seed(5)
    resumed = Trainer(config, dims, schedule=schedule, num_virtual=virtual, dtype=torch.float64, optimizer=sgd,
                      zero_stage=zero_stage, grad_scaler=fsdp.GradScaler(init_scale=2.0 ** 3))
    resumed.load(path)
    assert resumed.steps == 2 and resumed.grad_scaler.get_scale() == 2.0 ** 10
    for a, b in zip(trainer.chunks, resumed.chunks):
        mine, theirs = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(mine[k], theirs[k]) for k in mine if torch.is_tensor(mine[k]))
    return got


@pytest.mark.parametrize("layout, zero_stage, virtual, per_microbatch", [
    (dict(tp=2, pp=2), 1, 2, True), (dict(dp=2, pp=2), 3, 2, True), (dict(cp=2, pp=2), 2, 2, True),
    (dict(dp=2, pp=2), 1, 3, True), (dict(dp=2, pp=2), 3, 2, False)])
def test_interleaved_chunks_match_single_process(rank_pool, tmp_path, layout, zero_stage, virtual, per_microbatch):
    results = rank_pool(4).run(_interleaved_on_rank, layout, zero_stage, str(tmp_path / "ckpt"), virtual,
                               per_microbatch)
    assert all(r == results[0] for r in results)


@pytest.mark.parametrize("layout, zero_stage, per_microbatch, cp_attention", [
    (dict(tp=2, pp=2), 1, True, "ring"), (dict(dp=2, pp=2), 3, True, "ring"), (dict(dp=2, pp=2), 2, False, "ring"),
    (dict(cp=2, pp=2), 2, True, "ring"), (dict(cp=2, pp=2), 1, True, "ulysses")])
def test_zb_v_chunks_match_single_process(rank_pool, tmp_path, layout, zero_stage, per_microbatch, cp_attention):
    """ZB-V: the first and the last stage on rank 0, weight gradients at W, ZeRO's reductions after them
    (and with Ulysses for the attention over CP)."""
    results = rank_pool(4).run(_interleaved_on_rank, layout, zero_stage, str(tmp_path / "ckpt"), 2, per_microbatch,
                               "zb-v", cp_attention)
    assert all(r == results[0] for r in results)


def test_zb_v_with_activation_checkpointing_matches_single_process(rank_pool, tmp_path):
    """Each block recomputed in backward while W takes its weight gradients later (the closures hold
    what W needs, not the autograd graph a recompute rebuilds), TP over the chunks."""
    results = rank_pool(4).run(_interleaved_on_rank, dict(tp=2, pp=2), 1, str(tmp_path / "ckpt"), 2, True, "zb-v",
                               "ring", True)
    assert all(r == results[0] for r in results)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("schedule", ["interleaved-1f1b", "zb-v"])
def test_chunks_without_dense_weights_start_as_one_process_would(schedule):
    """Built from the random state (no dense_state_dict), every chunk holds the weights a
    same-seed single process draws (the second chunk drew after the first's draws: its weights
    were not the model's), and the random state moves on as after one build."""
    config = GPTConfig(**{**CONFIG, "num_layers": 4})
    dims = ok.init_parallel()
    torch.manual_seed(3)
    dense = GPT(config, dims).state_dict()
    after_one = torch.rand(4)
    torch.manual_seed(3)
    trainer = Trainer(config, dims, schedule=schedule, num_virtual=2)
    assert torch.equal(torch.rand(4), after_one)
    assert len(trainer.stages) == 2
    for stage in trainer.stages:
        for name, t in stage.state_dict().items():
            if torch.is_tensor(t):
                assert torch.equal(t, dense[name]), f"{stage.__dict__[PIPELINE_STAGE]} {name}"
