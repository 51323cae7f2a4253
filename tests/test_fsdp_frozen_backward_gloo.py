"""shard_frozen's release of frozen units in backward, on every order backward can take: the rule
itself, then each order vs shard_frozen=False (which keeps them whole) or one process - reentrant and
non-reentrant checkpointing (also without early stop, and its recompute's gathers), retain_graph,
F F B B microbatches, gradients reaching a block around its arguments, ignored arguments, and the
create_graph warning. Training, checkpoints and refusals: test_fsdp_frozen_sharded_gloo.py."""
import copy

import pytest
import torch
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_frozen_sharded_gloo import SGD, LoRA, Model
from test_fsdp_gloo import D_IN, _batches, _loss


def test_the_release_rule():
    """A module's frozen units are freed once no forward call of it whose backward started still
    waits for its inputs' gradients, and its trained units are done; not before either. A call
    with no gradient-taking argument, or one hidden in a container or object, keeps them to the
    end of backward."""
    import dataclasses

    from types import SimpleNamespace

    from overlapkernels.runtime.fsdp.frozen_units import FrozenRelease

    @dataclasses.dataclass
    class Box:
        t: torch.Tensor

    freed = []
    trained, frozen = SimpleNamespace(trained=True, module_index=0), SimpleNamespace(trained=False, module_index=0)
    release = FrozenRelease([[trained, frozen]], freed.append)
    x = torch.ones(2, requires_grad=True)
    h, aux = x * 1, []
    call, args, kwargs = release.watch_inputs(0, (h, h, aux), {"y": x * 2})
    assert type(args[0].grad_fn).__name__ == "_InputsDoneBackward" and kwargs["y"].grad_fn is args[0].grad_fn
    assert args[0] is args[1] and args[2] is aux and not call.opaque  # one tensor stays one; lists are the caller's
    assert release.watch_inputs(0, (torch.ones(2),), {})[0].opaque  # no gradient-taking argument
    assert release.watch_inputs(0, (x * 1, [x * 1]), {})[0].opaque  # one inside a list
    in_tuple, args, _ = release.watch_inputs(0, ((x * 1, 3),), {})  # inside a tuple: passed through it
    assert not in_tuple.opaque and type(args[0][0].grad_fn).__name__ == "_InputsDoneBackward" and args[0][1] == 3
    release.backward_started(0, call)
    release._input_done(0, call)  # its inputs' gradients in, the trained unit not done: kept
    assert freed == []
    release.trained_unit_done(0)
    assert freed == [0]
    release.reset()  # next backward: the trained unit first, the call's inputs still to come
    release.backward_started(0, call)
    release.trained_unit_done(0)
    assert freed == [0]
    release._input_done(0, call)
    assert freed == [0, 0]
    hidden, _, _ = release.watch_inputs(0, (Box(x * 1), x * 1), {})
    release.reset()
    release.backward_started(0, hidden)
    release.trained_unit_done(0)
    release._input_done(0, hidden)
    assert hidden.opaque and freed == [0, 0]


def test_the_release_rule_starts_over_at_each_backward():
    """What the last backward counted is reset at its end: in the next one too a call's inputs'
    gradients before the trained units' keep the frozen units (a trained unit's gradient may still
    read them: a frozen op on a trained parameter)."""
    from types import SimpleNamespace

    from overlapkernels.runtime.fsdp.frozen_units import FrozenRelease

    freed = []
    trained, frozen = SimpleNamespace(trained=True, module_index=0), SimpleNamespace(trained=False, module_index=0)
    release = FrozenRelease([[trained, frozen]], freed.append)
    x = torch.ones(2, requires_grad=True)
    for backward in range(3):
        call, _, _ = release.watch_inputs(0, (x * 1,), {})
        release.backward_started(0, call)
        release._input_done(0, call)
        assert freed == [0] * backward, (backward, freed)
        release.trained_unit_done(0)
        assert freed == [0] * (backward + 1), (backward, freed)
        release.reset()


# --- the orders backward can take (from a review): each vs shard_frozen=False, which keeps them whole
class CondLoRA(LoRA):
    """Also reads a conditioning its caller passes (a learned vector, adaLN's c) through a frozen op."""

    def __init__(self):
        super().__init__()
        self.mod = nn.Linear(D_IN, D_IN).requires_grad_(False)

    def forward(self, x, c):
        return super().forward(x) * torch.sigmoid(self.mod(c))


class Orders(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode, self.pre, self.head = mode, nn.Linear(D_IN, D_IN), nn.Linear(D_IN, 3)
        self.cond = nn.Parameter(torch.randn(D_IN))  # a trained leaf every block takes as an input
        self.blocks = nn.ModuleList([CondLoRA() for _ in range(3)])

    def forward(self, x):
        h = self.pre(x)
        for block in self.blocks:
            if self.mode == "reentrant":  # (HF/PEFT's default for years)
                h = torch.utils.checkpoint.checkpoint(block, h, self.cond, use_reentrant=True)
            else:
                h = block(h, self.cond)
        return self.head(h)


def _orders_on_rank(mode, shard_frozen):
    """-> (trained weights, most frozen units gathered at once in backward) after one step of
    ``mode``: reentrant checkpointing; two losses off one forward (retain_graph); two microbatches
    forward, forward, backward, backward (accumulation, a pipeline's 1F1B warm-up)."""
    torch.manual_seed(0)
    sharded = fsdp.shard(Orders(mode).double(), stage=3, optimizer=SGD, prefetch=0, shard_frozen=shard_frozen)
    most = [0]

    def count(*_):
        most[0] = max(most[0], sum(u.gathered for u in sharded.frozen_units))

    for p in sharded.module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(count)
    (x, y), (x2, y2) = _batches(2, 2, 1)
    if mode == "retain_graph":
        out = sharded(x)
        _loss(out, y).backward(retain_graph=True)
        _loss(out, y2).backward()
    elif mode == "ffbb":
        losses = [_loss(sharded(x), y), _loss(sharded(x2), y2)]
        for loss in losses:
            loss.backward()
    else:
        _loss(sharded(x), y).backward()
    sharded.step()
    return sharded.full_state_dict(), most[0]


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("mode", ["plain", "reentrant", "retain_graph", "ffbb"])
def test_every_backward_order_reads_gathered_frozen_units(mode):
    """Was (tensor hooks on the inputs): reentrant checkpointing, a second backward through the same
    graph, and a shared trained input across F F B B freed a frozen base before its dX matmul ran
    (a read of freed storage), and a conditioning input every block takes kept all of them gathered
    to the end of backward. Now the same training as with them whole, at most one block's frozen
    units (prefetch=0) and the conditioning's gathered at once."""
    want, _ = _orders_on_rank(mode, False)
    got, most = _orders_on_rank(mode, True)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert most <= 1, most


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("shard_frozen", [False, True])
def test_checkpointing_without_early_stop_reads_gathered_units(shard_frozen):
    """torch.utils.checkpoint without early stop runs the whole recompute, so the unit's post-forward
    hook ran inside backward and freed the units under the recomputed saved tensors (a read of freed
    storage, trained units too). Now a forward inside backward leaves them to its backward."""
    torch.manual_seed(0)
    ref = Model().double()
    sharded = fsdp.shard(copy.deepcopy(ref), stage=3, optimizer=SGD, shard_frozen=shard_frozen)
    ref_opt = SGD([p for p in ref.parameters() if p.requires_grad])
    (x, y), = _batches(1, 2, 1)
    with torch.utils.checkpoint.set_checkpoint_early_stop(False):
        _loss(sharded(x), y).backward()
        _loss(ref(x), y).backward()
    sharded.step()
    ref_opt.step()
    full = sharded.full_state_dict()
    assert all(torch.allclose(full[n], w, rtol=0, atol=1e-12) for n, w in ref.state_dict().items())


class Carrier:
    """Not a dataclass, not a pytree node: nothing sees inside."""

    def __init__(self, h):
        self.h = h


class SideBlock(LoRA):
    """Reads its gradient-taking input other than as an argument: inside an object, from an attribute
    set before the call, or a trained parameter of its parent; its argument takes no gradient. Also
    appends to a list its caller passes (an MoE block's aux losses)."""

    def forward(self, inp, aux):
        x = inp.h if self.how == "object" else self.cond if self.how == "attribute" else inp + self.parent_vec
        aux.append(x.sum())
        return super().forward(x)


class Side(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.pre, self.block, self.head = nn.Linear(D_IN, D_IN), SideBlock(), nn.Linear(D_IN, 3)
        self.vec = nn.Parameter(torch.randn(D_IN))
        self.block.how = how

    def forward(self, x):
        h, aux = self.pre(x), []
        self.block.parent_vec, self.block.cond = self.vec, h  # (plain attributes: not registered twice)
        out = self.head(self.block(Carrier(h) if self.block.how == "object" else x.detach(), aux))
        return out, len(aux)


def _side_on_rank(how, shard_frozen):
    torch.manual_seed(0)
    sharded = fsdp.shard(Side(how).double(), stage=3, optimizer=SGD, prefetch=0, shard_frozen=shard_frozen)
    (x, y), = _batches(1, 2, 1)
    out, appended = sharded(x)
    _loss(out, y).backward()
    sharded.step()
    return sharded.full_state_dict(), appended


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("how", ["object", "attribute", "parameter"])
def test_gradients_reaching_frozen_ops_around_the_arguments(how):
    """Was: a call none of whose arguments took a gradient released its frozen units once its
    trained ones were done, before the frozen op's backward ran (read of freed storage); and every
    list argument was rebuilt, so a module appending to it lost the write. Now such a call keeps
    them to the end of backward, and only the tensors themselves are passed through."""
    want, n_want = _side_on_rank(how, False)
    got, n_got = _side_on_rank(how, True)
    assert n_got == n_want == 1 and all(torch.equal(got[k], want[k]) for k in want)


class Stack(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.mode, self.pre, self.head = mode, nn.Linear(D_IN, D_IN), nn.Linear(D_IN, 3)
        self.blocks = nn.ModuleList(LoRA() for _ in range(6))

    def forward(self, x):
        h = self.pre(x)
        for block in self.blocks:
            h = block(h) if self.mode == "plain" else \
                torch.utils.checkpoint.checkpoint(block, h, use_reentrant=self.mode == "reentrant")
        return self.head(h)


def _stack_traffic(mode, shard_frozen):
    torch.manual_seed(0)
    sharded = fsdp.shard(Stack(mode).double(), stage=3, optimizer=SGD, prefetch=1, shard_frozen=shard_frozen)
    (x, y), = _batches(1, 2, 1)
    _loss(sharded(x), y).backward()
    stats = sharded.comm_stats()["gathered_bytes"], sharded.peak_gathered_bytes
    sharded.step()
    return stats


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("shard_frozen", [False, True])
@pytest.mark.parametrize("mode", ["nonreentrant", "reentrant"])
def test_a_recompute_gathers_only_its_own_units(mode, shard_frozen):
    """Was (since before shard_frozen): a checkpointed block's recompute, inside backward, prefetched
    the blocks after it - done already - and nothing freed them before the end of backward: the
    whole model gathered at the peak, 37% more all-gather traffic, and whether it issued a gather
    depended on which of this rank's parameters had gradients (ranks could issue different
    collectives). Now the same traffic and peak as without checkpointing."""
    assert _stack_traffic(mode, shard_frozen) == _stack_traffic("plain", shard_frozen)


class Ignores(LoRA):
    def forward(self, x, unused):
        return super().forward(x)


class PassesAParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre, self.vec = nn.Linear(D_IN, D_IN), nn.Parameter(torch.randn(D_IN))
        self.block, self.head = Ignores(), nn.Linear(D_IN, 3)

    def forward(self, x):  # (both arguments take gradients: one identity Function over the two)
        return self.head(self.block(self.pre(x), self.vec))


@pytest.mark.usefixtures("world_of_one")
def test_an_argument_the_module_ignores_keeps_no_gradient():
    """Its gradient through the identity Function stays None (was: zeros, so AdamW's weight decay
    moved a parameter that takes no gradient at all)."""
    want = None
    for shard_frozen in (False, True):
        torch.manual_seed(0)
        sharded = fsdp.shard(PassesAParameter().double(), stage=3, shard_frozen=shard_frozen,
                             optimizer=lambda ps: torch.optim.AdamW(ps, lr=0.1, weight_decay=0.5))
        (x, y), = _batches(1, 2, 1)
        _loss(sharded(x), y).backward()
        sharded.step()
        got = sharded.full_state_dict()
        want = want or got
        assert torch.equal(got["vec"], want["vec"]) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("stage", [2, 3])
def test_create_graph_at_stage_3_is_warned_about(stage):
    """A gradient penalty's double backward reads stage 3's freed units (unsupported): was only
    torch's 'setStorage ... size 0' at the second backward; now a warning names the cause first.
    Stage 2 keeps whole parameters: no warning, and the penalty trains."""
    import warnings

    torch.manual_seed(0)
    sharded = fsdp.shard(nn.Sequential(LoRA(), nn.Linear(D_IN, 3)).double(), stage=stage, optimizer=SGD)
    x = torch.randn(2, D_IN, dtype=torch.float64, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = sharded(x)
        g, = torch.autograd.grad(out.sum(), x, create_graph=True)
    said = [str(w.message) for w in caught if "create_graph" in str(w.message)]
    assert len(said) == (stage == 3) and all(m.startswith("fsdp stage 3: a backward with create_graph=True") for m in said)
    if stage == 2:
        (out.sum() + (g ** 2).sum()).backward()
        sharded.step()
