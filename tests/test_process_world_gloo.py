"""The process world's peer-memory rules on gloo ranks and in-process: which peer memory a group
gets (torch symmetric memory or CUDA IPC) and why not, its settings (wait timeout, reserved SMs),
one node and peer access between the GPUs, torch 2.11's pooled symmetric memory, set-up failures
raised on every rank (the device error records raised a call late: test_device_error_records.py).
The GPU side runs in test_ops_tp_gpu.py (make gpu-check)."""
import math

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok

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


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "inf", "nan", "1e10"])
def test_bad_peer_timeout_is_rejected_by_name(monkeypatch, raw):
    from overlapkernels.comm.process_world import peer_memory_unavailable_reason, peer_wait_timeout

    monkeypatch.setenv("OVERLAPKERNELS_PEER_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"OVERLAPKERNELS_PEER_TIMEOUT='{raw}': expected a positive number"):
        peer_memory_unavailable_reason(torch.device("cuda", 0))
    monkeypatch.setenv("OVERLAPKERNELS_PEER_TIMEOUT", "2.5")
    assert peer_wait_timeout() == 2.5
    monkeypatch.setenv("OVERLAPKERNELS_PEER_TIMEOUT", "1e9")  # the largest: its budget fits an int64 of ns
    assert peer_wait_timeout() == 1e9
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
    # a config with two programs per SM: two per unreserved SM, still shared among a GPU's ranks
    assert tile_gemm.num_programs(cuda, 1000, programs_per_sm=2) == 256
    assert tile_gemm.num_programs(cuda, 1000, ranks_per_device=3, programs_per_sm=2) == 85


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


def _one_host_name_two_machines_on_rank(tmp, boots):
    """2 ranks with one host name (containers of one image) and boot ids ``boots`` per rank: the
    world gets peer memory only when the boot ids agree too. Peer memory itself faked."""
    from overlapkernels.comm import process_world as pw

    r = dist.get_rank()
    path = f"{tmp}/boot{r}"
    with open(path, "w") as f:
        f.write(boots[r] + "\n")
    saved = pw.peer_memory_unavailable_reason, pw.BOOT_ID_PATH
    pw.peer_memory_unavailable_reason, pw.BOOT_ID_PATH = (lambda device: None), path
    pw._group_peer_memory.clear()
    try:
        return pw.host_identity(), pw.group_has_peer_memory(dist.group.WORLD, torch.device("cpu"))
    finally:
        pw.peer_memory_unavailable_reason, pw.BOOT_ID_PATH = saved
        pw._group_peer_memory.clear()


@pytest.mark.parametrize("boots, able", [(("1111aaaa-x", "2222bbbb-y"), False), (("1111aaaa-x", "1111aaaa-x"), True)])
def test_one_host_name_on_two_machines_is_not_one_node(rank_pool, tmp_path, boots, able):
    """Was: ranks compared host names only, and containers on two nodes can share one; their peer
    memory set-up then failed rank by rank. The kernel's boot id tells machines apart."""
    import socket

    for r, (host, got) in enumerate(rank_pool(2).run(_one_host_name_two_machines_on_rank, str(tmp_path), boots)):
        assert host == f"{socket.gethostname()} (boot {boots[r][:8]})" and got is able, (host, got)


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


def _bare_cpu_world(peer_memory):
    """A process world over the gloo world, on the CPU, without its CUDA set-up: enough to run
    alloc_symmetric's exchanges with the CUDA pieces stood in for."""
    from overlapkernels.comm.process_world import ProcessPeerWorld

    world = object.__new__(ProcessPeerWorld)
    world.group, world.device, world.peer_memory = dist.group.WORLD, torch.device("cpu"), peer_memory
    world.rank, world.world_size = dist.get_rank(), dist.get_world_size()
    return world


def _symm_mem_without_a_handle_on_rank(foreign=False):
    """torch symmetric memory stood in for on CPU: rendezvous gives rank 1 no handle (newer torch
    warns and returns None for a tensor outside its pool), or with ``foreign`` one of a 3-rank
    group (torch caches a rendezvous per block and group name; names come back). Every rank must
    raise, naming rank 1, not rank 1 alone while rank 0 waits in the next collective."""
    import torch.distributed._symmetric_memory as symm_mem

    world = _bare_cpu_world("symm_mem")
    saved = {name: getattr(symm_mem, name) for name in ("enable_symm_mem_for_group", "empty", "rendezvous")}
    symm_mem.enable_symm_mem_for_group = lambda name: None
    symm_mem.empty = lambda shape, dtype, device: torch.empty(shape, dtype=dtype, device=device)
    def rendezvous(t, name):
        if dist.get_rank() != 1:
            return _PooledSymmHandle([t])
        if not foreign:
            return None
        handle = _PooledSymmHandle([t, t, t])
        handle.world_size, handle.rank = 3, 1
        return handle

    symm_mem.rendezvous = rendezvous
    try:
        with pytest.raises(RuntimeError) as info:
            world.alloc_symmetric((4,), torch.float32)
        return str(info.value)
    finally:
        for name, fn in saved.items():
            setattr(symm_mem, name, fn)


@pytest.mark.parametrize("foreign", [False, True])
def test_symm_mem_without_a_handle_raises_on_every_rank(rank_pool, foreign):
    want = ("torch symmetric memory gave no handle (or one of another group's size or rank) on ranks [1] of the "
            "group; OVERLAPKERNELS_PEER_MEMORY=ipc on every rank uses CUDA IPC instead")
    assert rank_pool(2).run(_symm_mem_without_a_handle_on_rank, foreign) == [want, want]


def _ipc_peer_not_mappable_on_rank():
    """The CUDA IPC path with CPU stand-ins: rank 1 cannot map rank 0's buffer (what a process
    that sees only its own GPU gets). Every rank raises naming it, not rank 1 alone while rank 0
    waits at the barrier."""
    from overlapkernels.kernels import cuda as cuda_lib

    world = _bare_cpu_world("ipc")
    kept, asked = [], []

    def alloc(nbytes, device):
        asked.append(nbytes)
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
        return str(info.value), asked
    finally:
        cuda_lib.ipc_alloc, cuda_lib.ipc_open = saved


def test_a_peer_buffer_ipc_cannot_map_raises_on_every_rank(rank_pool):
    for said, asked in rank_pool(2).run(_ipc_peer_not_mappable_on_rank):
        assert asked == [2 << 20]  # 16 bytes asked for: a whole 2 MiB granule, no block shared with others
        assert said.startswith("CUDA IPC: rank 1 cannot map rank 0's buffer (ipc_open: CUDA error 101: invalid "
                               "device ordinal). A common cause: each rank sees only its own GPU"), said


def _peer_world_with_a_bad_setting_on_one_rank():
    """An explicit method='symm'/'fused' checked settings and peer memory on each rank alone, before
    the peer world's exchange: a rank that refused left its peers waiting in that exchange until the
    group's timeout. The world's exchange now carries the settings' errors: every rank raises."""
    import os

    from overlapkernels.comm.process_world import ProcessPeerWorld
    from overlapkernels.ops import _methods

    if dist.get_rank() == 1:
        os.environ["OVERLAPKERNELS_RESERVED_SMS"] = "lots"
    capturing = torch.cuda.is_current_stream_capturing
    torch.cuda.is_current_stream_capturing = lambda: False  # (a CPU torch cannot ask)
    try:
        local = _methods.unavailable_reason("symm", dist.group.WORLD, torch.device("cuda", 0))
        with pytest.raises(ValueError) as info:
            ProcessPeerWorld(dist.group.WORLD, torch.device("cpu"))
        return local, str(info.value)
    finally:
        os.environ.pop("OVERLAPKERNELS_RESERVED_SMS", None)
        torch.cuda.is_current_stream_capturing = capturing


def test_an_explicit_peer_method_is_refused_on_every_rank_where_the_ranks_meet(rank_pool):
    assert rank_pool(2).run(_peer_world_with_a_bad_setting_on_one_rank) == [
        (None, "rank 1: OVERLAPKERNELS_RESERVED_SMS='lots': expected a whole number of SMs >= 1")] * 2


def _allocation_failing_on_one_rank(peer_memory):
    """An allocation that fails on rank 1 alone (out of memory): it raised there while rank 0 waited
    in the rendezvous (symm_mem) or the handle exchange (IPC) until the group's timeout. Every rank
    now raises, naming rank 1."""
    import torch.distributed._symmetric_memory as symm_mem

    from overlapkernels.kernels import cuda as cuda_lib

    world = _bare_cpu_world(peer_memory)
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB"

    kept = []

    def alloc(*args, **kwargs):
        if dist.get_rank() == 1:
            raise RuntimeError(oom) if peer_memory == "symm_mem" else cuda_lib.CudaLibraryError(f"ipc_alloc: {oom}")
        kept.append(torch.empty(16, dtype=torch.uint8))  # (alive while the world maps it)
        return torch.empty(4) if peer_memory == "symm_mem" else (kept[-1].data_ptr(), b"")

    saved = (symm_mem.enable_symm_mem_for_group, symm_mem.empty, symm_mem.rendezvous, cuda_lib.ipc_alloc)
    symm_mem.enable_symm_mem_for_group = lambda name: None
    symm_mem.empty, cuda_lib.ipc_alloc = alloc, alloc
    symm_mem.rendezvous = lambda *a: pytest.fail("rendezvous after a rank failed to allocate")
    try:
        with pytest.raises(RuntimeError) as info:
            world.alloc_symmetric((4,), torch.float32)
        return str(info.value)
    finally:
        symm_mem.enable_symm_mem_for_group, symm_mem.empty, symm_mem.rendezvous, cuda_lib.ipc_alloc = saved


@pytest.mark.parametrize("peer_memory, what", [("symm_mem", "torch symmetric memory could not allocate (4,) "
                                                "torch.float32: rank 1: CUDA out of memory"),
                                               ("ipc", "CUDA IPC could not allocate 16 bytes: rank 1: ipc_alloc: CUDA "
                                                "out of memory")])
def test_an_allocation_failing_on_one_rank_raises_on_every_rank(rank_pool, peer_memory, what):
    for said in rank_pool(2).run(_allocation_failing_on_one_rank, peer_memory):
        assert said.startswith(what), said


@pytest.mark.parametrize("raw, warned", [("1", True), ("2", False), ("32", False), (None, False)])
def test_one_hardware_queue_is_warned_about(monkeypatch, raw, warned):
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (Megatron-LM's setting) serialises symm/fused's pulls and GEMMs:
    correct but not overlapped, which a process world (as the thread world already did) now says."""
    import warnings

    from overlapkernels.comm.process_world import warn_single_hardware_queue

    if raw is None:
        monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    else:
        monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", raw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_single_hardware_queue()
    said = [str(w.message) for w in caught]
    assert said == (["CUDA_DEVICE_MAX_CONNECTIONS=1: one hardware queue for every stream, so method='symm'/'fused' "
                     "run their transfers and GEMMs one after the other (correct, not overlapped); set it to 2 or "
                     "more (8, CUDA's default) for these ops"] if warned else [])
