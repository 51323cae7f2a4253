"""fsdp.shard(frozen_model, stage=3, shard_frozen=True): a model with no trainable parameter at all
(a distillation teacher, a DPO reference model, a frozen critic) sharded for inference, on gloo
ranks vs one process (fp64): its outputs bitwise, the trained model beside it as without sharding,
at most a unit module and its prefetch gathered at once, checkpoints, and the refusals."""
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_HID, D_IN, Net, _batches, _loss, _net

SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731


def _teacher(seed=2):
    torch.manual_seed(seed)
    return Net().double().requires_grad_(False)


def _all_freed(module) -> bool:
    """Every sharded parameter's storage is released (the root's ``scale`` stays whole: not in a unit).
    (After a backward, before a step, the parameters keep their shapes over empty storage.)"""
    return all(p.untyped_storage().size() == 0 for name, p in module.named_parameters() if name != "scale")


def _distill_on_rank(steps=3, per_rank=2):
    """-> (the teacher's outputs equal one process's bitwise, the student trains as in one process,
    the teacher freed after every forward, its peak below the whole model, what it counts)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ref_teacher, ref_student = _teacher(), _net()
    ref_opt = SGD(ref_student.parameters())
    teacher = fsdp.shard(copy.deepcopy(ref_teacher), stage=3, shard_frozen=True)
    student = fsdp.shard(_net(), stage=3, optimizer=SGD)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    outputs_equal, freed = [], []
    for x, _ in _batches(steps, per_rank, world):
        with torch.no_grad():
            target = teacher(x[mine])
        outputs_equal.append(torch.equal(target, ref_teacher(x[mine])))
        freed.append(_all_freed(teacher.module))
        _loss(student(x[mine]), target).backward()
        student.step()
        with torch.no_grad():
            want = ref_teacher(x)
        ref_opt.zero_grad()
        _loss(ref_student(x), want).backward()
        ref_opt.step()
    full, want = student.full_state_dict(), ref_student.state_dict()
    trained = all(torch.allclose(full[k], want[k], rtol=0, atol=1e-12) for k in want)
    whole = sum(u.flat_bytes for u in teacher.saved_units)
    stats = teacher.memory_stats()
    shards = sum(u.shard_numel * 8 for u in teacher.saved_units) + 8  # + the root's scale, kept whole
    return (outputs_equal, trained, freed, teacher.peak_gathered_bytes < whole,
            (stats["param_bytes"] == shards, stats["optim_bytes"], stats["grad_bytes"]))


def test_a_frozen_teacher_is_sharded_for_inference_beside_its_student(rank_pool):
    """Was refused ("not supported yet"): a teacher or reference model stayed whole on every rank
    (or unsharded), the memory ZeRO-3 saves on the student spent again on it."""
    for got in rank_pool(2).run(_distill_on_rank):
        assert got == ([True] * 3, True, [True] * 3, True, (True, 0, 0)), got


class Critic(nn.Module):
    """Frozen: the generator's output reaches the loss through it, so its backward needs its
    weights (gathered again in backward, as a trained unit's are) though nothing of it trains."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(D_IN, D_HID), nn.Linear(D_HID, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _through_frozen_on_rank(steps=3, per_rank=2):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(3)
    ref_critic = Critic().double().requires_grad_(False)
    ref_gen = nn.Sequential(nn.Linear(D_IN, D_IN), nn.Tanh(), nn.Linear(D_IN, D_IN)).double()
    ref_opt = SGD(ref_gen.parameters())
    critic = fsdp.shard(copy.deepcopy(ref_critic), stage=3, shard_frozen=True, units=(nn.Linear,))
    gen = fsdp.shard(copy.deepcopy(ref_gen), stage=3, optimizer=SGD)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    freed = []
    for x, y in _batches(steps, per_rank, world):
        _loss(critic(gen(x[mine])), y[mine]).backward()
        freed.append(_all_freed(critic.module))
        gen.step()
        ref_opt.zero_grad()
        _loss(ref_critic(ref_gen(x)), y).backward()
        ref_opt.step()
    full, want = gen.full_state_dict(), ref_gen.state_dict()
    frozen_kept = all(torch.equal(a, b) for a, b in zip(critic.full_state_dict().values(),
                                                        ref_critic.state_dict().values()))
    return all(torch.allclose(full[k], want[k], rtol=0, atol=1e-12) for k in want), frozen_kept, freed


def test_gradients_flow_through_a_sharded_frozen_model(rank_pool):
    """A frozen critic between the trained generator and the loss: its units are gathered again in
    backward, freed within it, and the generator trains as in one process (its end of backward, with
    no trained unit to agree on, used to index an empty list)."""
    for got in rank_pool(2).run(_through_frozen_on_rank):
        assert got == (True, True, [True] * 3), got


def _checkpoint_on_rank(path):
    teacher = fsdp.shard(_teacher(seed=2), stage=3, shard_frozen=True)
    trained_path = path + "-trained"
    fsdp.save(fsdp.shard(_net(), stage=3), trained_path)
    try:  # a trained model's checkpoint: its units are not the frozen model's; the message says the way
        fsdp.load(teacher, trained_path)
        hint = "loaded"
    except ValueError as exc:
        hint = str(exc).split("]]; ", 1)[-1]
    fsdp.save(teacher, path)
    other = fsdp.shard(_teacher(seed=5), stage=3, shard_frozen=True)
    want = teacher.full_state_dict()
    differed = not torch.equal(other.full_state_dict()["inp.weight"], want["inp.weight"])
    fsdp.load(other, path)
    got = other.full_state_dict()
    try:
        other.step()
        refused = "nothing"
    except RuntimeError as exc:
        refused = str(exc)
    return differed, all(torch.equal(got[k], want[k]) for k in want), refused, hint


def test_a_frozen_model_checkpoints_and_refuses_to_step(rank_pool, tmp_path):
    for differed, same, refused, hint in rank_pool(2).run(_checkpoint_on_rank, str(tmp_path / "teacher")):
        assert (differed, same) == (True, True)
        assert hint.startswith("a frozen model (a reference, a teacher) takes a trained model's weights before it is "
                               "sharded: fsdp.load the checkpoint into the trained model's ShardedModule"), hint
        assert refused == ("fsdp step: Net was sharded with no trainable parameter (a frozen model, for "
                           "inference): there is nothing to step"), refused


class Empty(nn.Module):
    def forward(self, x):
        return x


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("model, kwargs, error, match", [
    (_teacher, {}, ValueError, r"^fsdp.shard: Net has no trainable parameter, and with shard_frozen=False frozen "
                               r"parameters stay whole on every rank: nothing would be sharded\. To shard a frozen "
                               r"model .*: stage=3, shard_frozen=True$"),
    (Empty, dict(shard_frozen=True), ValueError, r"^fsdp.shard: Empty has no parameter: nothing to shard$"),
    (lambda: "net", {}, TypeError, r"^model must be a torch.nn.Module, got str$"),
    # frozen parameters outside every unit module: they stay whole, so nothing would be sharded (then
    # fsdp.save failed with an IndexError)
    (lambda: nn.Linear(4, 4).requires_grad_(False), dict(shard_frozen=True), ValueError,
     r"^fsdp.shard: Linear has no trainable parameter, and none of its frozen ones lies in a unit module"),
])
def test_models_with_nothing_to_shard_are_refused_by_name(model, kwargs, error, match):
    """The first used to fail inside torch's optimizer ("optimizer got an empty parameter list")."""
    with pytest.raises(error, match=match):
        fsdp.shard(model(), stage=3, **kwargs)
