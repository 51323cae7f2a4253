"""The ZeRO comparisons bite: tests that hold sharded training to one process at 1e-12, each run again
with a planted error in the one place every ZeRO stage reduces gradients (FlatUnit's reduce-scatter
input gets 1e-6 added to its first element on the group's rank 0), must fail. Most of their files
prove no tolerance of their own (DESIGN.md: one planted error per file); this file does it for them,
with their own test functions and assertions, through a rank pool that applies the plant in every
rank."""
import importlib

import pytest
import torch.distributed as dist

from overlapkernels.comm.rank_pool import RankError

PLANT_SIZE = 1e-6


def _with_perturbed_reductions(size, fn, *args, **kwargs):
    """Run ``fn`` with every unit's reduced gradient off by ``size`` in one element."""
    flat_unit = importlib.import_module("overlapkernels.runtime.fsdp.flat_unit")
    original = flat_unit.reduce_scatter_single

    def perturbed(out, flat_grad, **kw):
        if flat_grad.numel() and dist.get_rank(kw["group"]) == 0:
            flat_grad[0] += size  # (in place: the unit keeps this buffer alive until the reduce ends)
        return original(out, flat_grad, **kw)

    flat_unit.reduce_scatter_single = perturbed
    try:
        return fn(*args, **kwargs)
    finally:
        flat_unit.reduce_scatter_single = original


class _PlantedPool:
    """``rank_pool(n)`` whose ``run`` applies the plant around the function on every rank."""

    def __init__(self, rank_pool, size=PLANT_SIZE):
        self.rank_pool, self.size = rank_pool, size

    def __call__(self, world_size):
        pool, size = self.rank_pool(world_size), self.size

        class Planted:
            @staticmethod
            def run(fn, *args, timeout=None, **kwargs):
                return pool.run(_with_perturbed_reductions, size, fn, *args, timeout=timeout, **kwargs)

        return Planted()


# (module, test, its parameters): one case of each, the cheapest that trains through FlatUnit
CASES = [
    ("test_fsdp_models_gloo", "test_models_beyond_a_stack_of_blocks", dict(model_name="bare linear", stage=3)),
    ("test_fsdp_branches_gloo", "test_a_unit_used_on_some_ranks_only", dict(stage=2, width_b=5)),
    ("test_fsdp_frozen_model_gloo", "test_gradients_flow_through_a_sharded_frozen_model", {}),
    ("test_fsdp_frozen_sharded_gloo", "test_frozen_parameters_sharded_train_like_one_process", {}),
    ("test_fsdp_grad_scaler_gloo", "test_scaled_training_equals_torch_scaler_on_the_dense_model",
     dict(stage=2, with_dims=False)),
    ("test_pipeline_fsdp_gloo", "test_pipeline_chunks_sharded_over_dp_match_the_whole_model",
     dict(kind="zb-h1", v=1, zero_stage=1)),
    ("test_train_options", "test_clipping_and_loss_scaling_match_single_process",
     dict(layout=dict(dp=2, pp=2), schedule="zb-h1", zero_stage=3)),
]


@pytest.mark.parametrize("module, test, params", CASES, ids=[f"{m}::{t}" for m, t, _ in CASES])
def test_a_planted_reduction_error_fails_the_test(rank_pool, module, test, params):
    run = getattr(importlib.import_module(module), test)
    with pytest.raises((AssertionError, RankError)) as caught:
        run(_PlantedPool(rank_pool), **params)
    # an assertion failed (in the test, or in a rank: RankError carries its traceback), not a hang
    assert caught.type is AssertionError or "AssertionError" in str(caught.value), str(caught.value)[-2000:]


@pytest.mark.parametrize("module, test, params", CASES, ids=[f"{m}::{t}" for m, t, _ in CASES])
def test_the_harness_alone_fails_nothing(rank_pool, module, test, params):
    """The control: the same pool wrapper with a plant of size 0 passes."""
    getattr(importlib.import_module(module), test)(_PlantedPool(rank_pool, size=0.0), **params)
