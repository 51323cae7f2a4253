"""fsdp.shard on model shapes beyond a stack of blocks, each vs single-process training (fp64,
exact): trainable parameters on the root only (a bare layer, prompt tuning over a frozen backbone),
units returning dataclasses, children without a forward of their own (ParameterList), and a unit's
parameters read outside its forward at stage 3 (refused loudly, never a race)."""
import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_IN, _batches, _loss

SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)  # noqa: E731 (scale-sensitive: see test_fsdp_gloo)


class PromptTuning(nn.Module):
    """The only trainable parameter lives on the root: no unit output carries a gradient hook."""

    def __init__(self):
        super().__init__()
        self.prompt = nn.Parameter(torch.randn(D_IN))
        self.backbone = nn.Linear(D_IN, 3).requires_grad_(False)

    def forward(self, x):
        return self.backbone(x + self.prompt)


@dataclasses.dataclass
class Hidden:
    value: torch.Tensor


class DataclassBlock(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return Hidden(torch.tanh(self.fc(x.value if isinstance(x, Hidden) else x)))


class DataclassNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = DataclassBlock(D_IN, 5), DataclassBlock(5, 3)

    def forward(self, x):
        return self.b(self.a(x)).value


class WithParameterList(nn.Module):
    """A child never called: its parameters are read by the root's forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, 3)
        self.scales = nn.ParameterList([nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))])

    def forward(self, x):
        return self.fc(x) * self.scales[0] + self.scales[1]


MODELS = {"bare linear": lambda: nn.Linear(D_IN, 3), "prompt tuning": PromptTuning,
          "dataclass outputs": DataclassNet, "parameter list": WithParameterList}


def _parity_on_rank(model_name, stage):
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    ref = MODELS[model_name]().double()
    sharded = fsdp.shard(copy.deepcopy(ref), stage=stage, optimizer=SGD, prefetch=1)
    ref_opt = SGD([p for p in ref.parameters() if p.requires_grad])
    for x, y in _batches(3, 2, world):
        ref_opt.zero_grad()
        _loss(ref(x), y).backward()
        ref_opt.step()
        mine = slice(rank * 2, (rank + 1) * 2)
        _loss(sharded(x[mine]), y[mine]).backward()
        sharded.step()
    got = sharded.full_state_dict()
    for name, want in ref.state_dict().items():
        torch.testing.assert_close(got[name], want, atol=1e-12, rtol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
    return [u.name for u in sharded.all_units]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_models_beyond_a_stack_of_blocks(rank_pool, model_name, stage):
    """Stages 2/3 queued their end-of-backward work only from unit outputs' gradient hooks: with
    the trainable parameters on the root (or outputs pytree cannot see into) no unit was marked as
    having gradients and step() dropped them - nothing trained, silently. A ParameterList became a
    unit of its own that no forward gathers: stage 3 read it freed, or while a prefetch filled it."""
    units = rank_pool(2).run(_parity_on_rank, model_name, stage)[0]
    want = {"bare linear": ["<root>"], "prompt tuning": ["<root>"], "dataclass outputs": ["a", "b"],
            "parameter list": ["fc", "<root>"]}[model_name]
    assert units == want


class ReadsAUnitsWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, 3)
        self.pos = nn.Embedding(4, 3)

    def forward(self, x):
        return self.fc(x) + self.pos.weight[:x.shape[0]]  # pos's forward never runs


def _reads_weight_on_rank():
    torch.manual_seed(0)
    sharded = fsdp.shard(ReadsAUnitsWeight().double(), stage=3, optimizer=SGD, prefetch=1)
    x = torch.randn(2, D_IN, dtype=torch.float64)
    try:
        sharded(x)
    except RuntimeError as exc:
        return "size of tensor b (0)" in str(exc)
    return "ran"


def test_stage_3_refuses_a_unit_read_outside_its_forward_instead_of_racing_its_prefetch(rank_pool):
    """fc's forward prefetched pos (async) and pointed its parameters at the buffer being filled:
    the root then read them mid-gather (wrong values, silently). A prefetched unit's parameters now
    stay empty until its own forward waits for the gather, so at a step's first forward the read
    fails as without prefetch. (Later micro-steps of a step keep the shapes for autograd: such a
    read is unsupported there, as under FSDP2, and not caught.)"""
    assert rank_pool(2).run(_reads_weight_on_rank) == [True, True]


def _zero_grad_signature_on_rank():
    sharded = fsdp.shard(nn.Linear(D_IN, 3).double(), stage=2, optimizer=SGD)
    sharded(torch.randn(2, D_IN, dtype=torch.float64)).sum().backward()
    sharded.zero_grad(set_to_none=False)  # nn.Module's signature: training loops pass it
    sharded.zero_grad()
    return all(p.grad is None for p in sharded.module.parameters())


def test_zero_grad_takes_set_to_none(rank_pool):
    assert rank_pool(2).run(_zero_grad_signature_on_rank) == [True, True]


class LoRABlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.base = nn.Linear(D_IN, D_IN).requires_grad_(False)  # frozen pretrained weight
        self.lora_a, self.lora_b = nn.Linear(D_IN, 2, bias=False), nn.Linear(2, D_IN, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class TiedLoRA(nn.Module):
    """Frozen fp32 bases under bf16 adapters, as a LoRA fine-tune loads them. The second block runs
    under activation checkpointing (its forward runs again during backward, outside the root's) and
    the head reads the first base's weight itself, outside that block's forward (a tied LM head)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([LoRABlock(), LoRABlock()])

    def forward(self, x):
        h = self.blocks[0](x)
        h = torch.utils.checkpoint.checkpoint(self.blocks[1], h, use_reentrant=False)
        return h @ self.blocks[0].base.weight.t()


def _shadowed(model):
    return [n for n, m in model.named_modules() for n2 in m._parameters if n2 in m.__dict__]


def _frozen_copies_on_rank(stage):
    """param_dtype computes with bf16 copies of the frozen fp32 bases (as FSDP2): the forward and the
    adapters' step equal the model run in bf16 over fp32 masters, while the bases themselves - and so
    checkpoints - stay fp32 and untouched, and no copy outlives a forward (one that raises too)."""
    torch.manual_seed(0)
    ref = TiedLoRA()
    sharded = fsdp.shard(copy.deepcopy(ref), stage=stage, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.05),
                         param_dtype=torch.bfloat16)
    ref16 = copy.deepcopy(ref).to(torch.bfloat16)
    ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.05)
    x = torch.randn(3, D_IN)  # one batch on both ranks: the DP mean of the gradients is each rank's
    out, out_ref = sharded(x), ref16(x.to(torch.bfloat16))
    same_out = torch.equal(out, out_ref)
    out.float().sum().backward()
    out_ref.float().sum().backward()
    sharded.step()
    for p, p16 in zip(ref.parameters(), ref16.parameters()):
        p.grad = None if p16.grad is None else p16.grad.float()
    ref_opt.step()
    full, want = sharded.full_state_dict(), ref.state_dict()
    stepped = all(full[n].dtype == torch.float32 and torch.equal(full[n], w) for n, w in want.items())
    clean = not _shadowed(sharded.module)
    with pytest.raises(RuntimeError):
        sharded(torch.randn(3, D_IN + 1))
    return same_out, stepped, clean, not _shadowed(sharded.module)


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters_compute_as_param_dtype_copies(rank_pool, stage):
    assert rank_pool(2).run(_frozen_copies_on_rank, stage) == [(True, True, True, True)] * 2


@dataclasses.dataclass
class WithDerived:
    value: torch.Tensor
    norm: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self):
        self.norm = self.value.norm()


class DerivedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D_IN, 3)

    def forward(self, x):
        return WithDerived(self.fc(x))


class DerivedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.blk = DerivedBlock()

    def forward(self, x):
        out = self.blk(x)
        return out.value + out.norm


def _init_false_field_on_rank(stage):
    """torch FSDP's output walk rebuilt dataclasses with replace(), which refuses init=False
    fields: every forward raised. The walk now reads fields in place."""
    torch.manual_seed(0)
    ref = DerivedNet().double()
    sharded = fsdp.shard(copy.deepcopy(ref), stage=stage, optimizer=SGD)
    x = torch.randn(2, D_IN, dtype=torch.float64)
    out = sharded(x)
    out.sum().backward()
    ref(x).sum().backward()
    sharded.step()
    return torch.equal(out, ref(x))


@pytest.mark.parametrize("stage", [1, 3])
def test_a_dataclass_output_with_an_init_false_field(rank_pool, stage):
    assert rank_pool(2).run(_init_false_field_on_rank, stage) == [True, True]


class _Frozen(nn.Module):
    """A frozen fp32 weight read by the module's own forward, and - tied - by a second holder."""

    def __init__(self, write=False):
        super().__init__()
        self.a, self.b = nn.Linear(2, 2, bias=False), nn.Linear(2, 2, bias=False)
        self.b.weight = self.a.weight
        self.a.requires_grad_(False)
        self.write, self.seen = write, []

    def forward(self, x):
        self.seen.append((self.a.weight, self.b.weight))
        if self.write:
            self.a.weight.add_(1)  # an EMA-like in-place update of a frozen Parameter
        return self.b(self.a(x))


def test_frozen_copies_are_shared_refreshed_and_written_back():
    """No process group needed: a tied frozen weight is cast once per forward; a shadow left behind
    (torch skips always_call hooks under torch.compile) is dropped by the next forward, which sees
    the original's new values; an in-place write in the forward reaches the original, with a
    warning; fp8 stays as it is."""
    import warnings

    from overlapkernels.runtime.fsdp.frozen_copies import FrozenComputeCopies

    model = _Frozen().float()
    FrozenComputeCopies(model, torch.float64)
    x = torch.ones(1, 2, dtype=torch.float64)
    model(x)
    a, b = model.seen[-1]
    assert a is b and a.dtype == torch.float64  # one copy for both holders
    model.a.__dict__["weight"] = a  # as a forward whose hooks were skipped leaves it
    with torch.no_grad():
        model.a.weight.fill_(2.0)  # (the stale copy: the original is still 'a' in _parameters)
        model.a._parameters["weight"].fill_(2.0)
    out = model(x)
    assert torch.equal(out, torch.full((1, 2), 16.0, dtype=torch.float64))  # the fresh values, not the stale copy
    assert "weight" not in model.a.__dict__ and "weight" not in model.b.__dict__
    writer = _Frozen(write=True).float()
    FrozenComputeCopies(writer, torch.float64)
    before = writer.a.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        writer(x)
    assert torch.equal(writer.a.weight, before + 1) and writer.a.weight.dtype == torch.float32
    assert any("wrote its frozen parameter 'weight' in place" in str(w.message) for w in caught)
    if hasattr(torch, "float8_e4m3fn"):
        fp8 = nn.Linear(2, 2).requires_grad_(False)
        fp8.weight.data = fp8.weight.data.to(torch.float8_e4m3fn)
        assert FrozenComputeCopies(fp8, torch.bfloat16).holders[fp8] == ["bias"]  # the fp8 weight as it is


def _compiled_step_on_rank():
    """The usual compiled train step - forward, backward() and step() in one torch.compile'd function:
    fsdp's hooks and end-of-backward collectives run eagerly inside it (dynamo tracing them failed at
    stages 2/3 with an internal assertion) and the losses equal the eager step's."""
    import overlapkernels as ok

    dp_group = ok.init_parallel(dp=2).dp_group
    x = torch.randn(5, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(dist.get_rank()))
    same = []
    for stage in (2, 3):
        torch._dynamo.reset()
        losses = {}
        for mode in ("eager", "compiled"):
            torch.manual_seed(0)
            sharded = fsdp.shard(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).double(), dp_group,
                                 stage=stage, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5))

            def step(x):
                loss = sharded(x).pow(2).mean()
                loss.backward()
                sharded.step()
                return loss.detach()

            run = torch.compile(step, backend="aot_eager") if mode == "compiled" else step
            losses[mode] = [run(x).item() for _ in range(3)]
        same.append(losses["eager"] == losses["compiled"])
    return same


def test_a_compiled_train_step_runs_the_hooks_eagerly(rank_pool):
    assert rank_pool(2).run(_compiled_step_on_rank) == [[True, True]] * 2
