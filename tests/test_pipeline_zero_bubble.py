"""The zero-bubble weight-gradient split, in-process (no ranks): which layers enable_zero_bubble
splits and which it leaves whole (frozen weights, subclasses with their own forward, patched or
parametrized ones, layers that defer by their own flag, DDP refused), B leaving the weight gradients
to W with W giving exactly what autograd gives (under torch.compile too), and ``deferring`` keeping
backward on the calling thread (on CUDA as well). The executor running zb-h1: test_pipeline.py."""
import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from overlapkernels.layers.linear import DefersWeightGrad
from overlapkernels.runtime import pipeline as pp
from overlapkernels.runtime.pipeline.weight_grad import deferring


class _PlainSubclass(nn.Linear):
    pass


class _Scaled(nn.Linear):  # its own forward: not what the split computes, left alone
    def forward(self, x):
        return 2 * super().forward(x)


class _OwnSplit(DefersWeightGrad, nn.Module):  # a parallel layer: it defers by its own flag
    pass


def test_zero_bubble_split_keeps_autograd_semantics():
    """Frozen weights get no gradient; plain subclasses split, others stay whole; W gives what
    autograd gives (exact)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), _PlainSubclass(4, 4), _Scaled(4, 4), nn.Linear(4, 4, bias=False)).double()
    ref[0].weight.requires_grad_(False)
    ref[3].weight.requires_grad_(False)
    model = nn.Sequential(*(type(layer)(4, 4, bias=layer.bias is not None) for layer in ref)).double()
    model.load_state_dict(ref.state_dict())
    for a, b in zip(model.parameters(), ref.parameters()):
        a.requires_grad_(b.requires_grad)
    parametrized = torch.nn.utils.parametrizations.orthogonal(nn.Linear(4, 4))
    patched = nn.Linear(4, 4)
    patched.forward = someone_elses = lambda x: 2 * F.linear(x, patched.weight, patched.bias)  # noqa: E731
    own = _OwnSplit()
    pp.enable_zero_bubble(model)
    pp.enable_zero_bubble(parametrized)
    pp.enable_zero_bubble(patched)
    pp.enable_zero_bubble(own)
    assert [pp.splits_weight_grad(layer) for layer in model] == [True, True, False, True]
    assert not pp.splits_weight_grad(parametrized) and "forward" not in vars(parametrized)
    assert not pp.splits_weight_grad(patched) and vars(patched)["forward"] is someone_elses  # left as patched
    assert pp.splits_weight_grad(own) and own.defer_weight_grad and "forward" not in vars(own)
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    store = pp.WeightGradStore()
    with deferring(store):
        model(x).sum().backward()
    assert model[1].weight.grad is None and model[2].weight.grad is not None  # B: split ones wait for W
    assert len(store.closures) == 2  # [1] (weight, bias) and [0] (bias only); [3] is all frozen
    store.run()
    ref(x.detach().requires_grad_()).sum().backward()
    for (name, got), want in zip(model.named_parameters(), ref.parameters()):
        assert (got.grad is None) == (want.grad is None), name
        if want.grad is not None:
            torch.testing.assert_close(got.grad, want.grad, atol=0, rtol=0, msg=name)


def test_zero_bubble_split_under_torch_compile():
    """torch.compile (aot_eager) of a split model: B still leaves the weight gradients to W, on the
    first (compiling) call and on a cached one, after a first compile outside ``deferring``, and W
    gives what autograd gives (torch's pipelining lost the split under compile: pytorch#161904)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)).double()
    model = copy.deepcopy(ref)
    compiled = torch.compile(pp.enable_zero_bubble(model), backend="aot_eager")
    x = torch.randn(3, 4, dtype=torch.float64)
    ref(x).sum().backward()
    compiled(x).sum().backward()  # compiled outside deferring: plain autograd, every gradient now
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=0, rtol=0)
    for _ in range(2):  # then inside, twice (the second call runs the cached graph)
        model.zero_grad(set_to_none=True)
        store = pp.WeightGradStore()
        with deferring(store):
            compiled(x).sum().backward()
        assert len(store.closures) == 2 and model[0].weight.grad is None and model[2].weight.grad is None
        assert model[0].bias.grad is None  # bias gradients are weight gradients too: W's
        store.run()
        for got, want in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(got.grad, want.grad, atol=0, rtol=0)


def test_zero_bubble_refuses_ddp_whose_hooks_would_miss_deferred_gradients():
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel.__new__(DistributedDataParallel)  # no process group needed to be refused
    nn.Module.__init__(ddp)
    ddp.module = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"^Sequential.1 is DistributedDataParallel: a W-split schedule \(zb-h1, zb-v\) "
                                         r"defers weight gradients past DDP's reduction hooks"):
        pp.enable_zero_bubble(nn.Sequential(nn.Linear(4, 4), ddp))


def test_deferring_runs_backward_on_the_calling_thread():
    """On CUDA, autograd runs backward on a thread per device, which the deferral's context
    variable does not reach: inside ``deferring`` multithreaded backward is off (on CPU it
    never runs elsewhere)."""
    assert torch.autograd.is_multithreading_enabled()
    with deferring(pp.WeightGradStore()):
        assert not torch.autograd.is_multithreading_enabled()
    assert torch.autograd.is_multithreading_enabled()


@pytest.mark.gpu
def test_zero_bubble_defers_on_cuda():
    ref = nn.Linear(4, 4).cuda().double()
    model = pp.enable_zero_bubble(nn.Linear(4, 4).cuda().double())
    model.load_state_dict(ref.state_dict())
    # small integers: every sum is exact in any order, so cuBLAS's choice of kernel cannot move a bit
    x = torch.randint(-4, 5, (3, 4), device="cuda").double()
    store = pp.WeightGradStore()
    with deferring(store):
        model(x.requires_grad_()).sum().backward()
    assert model.weight.grad is None and len(store.closures) == 1  # the backward saw the store
    store.run()
    ref(x).sum().backward()
    torch.testing.assert_close(model.weight.grad, ref.weight.grad, atol=0, rtol=0)


def _penalty_and_per_sample_grads(model, x):
    """(a gradient penalty's gradients - a second derivative -, per-sample weight gradients by
    torch.func, the Jacobian of the output) through ``model``."""
    xg = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(model(xg).pow(2).sum(), xg, create_graph=True)
    penalty = torch.autograd.grad(gx.pow(2).sum(), list(model.parameters()))
    params = dict(model.named_parameters())

    def loss(ps, sample):
        return torch.func.functional_call(model, ps, (sample[None],)).pow(2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(params, x)
    return penalty, per_sample, torch.func.jacrev(model)(x[0])


def test_split_linears_still_differentiate_twice_and_transform_outside_a_b_step():
    """Was: once split (a zb-h1 runner built on the stage), an nn.Linear refused create_graph=True
    (a gradient penalty) and torch.func (vmap, grad, jacrev) for good, also outside the pipeline;
    inside ``deferring``, a second derivative computes its weight gradients at once (nothing deferred)."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    model = pp.enable_zero_bubble(copy.deepcopy(ref))
    assert pp.splits_weight_grad(model[0]) and "forward" in vars(model[0])
    x = torch.randn(6, 4, dtype=torch.float64)
    (penalty, per_sample, jacobian), want = (_penalty_and_per_sample_grads(m, x) for m in (model, ref))
    for got, expected in zip([*penalty, *per_sample.values(), jacobian], [*want[0], *want[1].values(), want[2]]):
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
    store = pp.WeightGradStore()
    with deferring(store):
        xg = x.clone().requires_grad_()
        (gx,) = torch.autograd.grad(model(xg).sum(), xg, create_graph=True)
        assert not store.closures
        gx.pow(2).sum().backward()  # (a plain backward: what it gives the weights may wait for W)
    store.run()
    xg = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(ref(xg).sum(), xg, create_graph=True)
    gx.pow(2).sum().backward()
    for got, want in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-12, rtol=0)


@pytest.mark.usefixtures("world_of_one")
def test_zero_bubble_refuses_torch_fsdp_which_would_drop_deferred_gradients():
    """Was: a zb-h1 stage under torch's FSDP2 (fully_shard) trained nothing, silently: its
    post-backward reduce-scatter runs before W gives the gradients, which then land in resharded
    parameters and are never reduced (every grad None). Refused like DDP, by the runner before it
    changes anything."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    stage = nn.Sequential(nn.Linear(4, 4), fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1,))))
    message = (r"^Sequential.1 is FSDPModule: a W-split schedule \(zb-h1, zb-v\) defers weight gradients past FSDP2's "
               r"post-backward reduce-scatter; wrap the stage in overlapkernels' fsdp.shard, or use a 1F1B schedule")
    with pytest.raises(ValueError, match=message):
        pp.PipelineRunner(stage, dist.group.WORLD, schedule=pp.make_schedule("zb-h1", 1, 2), loss_fn=F.mse_loss)
    assert "forward" not in vars(stage[0])  # refused before any layer was split
    with pytest.raises(ValueError, match=message):
        pp.enable_zero_bubble(stage)
    pp.PipelineRunner(stage, dist.group.WORLD, schedule=pp.make_schedule("1f1b", 1, 2), loss_fn=F.mse_loss)
    # torch's composable DDP too: replicas ended with different gradients, silently
    from torch.distributed._composable import replicate

    replicated = nn.Sequential(nn.Linear(4, 4), replicate(nn.Linear(4, 4)))
    with pytest.raises(ValueError, match=r"^Sequential.1 is under replicate\(\) \(composable DDP\): a W-split schedule "
                                         r"\(zb-h1, zb-v\) defers weight gradients past its gradient all-reduce hooks"):
        pp.enable_zero_bubble(replicated)
