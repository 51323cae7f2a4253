"""init_parallel: mesh layouts (tp innermost), groups that really communicate, bad sizes."""
import os
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.parallel import AXES, resolve_group, resolve_sizes


MESH_ORDER = ("dp", "pp", "cp", "tp")  # the mesh, outermost first: written out, not AXES


def expected_layout(world, sizes):
    """Rank grid in (dp, pp, cp, tp) row-major order: tp varies fastest."""
    assert AXES == MESH_ORDER
    grid = torch.arange(world).reshape([sizes[a] for a in MESH_ORDER])
    out = {}
    for rank in range(world):
        coord = [int(c) for c in (grid == rank).nonzero()[0]]
        out[rank] = {}
        for i, axis in enumerate(MESH_ORDER):
            index = list(coord)
            index[i] = slice(None)
            out[rank][axis] = (coord[i], grid[tuple(index)].tolist())
    return out


def _layout_on_rank(kwargs):
    dims = ok.init_parallel(**kwargs)
    assert dims.rank == dist.get_rank()  # the world rank, whatever the layout
    result = {"sizes": {a: getattr(dims, f"{a}_size") for a in AXES}, "world": dims.world_size}
    for axis in AXES:
        group = getattr(dims, f"{axis}_group")
        members = dist.get_process_group_ranks(group)
        # prove the group communicates with exactly those members
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total, group=group)
        result[axis] = (getattr(dims, f"{axis}_rank"), members, int(total))
    return result


LAYOUTS = [dict(), dict(tp=2), dict(tp=4), dict(cp=2), dict(pp=2), dict(tp=2, cp=2), dict(tp=2, pp=2),
           dict(cp=2, pp=2), dict(pp=2, dp=2), dict(tp=2, dp=2), dict(dp=4)]


@pytest.mark.parametrize("kwargs", LAYOUTS, ids=lambda k: ",".join(f"{a}{v}" for a, v in k.items()) or "default")
def test_layouts_on_4_ranks(rank_pool, kwargs):
    results = rank_pool(4).run(_layout_on_rank, kwargs)
    sizes = resolve_sizes(4, **{"tp": 1, "cp": 1, "pp": 1, "dp": -1, **kwargs})
    expected = expected_layout(4, sizes)
    for rank, res in enumerate(results):
        assert res["sizes"] == sizes and res["world"] == 4
        for axis in AXES:
            axis_rank, members = expected[rank][axis]
            assert res[axis] == (axis_rank, members, sum(members)), (rank, axis)


def test_tp_is_innermost(rank_pool):
    res = rank_pool(4).run(_layout_on_rank, dict(tp=2))
    assert [r["tp"][1] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"][1] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    res = rank_pool(4).run(_layout_on_rank, dict(cp=2, pp=2))  # cp inside pp
    assert [r["cp"][1] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["pp"][1] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "does not divide world size 4"),
    (dict(tp=2, cp=2, dp=2), "= 8 != world size 4"),
    (dict(tp=0), "tp=0"),
    (dict(cp=-1), "cp=-1"),
    (dict(pp=1.5), "pp=1.5"),
    (dict(dp=0), "dp=0"),
    (dict(dp=-2), "dp=-2"),
    (dict(tp=True), "tp=True: every axis size must be an integer >= 1"),  # True == 1, yet not a size
    (dict(dp=True), "dp=True: expected an integer >= 1"),
])
def test_bad_sizes_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        resolve_sizes(4, **{"tp": 1, "cp": 1, "pp": 1, "dp": -1, **kwargs})


def _bad_init_on_rank():
    try:
        ok.init_parallel(tp=3)
    except ValueError as exc:
        # the error came before any collective: the group still works and no peer is waiting
        one = torch.ones(1)
        dist.all_reduce(one)
        return str(exc), int(one)
    return None, None


def test_bad_layout_raises_on_every_rank_before_communicating(rank_pool):
    for message, total in rank_pool(4).run(_bad_init_on_rank):
        assert "tp*cp*pp = 3*1*1 = 3 does not divide world size 4" in message
        assert total == 4


def test_an_axis_that_is_not_a_mesh_axis_is_named(world_of_one):
    dims = ok.init_parallel()
    for ask in (dims.group, dims.axis_rank):
        with pytest.raises(ValueError, match=r"^axis='ep' is not a mesh axis; expected one of \('dp', 'pp', 'cp', 'tp'\)$"):
            ask("ep")


def _default_group_on_rank():
    return resolve_group(None) is dist.group.WORLD, dist.get_world_size(resolve_group(None))


def test_group_none_is_world(rank_pool):
    assert rank_pool(2).run(_default_group_on_rank) == [(True, 2), (True, 2)]


def _non_member_group_on_rank():
    """Rank 1 is outside new_group([0]): an op given that group says so, before communicating."""
    sub = dist.new_group([0])
    if dist.get_rank() == 0:
        return float(ok.all_gather_matmul(torch.ones(2, 3), torch.ones(3, 1), sub).sum())
    try:
        ok.all_gather_matmul(torch.ones(2, 3), torch.ones(3, 1), sub)
    except ValueError as exc:
        return str(exc)


def test_a_group_this_rank_is_not_in_is_named(rank_pool):
    on_member, on_other = rank_pool(2).run(_non_member_group_on_rank)
    assert on_member == 6.0
    assert on_other.startswith("group: this rank is not a member of the group"), on_other


def test_group_none_before_any_process_group_says_how_to_make_one(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"no default process group: call ok.init_parallel\(\)"):
        resolve_group(None)


def test_single_process_without_launcher():
    """No torchrun environment: a world of one on gloo, every axis of size 1; asking for more ranks
    says that no launcher started them."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    code = ("import overlapkernels as ok, torch.distributed as dist\n"
            "try:\n    ok.init_parallel(tp=2)\nexcept ValueError as exc:\n    print(exc)\n"
            "from overlapkernels import _compat\nbefore = _compat._gloo_exit_grace['registered']\n"
            "d = ok.init_parallel()\nprint(d.world_size, d.tp_size, d.dp_size, d.tp_rank, dist.get_backend(), before, "
            "_compat._gloo_exit_grace['registered'])")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    refused, made = out.stdout.strip().splitlines()
    assert refused == ("tp*cp*pp = 2*1*1 = 2 does not divide world size 1: no launcher set WORLD_SIZE, so this is a "
                       "1-rank world; start the ranks with torchrun --nproc-per-node N (or set RANK, WORLD_SIZE, "
                       "MASTER_ADDR and MASTER_PORT)")
    # and on gloo the pause at exit that lets its worker threads free their last tensors (pytorch#190489)
    assert made.split() == ["1", "1", "1", "0", "gloo", "False", "True"]


def _timeouts_on_rank(kwargs):
    from overlapkernels._compat import group_timeout
    dims = ok.init_parallel(**kwargs)
    world = group_timeout(dist.group.WORLD).total_seconds()
    return world, {axis: group_timeout(getattr(dims, f"{axis}_group")).total_seconds() for axis in AXES}


def test_mesh_groups_take_the_default_groups_timeout(rank_pool):
    """DeviceMesh would give its groups the backend's default (30 min on gloo) whatever the
    default group has; without a timeout they get the default group's."""
    for world, axes in rank_pool(4).run(_timeouts_on_rank, dict(tp=2)):
        assert world != 1800 and set(axes.values()) == {world}, (world, axes)


def test_timeout_reaches_every_mesh_group(rank_pool):
    for world, axes in rank_pool(4).run(_timeouts_on_rank, dict(tp=2, cp=2, timeout=7.5)):
        assert axes == {"dp": 7.5, "pp": 7.5, "cp": 7.5, "tp": 7.5}


def _absent_peer_on_rank(timeout, call="collective"):
    dims = ok.init_parallel(tp=2, timeout=timeout)  # TP groups {0, 1} and {2, 3}, not the pool's world
    if dist.get_rank() == 1:
        return None  # never joins: rank 0's collective must time out, not hang
    try:
        if call == "collective":
            dist.all_reduce(torch.ones(1), group=dims.tp_group)
        elif call == "decomposed":  # the ring of P2P steps
            ok.all_gather_matmul(torch.ones(2, 4), torch.ones(4, 3), dims.tp_group, method="decomposed")
        else:
            q = torch.ones(1, 2, 1, 4)
            ok.ring_attention(q, q, q, dims.tp_group)
    except RuntimeError as exc:
        return str(exc)
    return "completed"


@pytest.mark.parametrize("call", ["collective", "decomposed", "ring_attention"])
def test_a_collective_without_its_peer_times_out(rank_pool, call):
    """The ring's P2P steps too: gloo bounded their waits only by the timeout the group was created
    with (30 minutes for a mesh group), not init_parallel's."""
    message, absent, *_ = rank_pool(4).run(_absent_peer_on_rank, 0.5, call, timeout=60)
    assert "completed" not in message and "timed out" in message.lower(), message
    assert absent is None  # ranks 2 and 3 (the other TP group) may finish or time out: 0.5 s is short


@pytest.mark.parametrize("timeout, error, message", [
    (0, ValueError, "timeout=0: expected a finite duration of at least 1 ms"),
    (1e-7, ValueError, "timeout=1e-07: expected a finite duration of at least 1 ms"),
    (0.0005, ValueError, "timeout=0.0005: expected a finite duration of at least 1 ms"),  # gloo: whole ms
    (float("inf"), ValueError, "timeout=inf"),
    (float("nan"), ValueError, "timeout=nan"),
    (1e15, ValueError, "timeout=1000000000000000.0: expected a finite"),
    (timedelta(seconds=-1), ValueError, "at least 1 ms"),
    ("60", TypeError, "timeout='60': expected seconds"),
    (True, TypeError, "timeout=True"),
])
def test_bad_timeout_raises_before_communicating(timeout, error, message):
    with pytest.raises(error, match=message):
        ok.init_parallel(timeout=timeout)


def _timeouts_under_distributed_debug():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL wraps every new group in a checking wrapper, past which
    torch's own _set_pg_timeout does not reach; ours does."""
    from overlapkernels._compat import group_timeout

    import warnings

    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    try:
        with warnings.catch_warnings(record=True) as said:  # (not "cannot set the timeout": set past the wrapper)
            warnings.simplefilter("always")
            dims = ok.init_parallel(tp=2, timeout=7.5)
    finally:
        dist.set_debug_level(level)
    backend = dims.tp_group._get_backend(torch.device("cpu"))
    return type(backend).__name__, group_timeout(dims.tp_group).total_seconds(), [str(w.message) for w in said]


def test_timeout_reaches_groups_under_distributed_debug(rank_pool):
    for wrapper, seconds, said in rank_pool(4).run(_timeouts_under_distributed_debug):
        assert wrapper == "_ProcessGroupWrapper" and seconds == 7.5 and said == [], said


def test_launch_environment_problems_are_named(monkeypatch):
    """Refused before any process group is created (so nothing to clean up here)."""
    from overlapkernels import parallel

    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="sets WORLD_SIZE but not all of RANK, WORLD_SIZE, MASTER_ADDR and "
                                         "MASTER_PORT: launch with torchrun"):
        parallel.init_default_process_group("gloo")
    # three of the four (MASTER_ADDR lost): each process would otherwise start a world of its own
    for name, value in (("RANK", "1"), ("MASTER_PORT", "29500")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match="sets RANK, WORLD_SIZE, MASTER_PORT but not all of RANK, WORLD_SIZE, "
                                         "MASTER_ADDR and MASTER_PORT"):
        parallel.init_default_process_group("gloo")
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("MASTER_PORT")
    if not torch.cuda.is_available():  # in any spelling torch takes (the check and set_device were skipped)
        for spelling in ("nccl", "NCCL", "cpu:gloo,cuda:nccl"):
            with pytest.raises(ValueError, match=f"backend='{spelling}' needs CUDA GPUs, and this process sees none"):
                parallel.init_default_process_group(spelling)
    # more ranks on the node than GPUs: refused by name before the process group (or a GPU) is taken
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: pytest.fail(f"set_device({index})"))
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda *a, **k: pytest.fail("init_process_group"))
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(ValueError, match=r"^LOCAL_RANK=5: this process sees 4 GPUs \(0..3\); start at most 4 ranks"):
        parallel.init_default_process_group("nccl")


def test_nccl_is_recognised_in_every_spelling_of_the_backend(world_of_one, monkeypatch):
    """`init_process_group()` with no backend reads 'undefined' and torchtitan's reads
    'cpu:gloo,cuda:nccl': both move CUDA tensors with NCCL, and an exact compare with 'nccl' read
    them as CPU-only (the mesh, the trainer and the benchmarks then ran on the CPU). gloo alone
    maps CUDA to gloo too (host copies): not NCCL. Under TORCH_DISTRIBUTED_DEBUG=DETAIL the backend
    objects are wrapped, so only the backend config can tell."""
    import re
    from pathlib import Path

    from overlapkernels import parallel

    world = dist.group.WORLD
    assert dist.get_backend_config(world) == "cpu:gloo,cuda:gloo"
    assert not parallel.uses_nccl() and parallel.comm_device() == torch.device("cpu")  # gloo
    for config, nccl, gloo in (("cpu:gloo,cuda:nccl", True, True), ("cuda:nccl", True, False),
                               ("cpu:gloo", False, True), ("cpu:gloo,cuda:gloo", False, True)):
        monkeypatch.setattr(parallel.dist, "get_backend_config", lambda group=None, c=config: c)
        assert parallel.uses_nccl(world) is nccl, config
        assert parallel.uses_gloo(world) is gloo, config  # gloo's threads need the pause at exit
    # and nothing in the package compares the backend's name exactly any more
    package = Path(parallel.__file__).parent
    exact = [f"{path.relative_to(package)}:{n}" for path in package.rglob("*.py")
             for n, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"get_backend\([^)]*\)\s*[=!]=", line)]
    assert exact == [], exact


@pytest.mark.parametrize("env, gpus, want", [
    ({"LOCAL_RANK": "3"}, 8, 3),                                    # torchrun
    ({"SLURM_LOCALID": "5"}, 8, 5),                                 # srun sets no LOCAL_RANK
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 4, 2),                    # mpirun
    ({"OMPI_COMM_WORLD_LOCAL_RANK": "2", "SLURM_LOCALID": "0"}, 4, 2),  # mpirun inside a Slurm allocation
    ({"MPI_LOCALRANKID": "3", "SLURM_LOCALID": "0"}, 4, 3),     # MPICH / Intel MPI there
    ({"LOCAL_RANK": "1", "SLURM_LOCALID": "6"}, 8, 1),              # torchrun inside an allocation
    ({"LOCAL_RANK": "", "SLURM_LOCALID": "2"}, 4, 2),               # set but empty: the next launcher's
    ({"LOCAL_RANK": "3"}, 1, 0),                                    # one visible GPU per process
    ({}, 8, 0),
    ({"LOCAL_RANK": "5"}, 4, "LOCAL_RANK=5: this process sees 4 GPUs"),  # more ranks than GPUs
])
def test_each_process_takes_its_gpu_whichever_launcher_started_it(monkeypatch, env, gpus, want):
    from overlapkernels import parallel

    for name in parallel.LOCAL_RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    if isinstance(want, str):
        with pytest.raises(ValueError, match=want):
            parallel.local_device_index()
    else:
        assert parallel.local_device_index() == want


def _collectives_edges_on_rank():
    """all_to_all of a strided x came back scrambled (its output kept x's strides, which the
    collective fills as if dense); all_reduce_coalesced summed an int64 beside an fp32 in fp32
    (low bits lost); a ring exchange of strided tensors failed inside gloo; a 0-d x failed with an
    IndexError."""
    from overlapkernels.comm import collectives as C
    from overlapkernels.comm.ring import Ring, wait_all

    r, w = dist.get_rank(), dist.get_world_size()
    base = torch.arange(8.0).reshape(2, 4) + 100 * r
    out, _ = C.all_to_all(base.t())  # [4, 2], strides (1, 4)
    everyone = [(torch.arange(8.0).reshape(2, 4) + 100 * q).t() for q in range(w)]
    want = torch.cat([x.chunk(w)[r] for x in everyone])
    counter, loss = torch.tensor([2 ** 24 + 1 + r], dtype=torch.int64), torch.tensor([0.5])
    C.all_reduce_coalesced([counter, loss])
    ring = Ring.of(dist.group.WORLD)
    recv = torch.zeros(2, 4).t()  # [4, 2] strided, as the send
    wait_all(ring.exchange(base.t(), (r + 1) % w, recv, (r - 1) % w))
    try:
        C.all_gather(torch.tensor(1.0))
        zero_d = "ran"
    except ValueError as exc:
        zero_d = str(exc)
    return (torch.equal(out, want), int(counter) == 2 * (2 ** 24 + 1) + sum(range(w)), float(loss) == 0.5 * w,
            torch.equal(recv, everyone[(r - 1) % w]), zero_d)


def test_collectives_on_strided_mixed_and_0d_tensors(rank_pool):
    want = (True, True, True, True, "all_gather: x is 0-d; expected a tensor with a dim 0 to gather or split along "
                                    "(x.reshape(1))")
    assert rank_pool(2).run(_collectives_edges_on_rank) == [want, want]


def test_a_backend_that_disagrees_with_the_existing_group_is_refused(world_of_one):
    """init_parallel(backend="nccl") returned a CPU mesh over an existing gloo group without a word."""
    with pytest.raises(ValueError, match="backend='nccl': the default process group already exists with backend "
                                         "'gloo'; pass backend=None to use it"):
        ok.init_parallel(backend="nccl")
    assert ok.init_parallel(backend="gloo").tp_size == 1  # agreeing: fine


def test_a_group_that_is_not_a_process_group_is_named():
    with pytest.raises(TypeError, match=r"^tp_group=1: expected a torch.distributed ProcessGroup or None \(for a "
                                        r"DeviceMesh dimension pass mesh.get_group\(dim\)\), got int$"):
        resolve_group(1, "tp_group")
