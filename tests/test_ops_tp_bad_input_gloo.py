"""The TP ops' bad input on gloo ranks: all_gather_matmul / matmul_reduce_scatter, their *_linear
forms (the parallel layers' ops) and the raw collectives under them refuse wrong shapes, dtypes,
devices, methods, groups and DTensors by name before any rank communicates; and the guard those
checks rely on (``no_communication``) catches every way the package communicates. The numerics:
test_ops_tp_gloo.py."""
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.comm import collectives
from overlapkernels.ops.all_gather_matmul import all_gather_linear
from overlapkernels.ops.matmul_reduce_scatter import linear_reduce_scatter
from comm_guard import Communicated, no_communication


# ----------------------------------------------------------------------------------- bad input
BAD_AG = [
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(9, 3)), ValueError,
     r"b.shape\[0\]=9 does not match a_shard.shape\[-1\]=8 \(the contracted dim K\)"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3, 2)), ValueError,
     r"b must be 2-D \[K, N\], got shape \(8, 3, 2\)"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), [torch.ones(8, 3), torch.ones(7, 3)]), ValueError,
     r"b\[1\].shape\[0\]=7 does not match"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), gather_dim=1), ValueError,
     r"gather_dim=1 is the last dim of a_shard"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), gather_dim=-1), ValueError,
     r"gather_dim=-1 is the last dim of a_shard, which the matmul contracts; expected one of 0..0 \(or -2..-2\)"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), gather_dim=2), ValueError,
     r"gather_dim=2 is out of range for a_shard with 2 dims"),
    (lambda: ok.all_gather_matmul(torch.ones(8), torch.ones(8, 3)), ValueError,
     r"a_shard must have at least 2 dims, got shape \(8,\)"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3, dtype=torch.float64)), ValueError,
     r"b.dtype=torch.float64 does not match a_shard.dtype=torch.float32"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3, device="meta")), ValueError,
     r"b is on meta but a_shard is on cpu"),
    (lambda: ok.all_gather_matmul([[1.0]], torch.ones(1, 3)), TypeError, r"a_shard must be a torch.Tensor, got list"),
    # sparse or nested operands: decomposed failed after its ring had started, baseline took a sparse b
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.eye(8).to_sparse(), method="decomposed"), TypeError,
     r"^b is a sparse_coo tensor; these ops take dense \(strided\) tensors"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.eye(8).to_sparse()), TypeError,
     r"^b is a sparse_coo tensor"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8).to_sparse(), torch.ones(8, 2)), TypeError,
     r"^a is a sparse_coo tensor"),
    # any non-strided layout, and nested tensors (strided, but ragged): not only COO
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.eye(8).to_sparse_csr()), TypeError,
     r"^b is a sparse_csr tensor; these ops take dense \(strided\) tensors"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8).to_sparse_csr(), torch.ones(8, 2)), TypeError,
     r"^a is a sparse_csr tensor"),
    (lambda: ok.all_gather_matmul(torch.nested.nested_tensor([torch.ones(2, 8), torch.ones(3, 8)]), torch.ones(8, 3),
                                  method="decomposed"), TypeError, r"^a_shard is a nested tensor"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), "w"), TypeError, r"b must be a \[K, N\] tensor or a non-empty"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), []), TypeError, r"non-empty list/tuple of them, got list \(empty\)"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), gather_dim=0.0), TypeError,
     r"gather_dim must be an int, got float"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), method="flux"), ValueError,
     r"method='flux': expected one of \['auto', 'baseline', 'decomposed', 'symm', 'fused'\]"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), method="fused"), ValueError,
     r"method=.fused. needs peer memory .*: tensors are on cpu, peer memory needs CUDA"),
    # bf16 on a process group: what fused lacks there is peer memory, whatever the dtype
    (lambda: ok.all_gather_matmul(torch.ones(4, 8, dtype=torch.bfloat16), torch.ones(8, 3, dtype=torch.bfloat16),
                                  method="fused"), ValueError, r"^method=.fused. needs peer memory .*: tensors are on cpu"),
    # and fp64 (which fused refuses too): it was told to try 'symm', which a process group lacks as well
    (lambda: ok.all_gather_matmul(torch.ones(4, 8, dtype=torch.float64), torch.ones(8, 3, dtype=torch.float64),
                                  method="fused"), ValueError, r"^method=.fused. needs peer memory .*: tensors are on cpu"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), save_gathered="no"), TypeError,
     r"^save_gathered='no': expected a bool"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), return_gathered=1), TypeError,
     r"^return_gathered=1: expected a bool$"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(5, 8), torch.ones(8, 3)), ValueError,
     r"a.shape\[scatter_dim=0\]=5 is not divisible by the group size 2"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(5, 8), torch.ones(8, 3), scatter_dim=-2), ValueError,
     r"^a.shape\[scatter_dim=-2\]=5 is not divisible by the group size 2$"),  # the caller's value, as passed
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 3), scatter_dim=1), ValueError,
     r"^b.shape\[1\]=3 \(N, the output's scatter_dim=1\) is not divisible by the group size 2$"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 4), scatter_dim=2), ValueError,
     r"^scatter_dim=2 is out of range for a with 2 dims$"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(7, 3)), ValueError,
     r"b.shape\[0\]=7 does not match a.shape\[-1\]=8"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), [torch.ones(8, 3)]), TypeError,
     r"b must be a single \[K, N\] tensor, got list"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8, dtype=torch.float16), torch.ones(8, 3)), ValueError,
     r"b.dtype=torch.float32 does not match a.dtype=torch.float16"),
    # fp8 has no scales here; integers have no place in a matmul: refused before the collective
    # (they failed inside gloo, or for decomposed reduce-scatter after the ring had started)
    (lambda: ok.all_gather_matmul(torch.ones(4, 8, dtype=torch.float8_e4m3fn), torch.ones(8, 3, dtype=torch.float8_e4m3fn)),
     ValueError, r"a_shard.dtype=torch.float8_e4m3fn: expected one of \['torch.float16', 'torch.bfloat16', "
                 r"'torch.float32', 'torch.float64'\]"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8, dtype=torch.float8_e5m2), torch.ones(8, 3, dtype=torch.float8_e5m2),
                                      method="decomposed"), ValueError, r"a.dtype=torch.float8_e5m2: expected one of"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8, dtype=torch.int64), torch.ones(8, 3, dtype=torch.int64)),
     ValueError, r"a.dtype=torch.int64: expected one of"),
    # the *_linear forms (the parallel layers' ops) name their own operands and F.linear's [N, K] weights
    (lambda: all_gather_linear(torch.ones(4, 8), [torch.ones(3, 8), torch.ones(3, 9)]), ValueError,
     r"^weight\[1\].shape\[1\]=9 does not match x_shard.shape\[-1\]=8 \(the contracted dim K\)"),
    (lambda: all_gather_linear(torch.ones(4, 8), torch.ones(3, 8)), TypeError,
     r"^weights must be a list/tuple of \[N, K\] tensors sharing the gather, got a single tensor \(pass \[weight\]\)"),
    (lambda: all_gather_linear(torch.ones(8), [torch.ones(3, 8)]), ValueError, r"^x_shard must have at least 2 dims"),
    (lambda: all_gather_linear(torch.ones(4, 8), [torch.ones(3, 8, dtype=torch.float64)]), ValueError,
     r"^weight\[0\].dtype=torch.float64 does not match x_shard.dtype=torch.float32"),
    (lambda: linear_reduce_scatter(torch.ones(4, 8), torch.ones(8, 3)), ValueError,
     r"^weight.shape\[1\]=3 does not match x.shape\[-1\]=8 \(the contracted dim K\)"),
    (lambda: linear_reduce_scatter(torch.ones(4, 8), torch.ones(3, 8), scatter_dim=-1), ValueError,
     r"^weight.shape\[0\]=3 \(N, the output's scatter_dim=-1\) is not divisible by the group size 2$"),
    (lambda: linear_reduce_scatter(torch.ones(4, 8), torch.ones(3, 8, 1)), ValueError,
     r"^weight must be 2-D \[N, K\], got shape \(3, 8, 1\)"),
    (lambda: linear_reduce_scatter(torch.ones(4, 8), [torch.ones(3, 8)]), TypeError,
     r"^weight must be a single \[N, K\] tensor, got list"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), "w"), TypeError, r"^b must be a single \[K, N\] tensor, got str$"),
    (lambda: all_gather_linear(torch.ones(4, 8), torch.ones(3, 9)), TypeError,  # a bare tensor, whatever its shape
     r"^weights must be a list/tuple of \[N, K\] tensors sharing the gather, got a single tensor \(pass \[weight\]\)"),
    (lambda: all_gather_linear(torch.ones(4, 8), []), TypeError,
     r"^weights must be a non-empty list/tuple of \[N, K\] tensors, got list \(empty\)$"),
    (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), 3), TypeError,
     r"group=3: expected a torch.distributed ProcessGroup or None .*got int"),
    (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 3), "tp"), TypeError,
     r"group='tp': expected a torch.distributed ProcessGroup or None"),
    # the raw collectives under the ops (comm.collectives)
    (lambda: collectives.reduce_scatter(torch.ones(3, 2)), ValueError,
     r"^reduce_scatter: x.shape\[0\]=3 is not divisible by the group size 2$"),
    (lambda: collectives.all_to_all(torch.ones(5)), ValueError,
     r"^all_to_all: x.shape\[0\]=5 is not divisible by the group size 2$"),
]


def _bad_inputs_on_rank():
    import re

    ok.reset_overlap_stats()
    for i, (call, exc_type, pattern) in enumerate(BAD_AG):
        try:
            with no_communication():  # refused before any collective, not after one every rank ran
                call()
        except exc_type as exc:
            assert re.search(pattern, str(exc)), (i, str(exc))
        else:
            raise AssertionError(f"case {i}: no {exc_type.__name__}")
    # a DTensor (its own placements) is refused by name, not deep inside torch's sharding rules
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    dt = DTensor.from_local(torch.ones(2, 8), mesh, [Shard(0)], run_check=False)
    for call, pattern in ((lambda: ok.all_gather_matmul(dt, torch.ones(8, 3)), r"a_shard is a DTensor \(\(Shard\(dim=0\),\)\); "
                           r"pass its local part \(a_shard.to_local\(\)\)"),
                          (lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), dt.T), r"b is a DTensor"),
                          (lambda: ok.ring_attention(dt.view(1, 4, 1, 8), torch.ones(1, 2, 1, 8), torch.ones(1, 2, 1, 8)),
                           r"q is a DTensor")):
        try:
            with no_communication():
                call()
        except TypeError as exc:
            assert re.search(pattern, str(exc)), str(exc)
        else:
            raise AssertionError(f"no TypeError for {pattern}")
    assert ok.overlap_stats() == {}, ok.overlap_stats()  # a call that raised never ran: not counted
    # divisible by the group's size, not the world's: 3 rows (or N = 3) scatter over a group of one rank
    one = ok.init_parallel().tp_group
    for dim in (0, 1):
        got = ok.matmul_reduce_scatter(torch.ones(3, 8), torch.ones(8, 3), one, scatter_dim=dim)
        assert torch.equal(got, torch.full((3, 3), 8.0)), (dim, got)
    ok.reset_overlap_stats()
    with no_communication():
        assert collectives.all_reduce_coalesced([]) is None  # nothing to sum: a no-op, not torch.cat's error
    total = torch.ones(1)
    dist.all_reduce(total)  # no rank communicated before raising: the group is still in step
    return int(total)


def test_bad_input_raises_before_communicating(rank_pool):
    assert rank_pool(2).run(_bad_inputs_on_rank) == [2, 2]


def _guard_bites_on_rank():
    """``no_communication`` (used by every bad-input test) must catch each way the package
    communicates: a collective through a ``_compat`` alias, a P2P ring, a plain ``dist.all_reduce``,
    and one whose error the caller swallowed; and leave torch.distributed as it was afterwards."""
    import re

    from overlapkernels import _compat
    from overlapkernels.runtime.fsdp import flat_unit

    before = {name: getattr(dist, name, None) for name in ("all_gather_single", "reduce_scatter_single",  # torch>=2.13
                                                           "all_reduce", "batch_isend_irecv", "isend", "P2POp")}
    a, b = torch.ones(4, 8), torch.ones(8, 3)

    def swallowed():
        try:
            collectives.all_reduce(torch.ones(2))
        except AssertionError:
            raise ValueError("what a careless caller might turn it into") from None

    caught = []
    for call, name in ((lambda: ok.all_gather_matmul(a, b, method="baseline"), r"all_gather_(single|into_tensor)"),
                       (lambda: ok.matmul_reduce_scatter(a, b, method="baseline"), r"reduce_scatter_(single|tensor)"),
                       (lambda: ok.all_gather_matmul(a, b, method="decomposed"), r"P2POp|batch_isend_irecv"),
                       (lambda: ok.ring_attention(*[torch.ones(1, 2, 1, 4)] * 3), r"P2POp|batch_isend_irecv"),
                       (lambda: ok.vocab_parallel_cross_entropy(torch.ones(2, 3), torch.zeros(2, dtype=torch.long)),
                        r"\ball_reduce\b"),
                       (lambda: collectives.all_gather_objects(1), r"all_gather_object"),
                       (swallowed, r"\ball_reduce\b")):
        try:
            with no_communication():
                call()
        except Communicated as exc:
            assert re.search(name, str(exc)), (name, str(exc))
            caught.append(True)
        else:
            caught.append(False)
    assert all(getattr(dist, n, None) is f for n, f in before.items()), "no_communication left torch.distributed patched"
    assert _compat.all_gather_single is collectives.all_gather_single is flat_unit.all_gather_single
    assert _compat.reduce_scatter_single is collectives.reduce_scatter_single is flat_unit.reduce_scatter_single
    assert collectives.all_gather_single in (dist.all_gather_single if hasattr(dist, "all_gather_single") else None,
                                             dist.all_gather_into_tensor)
    got = ok.all_gather_matmul(a, b, method="decomposed")  # the real collectives again
    assert torch.equal(got, torch.full((4 * dist.get_world_size(), 3), 8.0))
    return caught


def test_communication_guard_bites(rank_pool):
    assert rank_pool(2).run(_guard_bites_on_rank) == [[True] * 7] * 2


def _failing_chunk_on_rank():
    """An error in a decomposed ring step's compute (an out-of-memory) after the step's exchange was
    posted: the exchange is waited for before the error propagates, so the group's next collective
    runs (it hung on every rank: gloo's pair is unusable after an unwaited exchange). The compute
    streams are joined too (on CUDA the buffers are freed on the main stream while earlier steps'
    GEMMs may still run on the side one): recorded by a stand-in, as CPU has one stream."""
    from overlapkernels.ops import _collective_methods
    from overlapkernels.ops._collective_methods import ring_all_gather

    joins = []

    class RecordedStreams(_collective_methods._ComputeStreams):
        def join(self):
            joins.append(True)
            super().join()

    def on_chunk(c, chunk):
        if c != dist.get_rank():  # a received chunk: the next exchange is in flight
            raise RuntimeError("planted: out of memory")

    real, _collective_methods._ComputeStreams = _collective_methods._ComputeStreams, RecordedStreams
    try:
        ring_all_gather(torch.ones(2, 3), dist.group.WORLD, on_chunk)
        said = "no error"
    except RuntimeError as exc:
        said = str(exc)
    finally:
        _collective_methods._ComputeStreams = real
    dist.barrier()
    return said, joins


def test_an_error_inside_a_decomposed_step_leaves_the_group_usable(rank_pool):
    assert rank_pool(4).run(_failing_chunk_on_rank) == [("planted: out of memory", [True])] * 4
