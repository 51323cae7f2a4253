"""How the TP ops choose and police their method, on gloo ranks and in-process: auto's rules and
strict mode, overlap_stats and its reasons, the process world's peer-memory rules (kinds,
timeouts, nodes, torch 2.11's pooled symmetric memory), and the cross-rank call check under
TORCH_DISTRIBUTED_DEBUG=DETAIL. Measured auto: test_ops_measured_auto_gloo.py; the numerics:
test_ops_tp_gloo.py.
"""
import math
import os

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.layers import RowParallelLinear


# ------------------------------------------------------------------------- auto, stats, strict mode
def _auto_and_strict_on_rank():
    ok.reset_overlap_stats()
    small = torch.ones(4, 8, dtype=torch.float64)
    big = torch.ones(128, 512, dtype=torch.float64)  # 512 KiB ring messages, 0.75 flop/B: decomposed pays off
    w_small, w_big = torch.ones(8, 3, dtype=torch.float64), torch.ones(512, 3, dtype=torch.float64)
    ok.all_gather_matmul(small, w_small)
    ok.all_gather_matmul(big, w_big)
    ok.all_gather_matmul(small, w_small, method="decomposed")
    stats = ok.overlap_stats()
    try:
        with ok.strict_overlap():
            ok.all_gather_matmul(big, w_big)  # fine: overlapped
            ok.all_gather_matmul(small, w_small, method="baseline")  # explicit: not a fallback
            ok.all_gather_matmul(small, w_small)
        strict_error = None
    except ok.StrictOverlapError as exc:
        strict_error = str(exc)
    # the refused call never ran: only the two strict calls that did are counted
    ran = {("all_gather_matmul", "decomposed"): 1, ("all_gather_matmul", "baseline"): 1}
    assert dict(ok.overlap_stats()) == {k: stats.get(k, 0) + ran.get(k, 0) for k in {*stats, *ran}}
    return dict(stats), {k: list(v) for k, v in stats.reasons.items()}, strict_error, _strict_backward_error()


def _strict_backward_error():
    """On CUDA the autograd engine runs backward on its own thread, where strict_overlap()'s
    context is unset: the op must carry forward's strictness into its backward. K = 1024: the
    forward matmul + reduce-scatter overlaps (256 flop/B), its backward all-gather + GEMM would not."""
    import threading

    a = torch.ones(128, 1024, dtype=torch.float64, requires_grad=True)
    b = torch.ones(1024, 1024, dtype=torch.float64)
    with ok.strict_overlap():
        out = ok.matmul_reduce_scatter(a, b)
    errors = []

    def run_backward():
        try:
            out.sum().backward()
        except ok.StrictOverlapError as exc:
            errors.append(str(exc))

    worker = threading.Thread(target=run_backward)  # a new thread starts with an empty context
    worker.start()
    worker.join()
    return errors[0] if errors else None


def test_auto_records_choice_and_strict_mode_raises(rank_pool):
    for counts, reasons, strict_error, backward_error in rank_pool(2).run(_auto_and_strict_on_rank):
        assert counts == {("all_gather_matmul", "baseline"): 1, ("all_gather_matmul", "decomposed"): 2}
        assert any("gloo ring message 256 B <" in r for r in reasons[("all_gather_matmul", "baseline")])
        assert "requested" in reasons[("all_gather_matmul", "decomposed")]
        assert strict_error and "all_gather_matmul: strict_overlap() is active" in strict_error
        assert "gloo ring message 256 B" in strict_error
        assert backward_error and "all_gather_matmul: strict_overlap() is active" in backward_error
        assert "256 GEMM flop per byte sent > 128" in backward_error


def _rs_reason_on_rank():
    ok.reset_overlap_stats()
    ok.matmul_reduce_scatter(torch.ones(2 * 128, 512, dtype=torch.float64), torch.ones(512, 8, dtype=torch.float64))
    return {key: list(reasons) for key, reasons in ok.overlap_stats(reset=True).reasons.items()}


def test_reduce_scatter_rules_see_one_chunk(rank_pool):
    """A ring step of matmul + reduce-scatter sends one [m, N] running sum, m = rows / world:
    128 x 8 fp64 = 8192 B here (the whole [256, 8] would be twice that)."""
    for reasons in rank_pool(2).run(_rs_reason_on_rank):
        assert any("gloo ring message 8192 B <" in r for r in reasons[("matmul_reduce_scatter", "baseline")]), reasons


def test_rule_thresholds_at_their_boundaries():
    """The documented rules exactly at their limits: CUDA from 1024 rows per rank, gloo from 512 KiB
    messages and up to (including) the op's flop-per-byte limit."""
    from overlapkernels.ops import dispatch

    def method(op="all_gather_matmul", *, device="cpu", rows=8, nbytes=dispatch.GLOO_MIN_STEP_BYTES, flops=None):
        return dispatch.choose(op, "auto", world_size=4, rows_per_rank=rows, step_bytes=nbytes,
                               step_flops=nbytes if flops is None else flops, device=torch.device(device),
                               peer_memory=False).method

    try:
        limit = dispatch.CUDA_MIN_ROWS_PER_RANK
        assert [method(device="cuda", rows=rows) for rows in (limit - 1, limit)] == ["baseline", "decomposed"]
        least = dispatch.GLOO_MIN_STEP_BYTES
        assert [method(nbytes=nbytes) for nbytes in (least - 1, least)] == ["baseline", "decomposed"]
        for op, most in dispatch.GLOO_MAX_FLOPS_PER_BYTE.items():
            assert [method(op, flops=most * least + extra) for extra in (0, 1)] == ["decomposed", "baseline"], op
    finally:
        ok.reset_overlap_stats()


@pytest.mark.parametrize("requested, has_symm, ipc_built, kind", [
    ("auto", True, True, "symm_mem"), ("auto", True, False, "symm_mem"), ("auto", False, True, "ipc"),
    ("symm_mem", True, True, "symm_mem"), ("ipc", True, True, "ipc"), ("ipc", False, True, "ipc")])
def test_peer_memory_choice(requested, has_symm, ipc_built, kind):
    """Process groups on CUDA get symmetric buffers from torch's symmetric memory, or from CUDA IPC
    where this torch lacks it (or OVERLAPKERNELS_PEER_MEMORY=ipc asks for it)."""
    from overlapkernels.comm.process_world import resolve_peer_memory

    assert resolve_peer_memory(requested, has_symm_mem=has_symm, ipc_built=ipc_built) == (kind, None)


@pytest.mark.parametrize("requested, has_symm, ipc_built, why", [
    ("auto", False, False, r"has no symmetric memory and CUDA IPC needs the overlapkernels CUDA library.*make cuda"),
    ("symm_mem", False, True, r"OVERLAPKERNELS_PEER_MEMORY=symm_mem but this torch .* has no symmetric memory"),
    ("ipc", True, False, r"^CUDA IPC needs the overlapkernels CUDA library, which is not built")])
def test_peer_memory_unavailable_says_why(requested, has_symm, ipc_built, why):
    import re

    from overlapkernels.comm.process_world import resolve_peer_memory

    kind, message = resolve_peer_memory(requested, has_symm_mem=has_symm, ipc_built=ipc_built)
    assert kind is None and re.search(why, message), message


def test_cuda_graph_capture_keeps_peer_memory_methods_out(monkeypatch):
    """symm/fused count calls on the host: captured, every replay would reuse stale flags. Under
    capture they are refused by name, and auto neither picks them nor times candidates (a host sync)."""
    from overlapkernels.ops import _methods, dispatch

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    process_group = object()  # not a thread world: a CUDA process group's peer memory
    for method in ("symm", "fused"):
        assert "cannot be captured in a CUDA graph" in _methods.unavailable_reason(method, process_group, cuda)
    assert _methods.unavailable_reason("decomposed", process_group, cuda) is None
    from overlapkernels.comm.thread_world import ThreadRank, ThreadWorld

    thread_rank = ThreadRank(ThreadWorld(2, timeout=5), 0)  # the one-GPU test world: refused alike
    assert "cannot be captured in a CUDA graph" in _methods.unavailable_reason("fused", thread_rank, cuda)
    common = dict(world_size=8, rows_per_rank=4096, step_bytes=1 << 24, step_flops=1 << 36, peer_memory=False)
    choice = dispatch.choose("all_gather_matmul", "auto", device=cuda, **common,
                             measure=lambda: dispatch.Choice("fused", "measured"))
    assert choice.method == "decomposed"  # the rule, not the (cached) measurement
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert dispatch.choose("all_gather_matmul", "auto", device=cuda, **common,
                           measure=lambda: dispatch.Choice("fused", "measured")).method == "fused"
    ok.reset_overlap_stats()


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "inf", "nan"])
def test_bad_peer_timeout_is_rejected_by_name(monkeypatch, raw):
    from overlapkernels.comm.process_world import peer_memory_unavailable_reason, peer_wait_timeout

    monkeypatch.setenv("OVERLAPKERNELS_PEER_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"OVERLAPKERNELS_PEER_TIMEOUT='{raw}': expected a positive number"):
        peer_memory_unavailable_reason(torch.device("cuda", 0))
    monkeypatch.setenv("OVERLAPKERNELS_PEER_TIMEOUT", "2.5")
    assert peer_wait_timeout() == 2.5
    monkeypatch.delenv("OVERLAPKERNELS_PEER_TIMEOUT")
    assert peer_wait_timeout() == 60.0


@pytest.mark.parametrize("raw", ["0", "-2", "many", "1.5", ""])
def test_reserved_sms_setting(monkeypatch, raw):
    """The SMs fused GEMMs leave free (for the flag kernels, and NCCL's beside them): checked by name
    before anything communicates, and it sizes the persistent grid."""
    from types import SimpleNamespace

    from overlapkernels.comm.process_world import peer_memory_unavailable_reason
    from overlapkernels.kernels.triton import tile_gemm

    monkeypatch.setenv("OVERLAPKERNELS_RESERVED_SMS", raw)
    with pytest.raises(ValueError, match=f"OVERLAPKERNELS_RESERVED_SMS='{raw}': expected a whole number of SMs >= 1"):
        peer_memory_unavailable_reason(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: SimpleNamespace(multi_processor_count=132))
    cuda = torch.device("cuda", 0)
    monkeypatch.setenv("OVERLAPKERNELS_RESERVED_SMS", "20")
    assert tile_gemm.num_programs(cuda, 1000) == 112 and tile_gemm.num_programs(cuda, 1000, ranks_per_device=2) == 56
    monkeypatch.delenv("OVERLAPKERNELS_RESERVED_SMS")
    assert tile_gemm.num_programs(cuda, 1000) == 128 and tile_gemm.num_programs(cuda, 7) == 7


def _peer_memory_across_hosts_on_rank():
    """4 ranks as 2 hosts of 2, rank 3 without peer memory: the ranks ask each other (no launcher
    numbering) and every rank of a group gets the same answer, yes only for TP group {0, 1} (one
    host, all able); measured auto then offers symm/fused to that group alone. Peer memory is faked:
    only the agreement is under test (the host check in the peer world itself needs CUDA)."""
    import socket

    from overlapkernels.comm import process_world as pw
    from overlapkernels.ops import measure

    dims = ok.init_parallel(tp=2)
    r = dist.get_rank()
    unavailable, hostname, agreed = pw.peer_memory_unavailable_reason, socket.gethostname, pw.group_has_peer_memory
    pw.peer_memory_unavailable_reason = lambda device: "no peer memory here" if r == 3 else None
    socket.gethostname = lambda: f"node{r // 2}"
    pw._group_peer_memory.clear()
    try:
        cpu = torch.device("cpu")  # stands in for the GPU: all_gather_object over gloo
        tp_ok, world_ok = pw.group_has_peer_memory(dims.tp_group, cpu), pw.group_has_peer_memory(dist.group.WORLD, cpu)
        pw.group_has_peer_memory = lambda group, device: tp_ok if group is dims.tp_group else world_ok
        cuda = torch.device("cuda", 0)
        return (tp_ok, world_ok, measure.candidates(dims.tp_group, cuda), measure.candidates(dist.group.WORLD, cuda),
                measure.candidates(dims.tp_group, cuda, fused_fits=False))  # a call past fused's 32-bit offsets
    finally:
        pw.peer_memory_unavailable_reason, socket.gethostname, pw.group_has_peer_memory = unavailable, hostname, agreed
        pw._group_peer_memory.clear()


def _bad_setting_on_one_rank():
    """Rank 1 alone has a bad OVERLAPKERNELS_RESERVED_SMS: every rank raises naming it, instead of
    rank 1 raising and the others waiting in the agreement's collective."""
    import os

    from overlapkernels.comm import process_world as pw
    from overlapkernels.kernels.triton.tile_gemm import reserved_sms

    r = dist.get_rank()
    unavailable = pw.peer_memory_unavailable_reason
    pw.peer_memory_unavailable_reason = lambda device: reserved_sms() and None  # the settings check, on "CUDA"
    if r == 1:
        os.environ["OVERLAPKERNELS_RESERVED_SMS"] = "lots"
    pw._group_peer_memory.clear()
    try:
        pw.group_has_peer_memory(dist.group.WORLD, torch.device("cpu"))
    except ValueError as exc:
        return str(exc)
    finally:
        os.environ.pop("OVERLAPKERNELS_RESERVED_SMS", None)
        pw.peer_memory_unavailable_reason = unavailable
        pw._group_peer_memory.clear()


def _peer_access_decides_on_rank():
    """Every rank able, one host: the GPUs' pairwise peer access (NVML, faked) still decides, alike on
    every rank, even when only one rank's NVML could answer (the ranks exchange what they found)."""
    from overlapkernels.comm import process_world as pw

    r = dist.get_rank()
    unavailable, uuid, pairs = pw.peer_memory_unavailable_reason, pw._device_uuid, pw.failing_pairs
    pw.peer_memory_unavailable_reason = lambda device: None
    pw._device_uuid = lambda device: f"gpu{r}"
    answers = []
    try:
        for found in ({}, {("gpu0", "gpu1"): "no peer-to-peer atomics (NVML: NOT_SUPPORTED)"}):
            pw.failing_pairs = lambda found=found: found if r == 1 else {}  # rank 0's NVML: no answer
            pw._group_peer_memory.clear()
            answers.append(pw.group_has_peer_memory(dist.group.WORLD, torch.device("cpu")))
    finally:
        pw.peer_memory_unavailable_reason, pw._device_uuid, pw.failing_pairs = unavailable, uuid, pairs
        pw._group_peer_memory.clear()
    return answers


def test_peer_memory_needs_peer_access_between_the_gpus(rank_pool):
    assert rank_pool(2).run(_peer_access_decides_on_rank) == [[True, False]] * 2


def test_a_bad_setting_on_one_rank_is_reported_by_every_rank(rank_pool):
    assert rank_pool(2).run(_bad_setting_on_one_rank) == [
        "rank 1: OVERLAPKERNELS_RESERVED_SMS='lots': expected a whole number of SMs >= 1"] * 2


def test_peer_memory_needs_every_rank_able_and_one_host(rank_pool):
    results = rank_pool(4).run(_peer_memory_across_hosts_on_rank)
    both, two = ["baseline", "decomposed", "symm", "fused"], ["baseline", "decomposed"]
    assert results == [(True, False, both, two, both[:3])] * 2 + [(False, False, two, two, two)] * 2


def test_bad_peer_memory_setting_is_rejected_by_name(monkeypatch):
    from overlapkernels.comm.process_world import peer_memory_unavailable_reason

    monkeypatch.setenv("OVERLAPKERNELS_PEER_MEMORY", "nvshmem")
    with pytest.raises(ValueError, match=r"OVERLAPKERNELS_PEER_MEMORY='nvshmem': expected one of \['auto', "
                                         r"'symm_mem', 'ipc'\]"):
        peer_memory_unavailable_reason(torch.device("cuda", 0))
    assert peer_memory_unavailable_reason(torch.device("cpu")) == "tensors are on cpu, peer memory needs CUDA"


class _PooledSymmHandle:
    """Mimics torch >= 2.11 symmetric memory: tensors are carved out of pooled blocks, so
    buffer_ptrs and get_buffer(r, ..., storage_offset) count from each rank's block base."""

    def __init__(self, blocks):
        self.blocks = blocks  # rank -> flat block (a CPU tensor standing in for the peer mapping)
        self.buffer_ptrs = [b.data_ptr() for b in blocks]

    def get_buffer(self, rank, sizes, dtype, storage_offset=0):
        flat = self.blocks[rank].view(dtype)
        return flat[storage_offset:storage_offset + math.prod(sizes)].view(sizes)


def test_symm_mem_peer_views_use_each_ranks_offset_into_its_block():
    from overlapkernels.comm.process_world import symm_mem_peer_views

    blocks = [torch.arange(64, dtype=torch.float32) + 100 * r for r in range(3)]
    offsets = [16, 32, 16]  # bytes: rank 1 sits elsewhere in its block than ranks 0 and 2
    local = blocks[1][8:12].view(2, 2)
    peers = symm_mem_peer_views(_PooledSymmHandle(blocks), offsets, local, rank=1)
    assert peers[1].data_ptr() == local.data_ptr()
    assert [p[0, 0].item() for p in peers] == [4.0, 108.0, 204.0]
    # block bases as addresses (what torch 2.11's buffer_ptrs give) would miss the tensor: caught
    with pytest.raises(RuntimeError, match=r"rank 1's view of its own buffer is at 0x.*OVERLAPKERNELS_PEER_MEMORY=ipc"):
        symm_mem_peer_views(_PooledSymmHandle(blocks), [0, 0, 0], local, rank=1)
    with pytest.raises(RuntimeError, match=r"rank 2's buffer starts 6 bytes into its block, expected a "
                                           r"non-negative multiple of 4"):
        symm_mem_peer_views(_PooledSymmHandle(blocks), [16, 32, 6], local, rank=1)


def _symm_mem_without_a_handle_on_rank():
    """torch symmetric memory stood in for on CPU: rendezvous gives rank 1 no handle (newer torch
    warns and returns None for a tensor outside its pool). Every rank must raise, naming rank 1,
    not rank 1 alone while rank 0 waits in the next collective."""
    import torch.distributed._symmetric_memory as symm_mem

    from overlapkernels.comm.process_world import ProcessPeerWorld

    world = object.__new__(ProcessPeerWorld)
    world.group, world.device, world.peer_memory = dist.group.WORLD, torch.device("cpu"), "symm_mem"
    world.rank, world.world_size = dist.get_rank(), dist.get_world_size()
    saved = {name: getattr(symm_mem, name) for name in ("enable_symm_mem_for_group", "empty", "rendezvous")}
    symm_mem.enable_symm_mem_for_group = lambda name: None
    symm_mem.empty = lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device)
    symm_mem.rendezvous = lambda t, name: None if dist.get_rank() == 1 else _PooledSymmHandle([t])
    try:
        with pytest.raises(RuntimeError) as info:
            world.alloc_symmetric((4,), torch.float32)
        return str(info.value)
    finally:
        for name, fn in saved.items():
            setattr(symm_mem, name, fn)


def test_symm_mem_without_a_handle_raises_on_every_rank(rank_pool):
    want = ("torch symmetric memory gave no handle on ranks [1] of the group; OVERLAPKERNELS_PEER_MEMORY=ipc on "
            "every rank uses CUDA IPC instead")
    assert rank_pool(2).run(_symm_mem_without_a_handle_on_rank) == [want, want]


def _ipc_peer_not_mappable_on_rank():
    """The CUDA IPC path with CPU stand-ins: rank 1 cannot map rank 0's buffer (what a process
    that sees only its own GPU gets). Every rank raises naming it, not rank 1 alone while rank 0
    waits at the barrier."""
    from overlapkernels.comm.process_world import ProcessPeerWorld
    from overlapkernels.kernels import cuda as cuda_lib

    world = object.__new__(ProcessPeerWorld)
    world.group, world.device, world.peer_memory = dist.group.WORLD, torch.device("cpu"), "ipc"
    world.rank, world.world_size = dist.get_rank(), dist.get_world_size()
    kept = []

    def alloc(nbytes, device):
        kept.append(torch.empty(nbytes, dtype=torch.uint8))
        return kept[-1].data_ptr(), bytes(cuda_lib.IPC_HANDLE_BYTES)

    def open_(handle, device):
        if dist.get_rank() == 1:
            raise cuda_lib.CudaLibraryError("ipc_open: CUDA error 101: invalid device ordinal")
        kept.append(torch.empty(64, dtype=torch.uint8))
        return kept[-1].data_ptr()

    saved = cuda_lib.ipc_alloc, cuda_lib.ipc_open
    cuda_lib.ipc_alloc, cuda_lib.ipc_open = alloc, open_
    try:
        with pytest.raises(RuntimeError) as info:
            world.alloc_symmetric((4,), torch.float32)
        return str(info.value)
    finally:
        cuda_lib.ipc_alloc, cuda_lib.ipc_open = saved


def test_a_peer_buffer_ipc_cannot_map_raises_on_every_rank(rank_pool):
    for said in rank_pool(2).run(_ipc_peer_not_mappable_on_rank):
        assert said.startswith("CUDA IPC: rank 1 cannot map rank 0's buffer (ipc_open: CUDA error 101: invalid "
                               "device ordinal). A common cause: each rank sees only its own GPU"), said


def test_pending_device_errors_are_raised_on_demand_and_reported_at_exit(monkeypatch, capsys):
    """symm/fused on GPUs raise a wait's timeout one call late (no host sync per call): the last
    call's must still surface - check_pending_errors() raises it, the exit hook prints it."""
    from types import SimpleNamespace

    from overlapkernels.comm import process_world as pw
    from overlapkernels.kernels.errors import SignalTimeoutError

    def flush():
        raise SignalTimeoutError("ok/all_gather_matmul[fused]: rank 1 timed out waiting for chunk 0 from rank 0")

    monkeypatch.setattr(pw, "_worlds", {"k": SimpleNamespace(_errors=SimpleNamespace(flush=flush))})
    with pytest.raises(SignalTimeoutError, match="rank 1 timed out waiting for chunk 0"):
        pw.check_pending_errors()
    pw.report_pending_errors()
    assert "overlapkernels: SignalTimeoutError: ok/all_gather_matmul[fused]: rank 1" in capsys.readouterr().err


def test_reasons_stay_bounded_over_many_shapes():
    """Reasons name sizes: a long run of distinct shapes counts its later reasons under one entry."""
    from overlapkernels.ops import dispatch

    ok.reset_overlap_stats()
    for rows in range(dispatch.MAX_REASONS_PER_KEY + 50):
        dispatch.record("all_gather_matmul", dispatch.Choice("baseline", f"{rows} rows per rank"))
    dispatch.record("all_gather_matmul", dispatch.Choice("baseline", "0 rows per rank"))  # a known one still counts as itself
    stats = ok.overlap_stats(reset=True)
    by_reason = stats.reasons[("all_gather_matmul", "baseline")]
    assert stats[("all_gather_matmul", "baseline")] == dispatch.MAX_REASONS_PER_KEY + 51
    assert len(by_reason) == dispatch.MAX_REASONS_PER_KEY + 1 and by_reason[dispatch.OTHER_REASONS] == 50
    assert by_reason["0 rows per rank"] == 2 and sum(by_reason.values()) == dispatch.MAX_REASONS_PER_KEY + 51


def _mismatched_calls_on_rank():
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: a rank calling with other shapes or options, or one whose own
    checks reject its call, is named on every rank before the op communicates (gloo would abort
    in the P2P ring, or the others would wait for the rejected rank); agreeing calls still run."""
    r = dist.get_rank()
    level = dist.get_debug_level()
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    errors = []
    try:
        b = torch.ones(8, 3)
        calls = [
            lambda: ok.all_gather_matmul(torch.ones(4 + (r == 1), 8), b, method="decomposed"),
            lambda: ok.all_gather_matmul(torch.ones(4, 8), b, method="decomposed" if r else "baseline"),
            lambda: ok.all_gather_matmul(torch.ones(4, 8, requires_grad=r == 1), b, save_gathered=r == 0),
            lambda: ok.matmul_reduce_scatter(torch.ones(4 + r, 8), b, method="decomposed"),  # 5 rows: rank 1 rejects
            lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), b, method="symm" if r else "decomposed"),
            lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), b, scatter_dim=0 if r else -2, method="decomposed"),
            # a layer's own wording of the op's check, still made where every rank hears of it
            lambda: RowParallelLinear(8, 4, dist.group.WORLD, sequence_parallel=True, method="decomposed")(
                torch.ones(4 + r, 1, 4)),
        ]
        for call in calls:
            try:
                call()
                errors.append(None)
            except (ValueError, TypeError) as exc:
                errors.append(str(exc))
        out = ok.all_gather_matmul(torch.ones(4, 8), b, method="decomposed")  # agreeing: runs
        assert torch.equal(out, torch.full((4 * dist.get_world_size(), 3), 8.0))
    finally:
        dist.set_debug_level(level)
    return errors


def _auto_modes_differ_on_rank():
    """OVERLAPKERNELS_AUTO set on one rank only: that rank would measure (timed collectives of every
    candidate) while the other ran its rules' method. Named under the debug check, before any."""
    r = dist.get_rank()
    level, saved = dist.get_debug_level(), os.environ.pop("OVERLAPKERNELS_AUTO", None)
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    if r == 0:
        os.environ["OVERLAPKERNELS_AUTO"] = "measure"
    said = []
    try:
        for call in (lambda: ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3)),
                     lambda: ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 3))):
            with pytest.raises(ValueError) as info:
                call()
            said.append(str(info.value))
        out = ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 3), method="baseline")  # not auto: runs
    finally:
        dist.set_debug_level(level)
        os.environ.pop("OVERLAPKERNELS_AUTO", None)
        if saved is not None:
            os.environ["OVERLAPKERNELS_AUTO"] = saved
    return said, torch.equal(out, torch.full((8, 3), 8.0))


def test_auto_modes_that_differ_between_ranks_are_named_under_distributed_debug(rank_pool):
    for said, ran in rank_pool(2).run(_auto_modes_differ_on_rank):
        assert ran
        for op, message in zip(("all_gather_matmul", "matmul_reduce_scatter"), said):
            assert message.startswith(f"{op}: the ranks of the group disagree on OVERLAPKERNELS_AUTO (rank 0: "
                                      "OVERLAPKERNELS_AUTO='measure'; rank 1: OVERLAPKERNELS_AUTO='rules')"), message


def test_ranks_that_disagree_are_named_under_distributed_debug(rank_pool):
    hint = "; every rank must make the same call (TORCH_DISTRIBUTED_DEBUG=DETAIL check)"
    errors = rank_pool(2).run(_mismatched_calls_on_rank)
    for shapes, method, grads, _, _, dims, _ in errors:
        assert shapes == ("all_gather_matmul: the ranks of the group disagree on a_shard (rank 0: a_shard=[4, 8] "
                          "float32; rank 1: a_shard=[5, 8] float32)" + hint), shapes
        assert "disagree on method (rank 0: method='baseline'; rank 1: method='decomposed')" in method, method
        assert grads.startswith("all_gather_matmul: the ranks of the group disagree on a_shard, save_gathered (rank "
                                "0: a_shard=[4, 8] float32, save_gathered=True; rank 1: a_shard=[4, 8] float32 (gets "
                                "a gradient), save_gathered=False)"), grads
        assert dims is None  # scatter_dim -2 and 0 are the same dim of a 2-D a: no disagreement
    # the rank whose own check failed raises that error; the other is told which rank and why
    assert errors[1][3] == "a.shape[scatter_dim=0]=5 is not divisible by the group size 2"
    assert errors[0][3] == ("matmul_reduce_scatter: other ranks' arguments were rejected (rank 1: ValueError: "
                            "a.shape[scatter_dim=0]=5 is not divisible by the group size 2)" + hint)
    assert "needs CUDA" in errors[1][4] and errors[0][4].startswith(
        "matmul_reduce_scatter: other ranks' arguments were rejected (rank 1: ValueError: ")
    layer = "RowParallelLinear(sequence_parallel=True), which scatters x's dim 0 (the sequence of [S, B, H]) over the " \
            "tensor-parallel ranks: "
    assert errors[1][6] == layer + "x.shape[scatter_dim=0]=5 is not divisible by the group size 2"
    assert errors[0][6] == layer + ("linear_reduce_scatter: other ranks' arguments were rejected (rank 1: ValueError: "
                                    "x.shape[scatter_dim=0]=5 is not divisible by the group size 2)" + hint)


def test_deferred_error_records_raise_in_call_order():
    """The queue behind a call-late timeout (CUDA events faked): poll raises only records whose
    copy has landed, oldest first, and stops at the first pending one; flush waits for the rest."""
    from overlapkernels.kernels.errors import SignalTimeoutError
    from overlapkernels.kernels.triton import signals

    class Event:
        def __init__(self, done):
            self.done, self.waited = done, False

        def query(self):
            return self.done

        def synchronize(self):
            self.waited = True

    fine = torch.zeros(4, dtype=torch.int32)
    timed_out = torch.tensor([signals.ERR_READY_TIMEOUT.value, 1, 2, 0], dtype=torch.int32)
    check = signals.DeferredErrorCheck()
    events = [Event(True), Event(False), Event(True)]
    check._pending = [(events[0], fine, "op0", 1), (events[1], timed_out, "op1", 2), (events[2], fine, "op2", 3)]
    check.poll()  # the first record is clean; the second has not landed: nothing raised, it stays
    assert [p[2] for p in check._pending] == ["op1", "op2"]
    with pytest.raises(SignalTimeoutError, match=r"op1: rank 1 timed out waiting for chunk 2 from rank 0 \(call 2\)"):
        check.flush()
    assert events[1].waited and [p[2] for p in check._pending] == ["op2"]
    check.flush()
    assert check._pending == [] and events[2].waited
