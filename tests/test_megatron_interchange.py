"""State dicts interchange with megatron-core's tensor-parallel linears and vocabulary-parallel
embedding (gloo, no SP): the same per-rank state dict gives the same outputs and gradients. Skipped when megatron-core is absent
(`pip install "megatron-core==0.16.1"` runs on the CPU machine)."""
import importlib.util

import pytest
import torch
import torch.distributed as dist

from overlapkernels.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding

pytestmark = pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core not installed")


def _megatron_tp():
    """(world, megatron-core's TP group over the whole world, a config for its layers: fp64, CPU)."""
    from megatron.core import parallel_state
    from megatron.core.model_parallel_config import ModelParallelConfig

    world = dist.get_world_size()
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, use_cpu_initialization=True, params_dtype=torch.float64,
                              perform_initialization=True)
    return world, parallel_state.get_tensor_model_parallel_group(), cfg


def _their_grad(p):
    """Megatron accumulates weight gradients into main_grad where it has one."""
    return p.main_grad if getattr(p, "main_grad", None) is not None else p.grad


def _megatron_linears_on_rank(planted=False):
    from megatron.core import tensor_parallel

    (world, tp, cfg), rank = _megatron_tp(), dist.get_rank()
    torch.manual_seed(0)
    init = lambda w: torch.nn.init.normal_(w, std=0.5)  # noqa: E731
    m_col = tensor_parallel.ColumnParallelLinear(6, 4 * world, config=cfg, init_method=init, bias=True,
                                                 gather_output=False)
    m_row = tensor_parallel.RowParallelLinear(4 * world, 6, config=cfg, init_method=init, bias=True,
                                              input_is_parallel=True, skip_bias_add=False)
    with torch.no_grad():
        m_col.bias.normal_()
        m_row.bias.normal_()
    col = ColumnParallelLinear(6, 4 * world, tp, method="baseline", dtype=torch.float64)
    row = RowParallelLinear(4 * world, 6, tp, method="baseline", dtype=torch.float64)
    results = {}
    for name, ours, theirs in (("column", col, m_col), ("row", row, m_row)):
        sd = theirs.state_dict()
        assert set(sd) == set(ours.state_dict()), (name, sorted(sd), sorted(ours.state_dict()))
        ours.load_state_dict(sd)  # Megatron -> ours, _extra_state included
        theirs.load_state_dict(ours.state_dict())  # and back
        # the size and flag attributes code written against Megatron's linears reads
        for attr in ("input_size", "output_size", "sequence_parallel") + (
                ("output_size_per_partition", "gather_output") if ours is col else
                ("input_size_per_partition", "input_is_parallel")):
            assert getattr(ours, attr) == getattr(theirs, attr), (name, attr)
        for p_ours, (pname, p_theirs) in zip(ours.parameters(), theirs.named_parameters()):
            assert getattr(p_theirs, "partition_dim", None) == getattr(p_ours, "partition_dim", None), (name, pname)
        results[name] = (ours, theirs)
    if planted:  # a weight that did not quite make it across: the comparison below must notice
        with torch.no_grad():
            row.weight[0, 0] += 1e-9
    x = torch.randn(5, 2, 6, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for ours, theirs in (results["column"], results["row"]):
        xin = x if ours is col else torch.randn(5, 2, 4, dtype=torch.float64,
                                                generator=torch.Generator().manual_seed(2 + rank))
        xo, xt = xin.clone().requires_grad_(), xin.clone().requires_grad_()
        yo = ours(xo)
        yt, bias = theirs(xt)
        yt = yt if bias is None else yt + bias
        torch.testing.assert_close(yo, yt, atol=1e-12, rtol=1e-12)
        g = torch.randn(yo.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(9))
        yo.backward(g)
        yt.backward(g)
        torch.testing.assert_close(xo.grad, xt.grad, atol=1e-12, rtol=1e-12)
        for po, pt in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(po.grad, _their_grad(pt), atol=1e-12, rtol=1e-12)
    return True


def test_megatron_state_dicts_interchange(rank_pool):
    assert rank_pool(2).run(_megatron_linears_on_rank) == [True, True]


def _megatron_embedding_on_rank(planted=False):
    """Megatron's embedding has ``weight`` only (no ``_extra_state``, unlike its linears): strict
    loads both ways, the same rows per rank, the same output and weight gradient."""
    from megatron.core import tensor_parallel

    world, tp, cfg = _megatron_tp()
    torch.manual_seed(0)
    theirs = tensor_parallel.VocabParallelEmbedding(5 * world, 3, init_method=torch.nn.init.normal_, config=cfg)
    ours = VocabParallelEmbedding(5 * world, 3, tp, dtype=torch.float64)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict()) == ["weight"]
    ours.load_state_dict(theirs.state_dict())
    theirs.load_state_dict(ours.state_dict())
    assert (ours.vocab_start_index, ours.vocab_end_index) == (theirs.vocab_start_index, theirs.vocab_end_index)
    if planted:  # rows a hair off: the comparison below must notice
        with torch.no_grad():
            ours.weight.add_(1e-9)
    tokens = torch.randint(0, 5 * world, (2, 7), generator=torch.Generator().manual_seed(3))
    y_ours, y_theirs = ours(tokens), theirs(tokens)
    torch.testing.assert_close(y_ours, y_theirs, atol=0, rtol=0)  # one nonzero row per token: the sum is exact
    g = torch.randn(y_ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    y_ours.backward(g)
    y_theirs.backward(g)
    torch.testing.assert_close(ours.weight.grad, _their_grad(theirs.weight), atol=1e-12, rtol=1e-12)
    return True


def test_megatron_embedding_state_dict_interchanges(rank_pool):
    assert rank_pool(2).run(_megatron_embedding_on_rank) == [True, True]


def _planted_on_rank(case):
    with pytest.raises(AssertionError, match="Tensor-likes are not"):
        case(planted=True)
    return True


@pytest.mark.parametrize("case", [_megatron_linears_on_rank, _megatron_embedding_on_rank], ids=["linears", "embedding"])
def test_planted_error_is_caught(rank_pool, case):
    assert rank_pool(2).run(_planted_on_rank, case) == [True, True]
