"""The C-ABI CUDA library: it builds, loads and exports its symbols here; numerics on a GPU."""
import importlib.util
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from overlapkernels.kernels import cuda as cuda_lib
from overlapkernels.kernels.errors import CudaLibraryError, SignalTimeoutError

ROOT = Path(__file__).resolve().parent.parent


def _builder():
    spec = importlib.util.spec_from_file_location("ok_csrc_build", ROOT / "csrc" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NVCC = _builder().nvcc_path()  # where csrc/build.py looks ($CUDA_HOME, PATH, /usr/local/cuda)
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="no nvcc (csrc/build.py --find-nvcc)")
# GPU tests that need the library: skipped only where it cannot be built (`make gpu-check` then
# reports csrc_build skipped); with an nvcc, a library that fails to build or load fails them
needs_cuda_library = pytest.mark.skipif(NVCC is None and not cuda_lib.is_loadable(),
                                        reason="the CUDA library is not built and there is no nvcc to build it")


@pytest.fixture(scope="module")
def built_lib(tmp_path_factory):
    """The library built from the current sources, so the tests prove they compile: `make setup`'s
    build where it is newer than every source (csrc/build.py's own check; CI just made it), else a
    fresh build into a temporary folder (~6 s of nvcc)."""
    builder = _builder()
    made = ROOT / "overlapkernels" / "_lib" / builder.LIB_NAME
    return made if builder.up_to_date(made) else builder.build(tmp_path_factory.mktemp("lib"), force=True,
                                                               verbose=False)


@needs_nvcc
def test_builds_and_exports_exactly_the_c_abi(built_lib):
    out = subprocess.run(["nm", "-D", "--defined-only", str(built_lib)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in out.stdout.splitlines() if " T " in line}
    assert exported == set(cuda_lib.EXPORTS)  # -fvisibility=hidden keeps everything else private


@needs_nvcc
def test_loads_without_a_gpu_and_reports_cuda_errors(built_lib, use_lib):
    use_lib(built_lib)
    lib = cuda_lib.load()
    assert lib.ok_abi_version() == cuda_lib.ABI_VERSION
    if not torch.cuda.is_available():
        # a launch with no driver/GPU returns an error code; the wrapper turns it into text
        err = lib.ok_signal_set(0, None, 1, None)
        assert err != 0
        with pytest.raises(CudaLibraryError, match="signal_set: CUDA error"):
            cuda_lib._check(lib, err, "signal_set")


def test_missing_library_says_how_to_build(use_lib, tmp_path):
    use_lib(tmp_path / "nope.so")
    assert not cuda_lib.is_built()
    with pytest.raises(CudaLibraryError, match=r"not built .*make cuda"):
        cuda_lib.reduce_sum(torch.zeros(4), [torch.zeros(4)])


@needs_nvcc
def test_cpu_tensors_are_rejected_by_name(built_lib, use_lib):
    use_lib(built_lib)
    with pytest.raises(ValueError, match=r"reduce_sum: dst must be a CUDA tensor, got cpu"):
        cuda_lib.reduce_sum(torch.zeros(4), [torch.zeros(4)])
    with pytest.raises(ValueError, match=r"expected 1..64 sources, got 0"):
        cuda_lib.reduce_sum(torch.zeros(4), [])


def test_error_record_names_op_rank_and_chunk():
    record = torch.tensor([1, 3, 5, cuda_lib.op_id("ok/ag_matmul")], dtype=torch.int32)
    with pytest.raises(SignalTimeoutError, match="ok/ag_matmul: rank 3 timed out waiting for the signal of chunk 5"):
        cuda_lib.check_error_record(record)
    cuda_lib.check_error_record(torch.zeros(4, dtype=torch.int32))  # no error: silent


# ---------------------------------------------------------------- GPU numerics (make gpu-check)

def _reference_sum(srcs):
    acc = torch.zeros_like(srcs[0], dtype=torch.float32)
    for s in srcs:  # the library's fixed order, in fp32
        acc += s.float()
    return acc.to(srcs[0].dtype)


@needs_cuda_library
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("numel, offset", [(1, 0), (4099, 0), (1 << 20, 0), (4099, 1)])
@pytest.mark.parametrize("num_srcs", [1, 2, 8])
def test_reduce_sum_matches_fp32_ordered_sum(dtype, numel, offset, num_srcs):
    # offset 1 misaligns every buffer: the scalar path must give the same bits as the vector one
    srcs = [torch.randn(numel + offset, device="cuda").to(dtype)[offset:] for _ in range(num_srcs)]
    dst = torch.full((numel + offset,), float("nan"), device="cuda", dtype=dtype)[offset:]
    cuda_lib.reduce_sum(dst, srcs)
    torch.testing.assert_close(dst, _reference_sum(srcs), atol=0, rtol=0)


@needs_cuda_library
@pytest.mark.gpu
def test_reduce_sum_in_place_and_planted_error():
    srcs = [torch.randn(1000, device="cuda") for _ in range(4)]
    expected = _reference_sum(srcs)
    cuda_lib.reduce_sum(srcs[0], srcs)
    torch.testing.assert_close(srcs[0], expected, atol=0, rtol=0)
    srcs[0][17] += 1e-3  # a planted error must not pass the exact check
    with pytest.raises(AssertionError):
        torch.testing.assert_close(srcs[0], expected, atol=0, rtol=0)


@needs_cuda_library
@pytest.mark.gpu
def test_signal_set_then_wait_and_timeout():
    pad = torch.zeros(4, dtype=torch.int32, device="cuda")
    record = torch.zeros(4, dtype=torch.int32, device="cuda")
    cuda_lib.signal_set(pad[1:2], 7)
    cuda_lib.signal_wait(pad[1:2], 7, error_record=record, op="ok/test", rank=0, chunk=1, timeout_s=5.0)
    torch.cuda.synchronize()
    cuda_lib.check_error_record(record)
    assert pad.tolist() == [0, 7, 0, 0]
    cuda_lib.signal_wait(pad[2:3], 1, error_record=record, op="ok/test", rank=2, chunk=9, timeout_s=0.05)
    with pytest.raises(SignalTimeoutError, match="ok/test: rank 2 timed out waiting for the signal of chunk 9"):
        cuda_lib.check_error_record(record)


def test_tensor_at_views_memory_it_does_not_own():
    """The IPC path wraps raw pointers (its own and peers' mapped buffers) as tensors labelled with
    this rank's device; on CPU the same call shows the view is exact and shares memory."""
    owner = torch.arange(24, dtype=torch.float32)
    view = cuda_lib.tensor_at(owner.data_ptr() + 4 * 4, (2, 5), torch.float32, "cpu")
    assert view.shape == (2, 5) and view.is_contiguous() and torch.equal(view, owner[4:14].view(2, 5))
    view[1, 0] = -1.0
    assert owner[9] == -1.0


def _ipc_on_rank():
    """Rank 0 exports a cudaMalloc'd buffer, rank 1 maps it, reads rank 0's values and writes back."""
    import torch.distributed as dist

    torch.cuda.set_device(0)
    rank = dist.get_rank()
    ptr, handle = cuda_lib.ipc_alloc(1024 * 4, "cuda:0")
    mine = cuda_lib.tensor_at(ptr, (1024,), torch.float32, "cuda:0")
    mine.copy_(torch.arange(1024, device="cuda:0", dtype=torch.float32) + 1000 * rank)
    torch.cuda.synchronize()
    handles = [None, None]
    dist.all_gather_object(handles, handle)
    peer = cuda_lib.tensor_at(cuda_lib.ipc_open(handles[1 - rank], "cuda:0"), (1024,), torch.float32, "cuda:0")
    seen = peer.clone()
    dist.barrier()
    peer[rank] = -7.0  # each rank writes one element of the other's buffer
    torch.cuda.synchronize()
    dist.barrier()
    expected = torch.arange(1024, device="cuda:0", dtype=torch.float32) + 1000 * (1 - rank)
    assert torch.equal(seen, expected)
    assert mine[1 - rank].item() == -7.0
    return True


@needs_cuda_library
@pytest.mark.gpu
def test_ipc_buffers_between_two_processes(rank_pool):
    assert rank_pool(2).run(_ipc_on_rank) == [True, True]


def test_library_calls_run_with_their_device_current(monkeypatch):
    """The library's device guard would restore a thread's previous device with cudaSetDevice,
    opening a context on it (GPU 0 for a thread that never chose one); calls switch with torch's
    guard first, so the library never switches."""
    import contextlib

    current, seen = [0], []

    @contextlib.contextmanager
    def device(index):
        previous, current[0] = current[0], index
        yield
        current[0] = previous

    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[0])
    monkeypatch.setattr(torch.cuda, "device", device)
    call = lambda index: seen.append((index, current[0])) or 0  # noqa: E731
    assert cuda_lib._on(3, call, 3) == 0 and cuda_lib._on(0, call, 0) == 0
    assert seen == [(3, 3), (0, 0)] and current == [0]
    # and every wrapper that hands a device to the library goes through _on
    import inspect
    import re

    source = inspect.getsource(cuda_lib)
    direct = re.findall(r"(?<!_on\()\blib\.ok_(signal_set|signal_wait|reduce_sum|ipc_\w+|free|stream_create)\(", source)
    assert direct == [], direct


@pytest.mark.gpu
def test_own_stream_is_none_of_torchs_pooled_streams():
    """The side stream that spin-waits on peers must not be a stream torch also hands to others (NCCL
    draws from the same pools): none of the 32 entries of either priority pool, and it runs work."""
    if not cuda_lib.is_loadable():
        pytest.skip("the CUDA library is not built (make cuda)")
    own = cuda_lib.own_stream("cuda")
    pooled = {torch.cuda.Stream(priority=p).cuda_stream for p in (0, -1) for _ in range(64)}
    assert own.cuda_stream not in pooled and own.device == torch.device("cuda", torch.cuda.current_device())
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    own.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(own):
        y = x * 2
    torch.cuda.current_stream().wait_stream(own)
    assert torch.equal(y, torch.arange(1 << 20, device="cuda", dtype=torch.float32) * 2)


@pytest.mark.parametrize("loadable", [True, False])
def test_side_stream_is_its_own_where_the_library_is_built(monkeypatch, loadable):
    from overlapkernels.comm import side_stream

    made = []
    monkeypatch.setattr(cuda_lib, "is_loadable", lambda: loadable)
    monkeypatch.setattr(cuda_lib, "own_stream", lambda device: made.append(("own", device)) or "own")
    monkeypatch.setattr(torch.cuda, "Stream", lambda device, priority=0: made.append(("pool", device, priority)) or "pool")
    monkeypatch.setattr(side_stream, "_own_streams", {})
    cuda1 = torch.device("cuda", 1)
    streams = [side_stream.CudaSideStream(cuda1, slot=s).stream for s in (0, 1, 0)]
    # one per slot, made once: a thread-world rank's runs reuse it (none is ever destroyed)
    if loadable:
        assert streams == ["own"] * 3 and made == [("own", cuda1)] * 2
    else:
        assert streams == ["pool"] * 3 and made == [("pool", cuda1, -1)] * 2


def test_side_stream_work_is_ordered_after_the_ranks_and_before_its_next_use(monkeypatch):
    """Stream order, CUDA faked: submitted work waits for what the rank's stream (of the side
    stream's device, whatever is current) enqueued before it, its inputs are kept from the allocator
    until the side stream is done, and synchronize orders the rank's later work after it."""
    import contextlib

    from overlapkernels.comm import side_stream

    log, cuda1 = [], torch.device("cuda", 1)

    class Stream:
        def __init__(self, name):
            self.name, self.device = name, cuda1

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    class Tensor:
        def record_stream(self, stream):
            log.append(f"input used on {stream.name}")

    @contextlib.contextmanager
    def on(stream):
        log.append(f"on {stream.name}")
        yield
        log.append("back")

    main = Stream("main")
    monkeypatch.setattr(side_stream, "own_streams", lambda device, slots: [Stream("side")])
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: main if device == cuda1 else Stream("other"))
    monkeypatch.setattr(torch.cuda, "stream", on)
    side = side_stream.CudaSideStream(cuda1)
    side.submit(lambda: log.append("copy"), keep_alive=[Tensor()])
    side.synchronize()
    assert log == ["side waits for main", "input used on side", "on side", "copy", "back", "main waits for side"]


def test_a_cuda_thread_world_makes_every_rank_stream_and_side_stream_together(monkeypatch):
    """Back to back at construction (hardware queues of their own, see side_stream.own_streams),
    ranks' streams first; each run and each side_stream() reuses them; a second world of the same
    size makes none."""
    from overlapkernels.comm import side_stream
    from overlapkernels.comm.thread_world import ThreadRank, ThreadWorld

    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    made = []
    monkeypatch.setattr(cuda_lib, "is_loadable", lambda: True)
    monkeypatch.setattr(cuda_lib, "own_stream", lambda device: made.append(device) or f"stream{len(made) - 1}")
    monkeypatch.setattr(side_stream, "_own_streams", {})
    world = ThreadWorld(3, device="cuda:1")
    assert made == [torch.device("cuda", 1)] * 6
    assert world._rank_streams == ["stream0", "stream1", "stream2"]
    assert [ThreadRank(world, r).side_stream().stream for r in range(3)] == ["stream3", "stream4", "stream5"]
    ThreadWorld(3, device="cuda:1")
    assert len(made) == 6


def test_a_gpu_thread_world_refuses_to_run_beside_an_earlier_runs_stragglers(monkeypatch):
    """Threads of a timed-out one-GPU run keep queueing kernels (on the streams a later world of the
    same size reuses): any later run on that GPU, from any world, says so instead of hanging or
    failing for their sake. Threads that have ended no longer count."""
    import threading

    from overlapkernels.comm import side_stream, thread_world

    monkeypatch.setattr(cuda_lib, "is_loadable", lambda: True)
    monkeypatch.setattr(cuda_lib, "own_stream", lambda device: object())
    monkeypatch.setattr(side_stream, "_own_streams", {})
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32")
    release = threading.Event()
    straggler = threading.Thread(target=release.wait, name="ok-thread-rank1", daemon=True)
    straggler.start()
    monkeypatch.setattr(thread_world, "_gpu_stragglers", {torch.device("cuda", 1): [straggler]})
    world = thread_world.ThreadWorld(2, device="cuda:1")
    try:
        with pytest.raises(RuntimeError, match=r"ThreadWorld on cuda:1: ok-thread-rank1 of an earlier run"):
            world.run(lambda ctx: None)
    finally:
        release.set()
        straggler.join()
    assert thread_world._gpu_stragglers[torch.device("cuda", 1)] == [straggler]  # (pruned at the next run)


def test_a_gpu_thread_world_warns_when_hardware_queues_are_too_few(monkeypatch):
    from overlapkernels.comm import side_stream
    from overlapkernels.comm.thread_world import ThreadWorld

    monkeypatch.setattr(cuda_lib, "is_loadable", lambda: True)
    monkeypatch.setattr(cuda_lib, "own_stream", lambda device: object())
    monkeypatch.setattr(side_stream, "_own_streams", {})
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)  # CUDA's default, 8: < 2 * 4 + 1
    with pytest.warns(UserWarning, match=r"CUDA_DEVICE_MAX_CONNECTIONS='8' gives fewer than 9 hardware queues"):
        ThreadWorld(4, device="cuda:1")
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "9")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ThreadWorld(4, device="cuda:1")


def test_flag_values_and_timeouts_are_checked_before_the_library():
    """ctypes wrapped them silently: a value of -1 became 0xFFFFFFFF, a timeout of -1 s ~585 years
    of unsigned nanoseconds (a wait that never times out); inf and nan failed inside ctypes."""
    flag, record = torch.zeros(1, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)
    for bad in (-1, 2 ** 32, 1.5, True):
        with pytest.raises(ValueError, match=rf"value={bad!r}: expected an integer in \[0, 2\*\*32\)"):
            cuda_lib.signal_set(flag, bad)
        with pytest.raises(ValueError, match=rf"expected={bad!r}: expected an integer in \[0, 2\*\*32\)"):
            cuda_lib.signal_wait(flag, bad, error_record=record, op="ok/test", rank=0, chunk=0)
    for bad in (-1, 0, float("inf"), float("nan"), "5"):
        with pytest.raises(ValueError, match=rf"timeout_s={bad!r}: expected a finite number of seconds > 0"):
            cuda_lib.signal_wait(flag, 1, error_record=record, op="ok/test", rank=0, chunk=0, timeout_s=bad)
