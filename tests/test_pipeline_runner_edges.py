"""PipelineRunner edges the executor's gradient checks do not reach: stage_kwargs names a stage's
forward cannot take (positional-only, behind fsdp.shard's wrapper, the same bad names twice), the
per-op compute time, what a step holds on to, what may cross a boundary within one step (one dtype,
up to 8 dims), a failure inside the posting call itself, and the weight-gradient store's
accumulation (autograd's layout, no alias of what a closure returned)."""
import itertools
import types
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from overlapkernels.comm.rank_pool import RankPool
from overlapkernels.ops.weight_grad_store import WeightGradStore, defer, deferring
from overlapkernels.runtime import pipeline as pp
from test_pipeline import WIDTH, _X, _Y


# ------------------------------------------------------------------------------- stage_kwargs
class _PositionalOnly(nn.Linear):
    def forward(self, x, offset, /):
        return super().forward(x) + offset


@pytest.mark.usefixtures("world_of_one")
def test_a_positional_only_parameter_is_not_a_stage_kwarg():
    """stage_kwargs pass by name: a forward whose parameter of that name is positional-only cannot
    take it, refused by name before the stage runs (not Python's error from inside the step)."""
    runner = pp.PipelineRunner(_PositionalOnly(3, 3), schedule=pp.make_schedule("gpipe", 1, 2), loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match=r"^stage 0: its forward takes no keyword argument \['offset'\] "
                                        r"\(stage_kwargs\)$"):
        runner.step(_X, _Y, stage_kwargs={"offset": torch.zeros(4, 3)})
    assert runner._failed is None


@pytest.mark.usefixtures("world_of_one")
def test_an_indexless_cuda_device_is_the_current_gpu(monkeypatch):
    """device="cuda": received tensors and stage_kwargs are compared with tensors' devices, which
    always carry an index (torch.device("cuda") != torch.device("cuda:0")): every stage_kwargs tensor
    on the GPU was refused. CUDA is faked (the runner only names the device here)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    runner = pp.PipelineRunner(nn.Linear(3, 3), schedule=pp.make_schedule("gpipe", 1, 2), loss_fn=F.mse_loss,
                               device="cuda")
    assert runner.device == torch.device("cuda", 1)
    assert pp.PipelineRunner(nn.Linear(3, 3), schedule=pp.make_schedule("gpipe", 1, 2), loss_fn=F.mse_loss,
                             device="cuda:0").device == torch.device("cuda", 0)


def test_concrete_device_without_cuda_leaves_the_device_as_given(monkeypatch):
    from overlapkernels.parallel import concrete_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert concrete_device("cuda") == torch.device("cuda") and concrete_device("cpu") == torch.device("cpu")


class _TakesIds(nn.Linear):
    def forward(self, x, segment_ids=None):
        return super().forward(x)


@pytest.mark.usefixtures("world_of_one")
def test_misnamed_stage_kwargs_are_refused_every_time_also_behind_fsdp_shard():
    """The names a stage takes are read once per set of names, but a refused set is not remembered
    as taken: the same mistake is refused again on the next step. fsdp.shard's wrapper takes
    ``**kwargs``: the names are read from the module it wraps."""
    from overlapkernels.runtime import fsdp

    torch.manual_seed(0)
    sharded = fsdp.shard(_TakesIds(3, 3), stage=3, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    for stage in (_TakesIds(3, 3), sharded):
        runner = pp.PipelineRunner(stage, schedule=pp.make_schedule("gpipe", 1, 2), loss_fn=F.mse_loss)
        for _ in range(2):
            with pytest.raises(TypeError, match=r"^stage 0: its forward takes no keyword argument \['segment_id'\] "
                                                r"\(stage_kwargs\)$"):
                runner.step(_X, _Y, stage_kwargs={"segment_id": torch.zeros(4, 3, dtype=torch.long)})
        runner.step(_X, _Y, stage_kwargs={"segment_ids": torch.zeros(4, 3, dtype=torch.long)})  # the right name runs


# ------------------------------------------------------------------------------- compute time
@pytest.mark.usefixtures("world_of_one")
def test_compute_time_sums_every_action_of_its_kind(monkeypatch):
    """compute_s[op] is the step's total over every action of that kind (what bench reports), read
    from a clock that ticks once per reading: each timed action spans one tick."""
    from overlapkernels.runtime.pipeline import runner as runner_module

    m = 3
    runner = pp.PipelineRunner(nn.Sequential(nn.Linear(3, 3), nn.Tanh()), schedule=pp.make_schedule("zb-h1", 1, m),
                               loss_fn=F.mse_loss)
    monkeypatch.setattr(runner_module, "time", types.SimpleNamespace(perf_counter=itertools.count().__next__))
    runner.step(torch.zeros(6, 3), torch.zeros(6, 3))
    assert runner.compute_s == {"F": m, "B": m, "W": m, "BW": 0}


# --------------------------------------------------------------------- what crosses a boundary
@pytest.mark.usefixtures("world_of_one")
def test_an_activation_changing_dtype_within_a_step_is_refused():
    """The receiver sizes and types its buffers from the shape message sent once per step: a later
    microbatch of another dtype (same shape, same element size here) would be read as the first's."""
    runner = pp.PipelineRunner(nn.Tanh(), schedule=pp.make_schedule("1f1b", 1, 2), loss_fn=F.mse_loss)
    runner._shapes, runner._outbox = {}, {}
    runner._send_later("activation", 0, 0, torch.zeros(2, 3, dtype=torch.float32))
    with pytest.raises(ValueError, match=r"^stage 0 microbatch 1: output \(2, 3\) torch.int32 differs from this "
                                         r"step's first microbatch \(\(2, 3\) torch.float32\)$"):
        runner._send_later("activation", 0, 1, torch.zeros(2, 3, dtype=torch.int32))
    assert list(runner._outbox) == [("activation", 0, 0)]


@pytest.mark.usefixtures("world_of_one")
def test_an_activation_of_eight_dims_may_cross_and_leaves_the_outbox_when_posted():
    """A shape message holds 8 sizes: 8 dims cross (9 are refused: test_pipeline_activations.py)."""
    runner = pp.PipelineRunner(nn.Tanh(), schedule=pp.make_schedule("1f1b", 1, 2), loss_fn=F.mse_loss)
    runner._shapes, runner._outbox = {}, {}
    runner._send_later("activation", 0, 0, torch.zeros([1] * 8))
    meta = runner._outgoing(_msg("shape"))
    assert meta.tolist() == [8, _dtype_index(torch.float32)] + [1] * 8
    # the activation leaves the outbox as it is posted (a completed NCCL send then frees it, not the step's end)
    assert runner._outgoing(_msg("activation")).shape == (1,) * 8 and runner._outbox == {}


def _msg(what):
    from overlapkernels.runtime.pipeline.p2p import Msg

    return Msg(True, 0, what, 0, 0)


def _dtype_index(dtype):
    from overlapkernels.runtime.pipeline.messages import _DTYPES

    return _DTYPES.index(dtype)


class _TrackedInput(nn.Module):
    """A stage that counts, at each forward, how many of the inputs it was handed before are alive."""

    def __init__(self):
        super().__init__()
        self.lin, self.inputs, self.alive = nn.Linear(WIDTH, WIDTH).double(), [], []

    def forward(self, x):
        self.alive.append(sum(r() is not None for r in self.inputs))
        self.inputs.append(weakref.ref(x))
        return self.lin(x)


def _received_inputs_on_rank(m):
    rank = dist.get_rank()
    torch.manual_seed(0)
    stage = nn.Linear(WIDTH, WIDTH).double() if rank == 0 else _TrackedInput()
    runner = pp.PipelineRunner(stage, schedule=pp.make_schedule("1f1b", 2, m), loss_fn=F.mse_loss, timeout=30)
    x = torch.randn(2 * m, WIDTH, dtype=torch.float64)
    runner.step(x if rank == 0 else None, x if rank == 1 else None)
    return None if rank == 0 else stage.alive


def test_a_received_activation_is_released_by_its_microbatchs_backward(rank_pool):
    """The last stage of 1F1B runs F, B per microbatch: the activation it received for one is let
    go by that microbatch's backward, not held (with its receive buffer) to the step's end."""
    m = 4
    _, alive = rank_pool(2).run(_received_inputs_on_rank, m)
    assert alive == [0] * m, alive


# ------------------------------------------------------------------ a failure while posting
def _post_fails_once_on_rank():
    rank = dist.get_rank()
    torch.manual_seed(0)
    runner = pp.PipelineRunner(nn.Linear(WIDTH, WIDTH).double(), schedule=pp.make_schedule("1f1b", 2, 2),
                               loss_fn=F.mse_loss, timeout=1)
    original = dist.batch_isend_irecv

    def lost(ops):  # gloo raises from batch_isend_irecv itself when a peer's connection is gone
        dist.batch_isend_irecv = original
        raise RuntimeError("Connection closed by peer")

    if rank == 0:
        dist.batch_isend_irecv = lost
    x = torch.randn(4, WIDTH, dtype=torch.float64)
    said = []
    try:
        for _ in range(2):
            try:
                runner.step(x if rank == 0 else None, x if rank == 1 else None)
                said.append("no error")
            except (RuntimeError, pp.PipelineTimeout) as exc:
                said.append(f"{type(exc).__name__}: {exc}")
    finally:
        dist.batch_isend_irecv = original
    return said


def test_a_step_whose_posting_raised_leaves_the_runner_refusing_further_steps():
    """gloo may have posted part of a batch before batch_isend_irecv raised: that step's messages may
    be in flight, so the runner refuses the next step as after any failure past posting."""
    with RankPool(2, timeout=60) as pool:  # its own pool: the failed step leaves messages in flight
        (first, retry), _ = pool.run(_post_fails_once_on_rank)
    assert first.startswith("PipelineTimeout: stage 0 microbatch 0: cannot exchange with rank 1 (stage 1) "
                            "(Connection closed by peer)"), first
    assert retry.startswith("RuntimeError: PipelineRunner: an earlier step failed after it had started exchanging "
                            "messages (PipelineTimeout: stage 0 microbatch 0: cannot exchange"), retry


# ---------------------------------------------------------------- the weight-gradient store
class _DeferredTransposed(torch.autograd.Function):
    """x @ w.T whose weight gradient, deferred, is computed transposed and handed out as a view (as
    the TP ops' ``grad_b.t()``), and also kept by the caller (``kept``)."""

    @staticmethod
    def forward(ctx, x, w, kept):
        ctx.save_for_backward(x)
        ctx.w, ctx.kept = w, kept
        return x @ w.T

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        assert defer([ctx.w], lambda: [ctx.kept.copy_(x.T @ grad).t()])
        return grad @ ctx.w, None, None


def test_a_deferred_gradient_lands_as_autograds_would():
    """W's first gradient becomes ``.grad`` as AccumulateGrad makes it: a contiguous tensor of its
    own, not the (transposed) view a closure returned, which a later W's ``+=`` would then write
    through into the closure's buffer."""
    x = torch.arange(6.0, dtype=torch.float64).reshape(3, 2)
    w = torch.zeros(4, 2, dtype=torch.float64, requires_grad=True)
    kept = torch.empty(2, 4, dtype=torch.float64)
    for i in range(2):
        store = WeightGradStore()
        with deferring(store):
            _DeferredTransposed.apply(x, w, kept).sum().backward()
        store.run()
        if i == 0:
            assert w.grad.is_contiguous() and w.grad.data_ptr() != kept.data_ptr()
    want = 2 * (x.T @ torch.ones(3, 4, dtype=torch.float64)).T
    assert torch.equal(w.grad, want)
    assert torch.equal(kept, want.T / 2)  # the closure's buffer holds its own (last) product only


# ------------------------------------------------------------ a failure before any message
class _FailsOnce(nn.Linear):
    def __init__(self):
        super().__init__(3, 3)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            raise ValueError("a stage error")
        return super().forward(x)


@pytest.mark.usefixtures("world_of_one")
def test_a_step_failing_before_any_message_leaves_the_runner_usable():
    """Only a step that failed once it had exchanged messages makes the runner refuse the next one
    (they may be in flight under the next step's tags): one rank holding every stage posts none."""
    runner = pp.PipelineRunner(_FailsOnce(), schedule=pp.make_schedule("1f1b", 1, 2), loss_fn=F.mse_loss)
    with pytest.raises(ValueError, match="^a stage error$"):
        runner.step(_X, _Y)
    assert runner._failed is None
    assert runner.step(_X, _Y) is not None


def test_zero_bubble_refuses_ddp_at_any_depth_and_at_the_top():
    """A DDP two levels down, or the stage module itself a DDP, is refused as a direct child is."""
    from torch.nn.parallel import DistributedDataParallel

    def ddp():
        wrapper = DistributedDataParallel.__new__(DistributedDataParallel)  # no process group needed to be refused
        nn.Module.__init__(wrapper)
        wrapper.module = nn.Linear(4, 4)
        return wrapper

    with pytest.raises(ValueError, match=r"^Sequential.1.0 is DistributedDataParallel: a W-split schedule"):
        pp.enable_zero_bubble(nn.Sequential(nn.Linear(4, 4), nn.Sequential(ddp())))
    with pytest.raises(ValueError, match=r"^DistributedDataParallel is DistributedDataParallel: a W-split schedule"):
        pp.enable_zero_bubble(ddp())
