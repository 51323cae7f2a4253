"""The pipeline executor on gloo ranks (schedules, simulator and P2P plans: test_pipeline_schedule.py;
a peer failing mid-step: test_pipeline_failures.py; the zero-bubble weight-gradient split itself:
test_pipeline_zero_bubble.py)."""
import copy
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from overlapkernels.comm.rank_pool import RankPool
from overlapkernels.runtime import pipeline as pp
from overlapkernels.runtime.pipeline.p2p import Msg
from nccl_like import replay_like_nccl


# ---------------------------------------------------------------------------------- executor
WIDTH = 5
_ORIGINAL_POST = pp.PipelineRunner._post
_ORIGINAL_RUN = pp.WeightGradStore.run
_ORIGINAL_INIT = pp.WeightGradStore.__init__


def _model(num_stages, layers_per_stage=2):
    torch.manual_seed(0)
    layers = []
    for _ in range(num_stages * layers_per_stage):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers).double()


def _stage(model, stage, layers_per_stage=2):
    per = 2 * layers_per_stage
    return model[stage * per:(stage + 1) * per]


def _recording_post(log):
    """Wraps the runner's one P2P seam: each batch as [(send?, peer, what, boundary, mb, shape)]."""
    def post(self, batch, tensors):
        log.append([(m.send, m.peer, m.what, m.boundary, m.microbatch, tuple(t.shape)) for m, t in zip(batch, tensors)])
        return _ORIGINAL_POST(self, batch, tensors)
    return post


def _executor_on_rank(kind, m, v, module_list=False, device="cpu"):
    p, rank = dist.get_world_size(), dist.get_rank()
    sched = pp.make_schedule(kind, p, m, num_virtual=v)
    g = torch.Generator().manual_seed(3)
    x, y = (torch.randn(2 * m, WIDTH, generator=g, dtype=torch.float64).to(device) for _ in range(2))
    ref = _model(p * v).to(device)
    F.mse_loss(ref(x), y).backward()
    model = _model(p * v).to(device)
    v = sched.num_virtual  # (zb-v: always 2)
    stages = [_stage(model, sched.stage_of(rank, c)) for c in range(v)]
    runner = pp.PipelineRunner(nn.ModuleList(stages) if module_list else stages if v > 1 else stages[0],
                               schedule=sched, loss_fn=F.mse_loss)
    log, deferred, opened, held = [], [], [], []  # held: stores (microbatches' W inputs) not run yet, at each W
    pp.PipelineRunner._post = _recording_post(log)
    pp.WeightGradStore.__init__ = lambda self: (opened.append(1), _ORIGINAL_INIT(self))[1]
    pp.WeightGradStore.run = lambda self: (deferred.append(len(self.closures)), held.append(len(opened) - len(held)),
                                           _ORIGINAL_RUN(self))[2]
    try:
        loss = runner.step(x if rank == 0 else None, y if sched.rank_of(sched.num_stages - 1) == rank else None)
    finally:
        pp.PipelineRunner._post, pp.WeightGradStore.run = _ORIGINAL_POST, _ORIGINAL_RUN
        pp.WeightGradStore.__init__ = _ORIGINAL_INIT
    if loss is not None:
        torch.testing.assert_close(loss, F.mse_loss(ref(x), y), atol=1e-12, rtol=1e-12)
    for c in range(v):
        s = sched.stage_of(rank, c)
        for (name, got), want in zip(_stage(model, s).named_parameters(), _stage(ref, s).parameters()):
            torch.testing.assert_close(got.grad, want.grad, atol=1e-12, rtol=1e-12,
                                       msg=lambda msg, n=name: f"stage {s} {n}: {msg}")
    # zb-h1 and zb-v split unasked: each W runs the deferred weight gradients of the stage's 2 linears
    assert deferred == ([2] * m * v if kind in ("zb-h1", "zb-v") else []), deferred
    # ... and at most p microbatches' weight-gradient inputs wait for their W at once (1F1B's peak; was m,
    # which test_executor_gradients_equal_full_batch's m > p tells apart); zb-v: 2p half stages'
    assert max(held, default=0) <= min(p, m) * v, (held, p, m)
    return loss is not None, log


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("kind, v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("interleaved-1f1b", 3),
                                     ("zb-h1", 1), ("zb-v", 2)])
@pytest.mark.parametrize("more", [0, 1])
def test_executor_gradients_equal_full_batch(rank_pool, world, kind, v, more):
    """Exact gradients, and the P2P each rank really posted keeps NCCL's rules."""
    m = world * (2 + more) if v > 1 else 2 * world + more
    results = rank_pool(world).run(_executor_on_rank, kind, m, v, module_list=v > 1 and world == 2)
    assert sum(has_loss for has_loss, _ in results) == 1  # only the last stage reports the loss
    replay_like_nccl([log for _, log in results])


@pytest.mark.gpu
@pytest.mark.parametrize("kind, v", [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_executor_with_cuda_stages_over_gloo(rank_pool, kind, v):
    """Two ranks sharing one GPU, gloo for P2P (which moves host memory only): messages travel
    through CPU copies and the gradients are still exact."""
    results = rank_pool(2).run(_executor_on_rank, kind, 4, v, False, "cuda:0")
    assert sum(has_loss for has_loss, _ in results) == 1


def _odd_stages_on_rank(first_param_less):
    """A stage without parameters (first or last), two steps of different batch sizes."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = [nn.Tanh(), nn.Linear(WIDTH, WIDTH).double()]
    if not first_param_less:
        layers.reverse()
    model = nn.Sequential(*layers)
    runner = pp.PipelineRunner(model[rank], schedule=pp.make_schedule("1f1b", 2, 2), loss_fn=F.mse_loss)
    for rows in (4, 6):  # shapes cross each step: the second batch is not read with the first's
        g = torch.Generator().manual_seed(rows)
        x, y = (torch.randn(rows, WIDTH, generator=g, dtype=torch.float64) for _ in range(2))
        model.zero_grad()
        loss = runner.step(x if rank == 0 else None, y if rank == 1 else None)
        ref = nn.Sequential(*layers)
        want = F.mse_loss(ref(x), y)
        if rank == 1:
            torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-12)
        params = list(model[rank].parameters())  # this rank's stage
        grads = [p.grad.clone() for p in params]
        model.zero_grad()
        want.backward()
        for got, p in zip(grads, params):
            torch.testing.assert_close(got, p.grad, atol=1e-12, rtol=1e-12)
    return True


@pytest.mark.parametrize("first_param_less", [True, False])
def test_stage_without_parameters(rank_pool, first_param_less):
    assert rank_pool(2).run(_odd_stages_on_rank, first_param_less) == [True, True]


class _SummedEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, WIDTH, dtype=torch.float64)

    def forward(self, ids):
        return self.embed(ids).sum(1)


def _integer_activation_on_rank():
    """Token ids cross from a first stage without parameters to an embedding stage: an integer
    activation takes no gradient (zeros go back), and the embedding's gradient is the reference's."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), _SummedEmbedding())
    runner = pp.PipelineRunner(model[rank], schedule=pp.make_schedule("1f1b", 2, 2), loss_fn=F.mse_loss, timeout=20)
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 10, (4, 3), generator=g), torch.randn(4, WIDTH, generator=g, dtype=torch.float64)
    loss = runner.step(ids if rank == 0 else None, y if rank == 1 else None)
    if rank == 0:
        return True
    got = model[1].embed.weight.grad.clone()
    model.zero_grad()
    want = F.mse_loss(model(ids), y)
    want.backward()
    torch.testing.assert_close(loss, want, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got, model[1].embed.weight.grad, atol=1e-12, rtol=1e-12)
    return True


def test_integer_activations_cross_stages(rank_pool):
    assert rank_pool(2).run(_integer_activation_on_rank) == [True, True]


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("stages, schedule, loss_fn, error, match", [
    ([nn.Tanh(), 3], ("interleaved-1f1b", 1, 2, 2), F.mse_loss, TypeError,
     r"^stage_module_or_modules\[1\]=int: expected an nn.Module or a callable$"),
    (nn.Tanh(), None, F.mse_loss, ValueError, r"^PipelineRunner needs schedule= .*; got None for schedule$"),
    (nn.Tanh(), ("1f1b", 1, 2, 1), None, ValueError, r"^PipelineRunner needs schedule= .*; got None for loss_fn$"),
    (nn.Tanh(), None, None, ValueError, r"^PipelineRunner needs schedule= .*; got None for schedule and loss_fn$"),
    (nn.Tanh(), ("1f1b", 2, 2, 1), F.mse_loss, ValueError, r"^schedule has 2 ranks but the pipeline group has 1$"),
    ([nn.Tanh()], ("interleaved-1f1b", 1, 2, 2), F.mse_loss, ValueError,
     r"^1 stage modules on this rank, the schedule has 2 per rank$"),
    (nn.Tanh(), "1f1b", F.mse_loss, TypeError, r"^schedule='1f1b': expected a Schedule \(make_schedule\(kind, "),
    (nn.Tanh(), ("1f1b", 1, 2, 1), "mse", TypeError, r"^loss_fn=str: expected a callable\(output, target\) -> loss$"),
])
def test_bad_runner_arguments_are_named(stages, schedule, loss_fn, error, match):
    """Refused in the constructor, before any P2P (a world of one: the ranks' agreement is trivial)."""
    sched = schedule if schedule is None or isinstance(schedule, str) else \
        pp.make_schedule(*schedule[:3], num_virtual=schedule[3])
    with pytest.raises(error, match=match):
        pp.PipelineRunner(stages, schedule=sched, loss_fn=loss_fn)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("timeout, error, match", [
    (None, TypeError, r"^timeout=None: expected seconds \(int or float\) or a datetime.timedelta$"),
    ("30", TypeError, r"^timeout='30': expected seconds"),
    (True, TypeError, r"^timeout=True: expected seconds"),
    (-1, ValueError, r"^timeout=-1: expected a finite duration of at least 1 ms$"),
    (float("nan"), ValueError, r"^timeout=nan: expected a finite duration"),
])
def test_bad_runner_timeouts_are_named(timeout, error, match):
    """Stored unchecked, these failed inside step() after P2P was posted (None, a string), or made
    every receive time out at once (-1)."""
    sched = pp.make_schedule("1f1b", 1, 2)
    with pytest.raises(error, match=match):
        pp.PipelineRunner(nn.Tanh(), schedule=sched, loss_fn=F.mse_loss, timeout=timeout)
    assert pp.PipelineRunner(nn.Tanh(), schedule=sched, loss_fn=F.mse_loss, timeout=timedelta(minutes=1)).timeout == 60


_X, _Y = torch.zeros(4, 3), torch.zeros(4, 3)


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("inputs, targets, error, match", [
    (None, _Y, ValueError, r"^the first stage's rank must pass inputs$"),
    (_X, None, ValueError, r"^the last stage's rank must pass targets$"),
    (_X.tolist(), _Y, TypeError, r"^inputs=list: expected a tensor \(microbatches split on dim 0\)$"),
    (_X, _Y.numpy(), TypeError, r"^targets=ndarray: expected a tensor \(microbatches split on dim 0\)$"),
    (_X[:3], _Y, ValueError, r"^inputs.shape=\(3, 3\): dim 0 must be divisible by 2 microbatches$"),
    (_X, torch.tensor(1.0), ValueError, r"^targets.shape=\(\): dim 0 must be divisible by 2 microbatches$"),
])
def test_bad_step_batches_are_named_before_any_communication(monkeypatch, inputs, targets, error, match):
    """As on NCCL (the flag set), whose first step opens with an all-reduce: a bad batch is refused
    before it, and before any P2P."""
    runner = pp.PipelineRunner(nn.Linear(3, 3), schedule=pp.make_schedule("1f1b", 1, 2), loss_fn=F.mse_loss)
    runner._nccl, calls = True, []
    monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: calls.append("all_reduce"))
    monkeypatch.setattr(dist, "batch_isend_irecv", lambda ops: calls.append("p2p"))
    with pytest.raises(error, match=match):
        runner.step(inputs, targets)
    assert calls == []


@pytest.mark.usefixtures("world_of_one")
def test_a_lost_connection_when_posting_names_the_peer(monkeypatch):
    """gloo raises from batch_isend_irecv itself when a peer's connection is gone: the runner names
    the stage, microbatch and peer, with the first line of gloo's reason."""
    from overlapkernels.runtime.pipeline.p2p import Msg

    runner = pp.PipelineRunner(nn.Linear(3, 3), schedule=pp.make_schedule("1f1b", 1, 2), loss_fn=F.mse_loss)

    def lost(ops):
        assert len(ops) == 1  # the batch reached the one seam
        raise RuntimeError("Connection closed by peer [127.0.0.1]:29500\n(gloo's traceback)")

    monkeypatch.setattr(dist, "batch_isend_irecv", lost)
    msg = Msg(send=False, peer=0, what="activation", boundary=0, microbatch=1)
    with pytest.raises(pp.PipelineTimeout, match=r"^stage 1 microbatch 1: cannot exchange with rank 0 \(stage 0\) "
                                                 r"\(Connection closed by peer \[127\.0\.0\.1\]:29500\)$") as info:
        runner._post([msg], [torch.empty(2, 3)])
    assert isinstance(info.value.__cause__, RuntimeError)


def _first_p2p_on_rank():
    """The runner as on NCCL (its flag set over gloo): the record of collectives and P2P batches,
    in its construction and then in each of two steps."""
    calls, all_reduce, batch = [], dist.all_reduce, dist.batch_isend_irecv
    dist.all_reduce = lambda *a, **k: (calls.append("all_reduce"), all_reduce(*a, **k))[1]
    dist.batch_isend_irecv = lambda ops: (calls.append("p2p"), batch(ops))[1]
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(4, WIDTH, generator=g, dtype=torch.float64), torch.randn(4, WIDTH, generator=g, dtype=torch.float64)
    try:
        runner = pp.PipelineRunner(_stage(_model(2), dist.get_rank()), schedule=pp.make_schedule("1f1b", 2, 2),
                                   loss_fn=F.mse_loss)
        runner._nccl = True
        runner._wait = runner._confirm  # gloo's waits (a gloo receive waited twice would wait for another message)
        steps = [calls[:]]
        for _ in range(2):
            calls.clear()
            runner.step(x if dist.get_rank() == 0 else None, y if dist.get_rank() == 1 else None)
            steps.append(calls[:])
    finally:
        dist.all_reduce, dist.batch_isend_irecv = all_reduce, batch
    return steps


def test_nccl_first_p2p_follows_a_collective_of_the_whole_group(rank_pool):
    """torch requires the first NCCL call of a group to involve all its ranks when it is a
    batch_isend_irecv (else the communicator is created lazily per pair and can hang; Megatron
    PR 5240): the runner's construction all-reduces over the pipeline group (its ranks agree that
    none refused its arguments), once; the steps then only exchange P2P."""
    for made, first, second in rank_pool(2).run(_first_p2p_on_rank):
        assert made == ["all_reduce"], made
        assert "all_reduce" not in first and "p2p" in first, first
        assert "all_reduce" not in second and "p2p" in second, second


def _planted_on_rank():
    """Forget to scale each microbatch's loss by 1/m: the gradient parity check must catch it."""
    original = pp.PipelineRunner._run_action

    def unscaled(self, a, inputs_mb, targets_mb, state, stores, losses):
        self.schedule.num_microbatches, m = 1, self.schedule.num_microbatches
        try:
            return original(self, a, inputs_mb, targets_mb, state, stores, losses)
        finally:
            self.schedule.num_microbatches = m

    pp.PipelineRunner._run_action = unscaled
    try:
        _executor_on_rank("1f1b", 4, 1)
    except AssertionError:
        return "caught"
    finally:
        pp.PipelineRunner._run_action = original
    return "missed"


def test_planted_error_is_caught(rank_pool):
    assert rank_pool(2).run(_planted_on_rank) == ["caught", "caught"]


class _RecordingWork:
    def __init__(self):
        self.calls = []

    def wait(self, *args):
        self.calls.append(args)
        return True


def test_nccl_receives_wait_on_the_stream_and_are_confirmed_at_step_end():
    """NCCL: a timed wait blocks the host until the transfer lands (WorkNCCL polls every 1 ms),
    so the runner waits on the stream at the action and applies its timeout once, at the end."""
    from types import SimpleNamespace

    from overlapkernels.runtime.pipeline.runner import PipelineRunner

    for nccl, first_wait in ((True, ()), (False, (timedelta(seconds=5.0),))):
        runner = SimpleNamespace(_nccl=nccl, _unconfirmed=[], timeout=5.0)
        runner._confirm = PipelineRunner._confirm.__get__(runner)
        work, msg = _RecordingWork(), SimpleNamespace(what="activation", boundary=0, microbatch=1, send=False, peer=0)
        PipelineRunner._wait(runner, work, msg)
        assert work.calls == [first_wait]
        assert runner._unconfirmed == ([(work, msg)] if nccl else [])


class _TupleStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x), x.sum()


def _tuple_stage_on_rank():
    rank = dist.get_rank()
    sched = pp.make_schedule("1f1b", 2, 2)
    stage = _TupleStage() if rank == 0 else nn.Linear(4, 4)
    runner = pp.PipelineRunner(stage, schedule=sched, loss_fn=lambda out, t: F.mse_loss(out, t), timeout=2.0)
    try:
        runner.step(torch.ones(4, 4) if rank == 0 else None, torch.ones(4, 4) if rank == 1 else None)
    except TypeError as exc:
        return str(exc)
    except pp.PipelineTimeout:
        return "timeout"  # the receiving stage: no activation came
    return "no error"


def test_a_stage_returning_a_tuple_is_named():
    with RankPool(2, timeout=60) as pool:  # its own pool: the receiver's timed-out receive stays posted
        sender, receiver = pool.run(_tuple_stage_on_rank)
    assert sender.startswith("stage 0 microbatch 0: the stage returned tuple; a pipeline stage passes one tensor")
    assert receiver == "timeout"


@pytest.mark.usefixtures("world_of_one")
@pytest.mark.parametrize("kind", ["interleaved-1f1b", "zb-h1", "zb-v"])
def test_one_rank_holding_every_stage_equals_plain_autograd(kind):
    """With one pipeline rank, interleaving puts both virtual stages on it: the handoff between them
    stays in the process and must cut the graph there, as a send and a receive do."""
    torch.manual_seed(0)
    stages = nn.ModuleList([nn.Sequential(nn.Linear(4, 4), nn.Tanh()) for _ in range(2)]).double()
    ref = copy.deepcopy(stages)
    x, y = torch.randn(4, 4, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    virtual = 2 if kind in ("interleaved-1f1b", "zb-v") else 1
    model = list(stages) if virtual == 2 else [nn.Sequential(*stages)]
    sched = pp.make_schedule(kind, 1, 2, **({"num_virtual": virtual} if virtual > 1 else {}))
    loss = pp.PipelineRunner(model, schedule=sched, loss_fn=nn.functional.mse_loss).step(x, y)
    want = nn.functional.mse_loss(ref[1](ref[0](x)), y)
    want.backward()
    torch.testing.assert_close(loss, want.detach(), atol=1e-12, rtol=1e-12)
    for p, q in zip(stages.parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-12, rtol=1e-12)


def _custom_order_on_rank():
    """Stage 0 runs its forwards in the order 1, 0; stage 1 in the order 0, 1 (a valid schedule
    built by hand): the boundary's shape message is named by the sender's first forward on both
    ends. Before, every rank refused the plan (the receiver expected it with its own first)."""
    rank = dist.get_rank()
    a = pp.Action
    sched = pp.make_schedule("gpipe", 2, 2)
    sched.actions = [[a("F", 0, 1), a("F", 0, 0), a("BW", 0, 0), a("BW", 0, 1)],
                     [a("F", 1, 0), a("F", 1, 1), a("BW", 1, 0), a("BW", 1, 1)]]
    g = torch.Generator().manual_seed(5)
    x, y = (torch.randn(4, WIDTH, generator=g, dtype=torch.float64) for _ in range(2))
    ref, model = _model(2), _model(2)
    F.mse_loss(ref(x), y).backward()
    runner = pp.PipelineRunner(_stage(model, rank), schedule=sched, loss_fn=F.mse_loss, timeout=60)
    runner.step(x if rank == 0 else None, y if rank == 1 else None)
    for got, want in zip(_stage(model, rank).parameters(), _stage(ref, rank).parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-12, rtol=1e-12)
    # nothing of the step outlives it: no send work, received buffer or outgoing tensor held
    held = runner._sends + runner._unconfirmed + list(runner._inbox) + list(runner._outbox)
    return held


def test_a_schedule_whose_stages_order_forwards_differently_runs(rank_pool):
    assert rank_pool(2).run(_custom_order_on_rank) == [[], []]


class _Work:
    def __init__(self, done, fails=False):
        self.done, self.fails, self.waited = done, fails, False

    def is_completed(self):
        return self.done

    def wait(self, timeout=None):
        self.waited = True
        if self.fails:
            raise RuntimeError("Connection closed by peer")
        return True


def test_completed_works_are_confirmed_and_dropped_at_each_post_point():
    """A work kept holds its tensor (an NCCL receive its buffer, a gloo send the stage's output):
    kept to the step's end, a step held every microbatch's boundary activation. Completed ones are
    dropped at the next post point - their errors raised there - pending ones kept. (gloo's
    is_completed() stays False until wait(): on CPU the step's end releases them.)"""
    runner = object.__new__(pp.PipelineRunner)
    runner.timeout = 5.0
    msg = Msg(True, 1, "activation", 0, 3)
    done, pending = _Work(True), _Work(False)
    assert runner._reap([(done, msg), (pending, msg)]) == [(pending, msg)]
    assert done.waited and not pending.waited
    with pytest.raises(pp.PipelineTimeout, match="stage 0 microbatch 3: no receipt of the activation by rank 1"):
        runner._reap([(_Work(True, fails=True), msg)])


def test_every_message_of_a_step_has_its_own_tag():
    """gloo pairs messages by tag (the module docstring's promise): no two labels of a step share one."""
    runner = object.__new__(pp.PipelineRunner)
    runner.schedule = pp.make_schedule("interleaved-1f1b", 2, 4, num_virtual=2)
    tags = [runner._tag(Msg(True, 1, what, b, mb)) for what in ("shape", "activation", "gradient")
            for b in range(3) for mb in range(4)]
    assert len(set(tags)) == len(tags)
