"""What crosses a pipeline stage boundary, on gloo ranks: activations of any dtype (bool masks,
uint8 codes, complex values) travel as their bytes and come back with the right gradients (zeros
for ones that take none), vs the same model in one process; what cannot cross (more dims than a
shape message holds, sparse tensors) is refused by name; and a microbatch's activations are let go
once its backward ran. Integer token ids: test_pipeline.py."""
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from overlapkernels.runtime import pipeline as pp


class _Codes(nn.Module):
    """Stage 0: a linear, then what stage 1 is handed: the activation in ``dtype``."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.lin = nn.Linear(4, 4, dtype=torch.float64)

    def forward(self, x):
        h = self.lin(x)
        if self.dtype.is_complex:  # pairs of features as complex numbers: gradients flow through
            return torch.view_as_complex(h.reshape(*h.shape[:-1], 2, 2)).to(self.dtype)
        if self.dtype == torch.bool:
            return h > 0
        return (h.detach() * 3).clamp(0, 9).to(self.dtype)  # small codes, as a quantizer's


class _Reader(nn.Module):
    """Stage 1: reads whatever stage 0 sent, as float64."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3, dtype=torch.float64)

    def forward(self, a):
        a = torch.view_as_real(a).flatten(-2) if a.is_complex() else a.to(torch.float64)
        return self.lin(a)


def _dtype_crossing_on_rank(dtype):
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(_Codes(dtype), _Reader())
    runner = pp.PipelineRunner(model[rank], schedule=pp.make_schedule("1f1b", 2, 2), loss_fn=F.mse_loss, timeout=30)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 4, generator=g, dtype=torch.float64), torch.randn(4, 3, generator=g, dtype=torch.float64)
    loss = runner.step(x if rank == 0 else None, y if rank == 1 else None)
    got = [None if p.grad is None else p.grad.clone() for p in model[rank].parameters()]
    model.zero_grad()
    want_loss = F.mse_loss(model(x), y)
    want_loss.backward()
    if rank == 1:
        torch.testing.assert_close(loss, want_loss, atol=1e-12, rtol=1e-12)
    for g_got, p in zip(got, model[rank].parameters()):
        if p.grad is None:  # stage 0's linear takes no gradient through a bool or an integer code
            assert g_got is None or not g_got.any(), g_got
        else:
            torch.testing.assert_close(g_got, p.grad, atol=1e-12, rtol=1e-12)
    return [p.grad is not None for p in model[rank].parameters()]


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.int16, torch.complex128])
def test_activations_of_any_dtype_cross_stages(rank_pool, dtype):
    """Before, a bool, uint8, int16 or complex activation failed on the sender ('torch.bool is not
    in list') while its peer waited for the timeout."""
    stage0, stage1 = rank_pool(2).run(_dtype_crossing_on_rank, dtype)
    assert stage1 == [True, True]
    assert stage0 == [dtype.is_complex] * 2  # complex: stage 0's weights get gradients through it


def test_a_planted_wrong_gradient_is_caught(rank_pool, monkeypatch):
    """The comparison bites: a complex activation whose imaginary part is dropped on the way (the
    bug a float-only wire would cause) changes the loss."""
    with pytest.raises(Exception, match="Tensor-likes are not close|Scalars are not close"):
        rank_pool(2).run(_planted_real_only_on_rank)


def _planted_real_only_on_rank():
    original = pp.messages._bytes

    def real_only(t):
        if t.is_complex():
            t.imag.zero_()
        return original(t)

    pp.messages._bytes = real_only
    try:
        return _dtype_crossing_on_rank(torch.complex128)
    finally:
        pp.messages._bytes = original


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("make, what", [
    (lambda: torch.zeros([1] * 9), r"output \(1, 1, 1, 1, 1, 1, 1, 1, 1\) torch.float32 torch.strided"),
    (lambda: torch.zeros(2, 2).to_sparse(), r"output \(2, 2\) torch.float32 torch.sparse_coo"),
])
def test_what_cannot_cross_a_stage_is_refused_by_name(make, what):
    """Refused by the sender before anything is posted (its peer then waits for the timeout, as for
    any failure inside a step)."""
    runner = pp.PipelineRunner(nn.Tanh(), schedule=pp.make_schedule("1f1b", 1, 2), loss_fn=F.mse_loss)
    runner._shapes, runner._outbox = {}, {}
    with pytest.raises(ValueError, match=rf"^stage 0 microbatch 1: {what}: a stage passes a dense tensor of at most "
                                         r"8 dims$"):
        runner._send_later("activation", 0, 1, make())
    assert runner._outbox == {}


class _Tracked(nn.Module):
    """A stage that counts, at each forward, how many of its earlier outputs are still alive."""

    def __init__(self):
        super().__init__()
        self.lin, self.outs, self.alive = nn.Linear(4, 4).double(), [], []

    def forward(self, x):
        self.alive.append(sum(r() is not None for r in self.outs))
        out = torch.tanh(self.lin(x))
        self.outs.append(weakref.ref(out))
        return out


@pytest.mark.usefixtures("world_of_one")
def test_a_microbatchs_activations_are_released_by_its_backward():
    """1F1B's memory bound: a microbatch's stage output is dropped once its backward ran, not held
    to the step's end (every microbatch's activations alive at once, as under GPipe)."""
    stages = [_Tracked(), nn.Linear(4, 4).double()]
    sched = pp.make_schedule("interleaved-1f1b", 1, 4, num_virtual=2)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pp.PipelineRunner(stages, schedule=sched, loss_fn=F.mse_loss).step(x, y)
    assert len(stages[0].alive) == 4 and max(stages[0].alive) <= 1, (sched.actions, stages[0].alive)

