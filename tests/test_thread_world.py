"""The thread world: N ranks as threads, a real Triton all-gather through peer pointers and flags."""
import threading
import time

import pytest
import torch

from overlapkernels.comm.rank_pool import RankError, RankTimeout
from overlapkernels.comm.side_stream import ThreadSideStream
from overlapkernels.comm.thread_world import ThreadWorld
from overlapkernels import SignalTimeoutError  # the public name README gives
from overlapkernels.kernels.errors import ABORT_SLOT, new_error_record
from overlapkernels.kernels.triton import all_gather as ag
from overlapkernels.kernels.triton import signals as sig

STRAGGLER_DELAY_S = 0.3  # the straggler publishes late: peers must wait on its flag, not race it


def shard_of(rank, call, shape, dtype):
    """Distinct, exactly representable values per (rank, call, element)."""
    n = torch.Size(shape).numel()
    return (torch.arange(n, dtype=torch.float32) + 100 * rank + 10000 * call).to(dtype).reshape(shape)


def _all_gather_on_rank(ctx, shape, dtype, calls, straggler, block):
    n = torch.Size(shape).numel()
    # poisoned: a chunk read before its owner published shows up as NaN / garbage
    buf = ctx.alloc_symmetric((ctx.world_size * n,), dtype, fill=float("nan"))
    signals = ctx.alloc_symmetric((2 * ctx.world_size,), torch.int64)
    gather = ag.PeerAllGather(buf, signals, n, block=block)
    outs = []
    for call in range(calls):
        if ctx.rank == straggler:
            time.sleep(STRAGGLER_DELAY_S)  # models a slow rank, not a wait for the test's sake
        outs.append(gather(shard_of(ctx.rank, call, shape, dtype)))
    return outs


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("shape, dtype", [((37,), torch.float32), ((3, 5), torch.float16)])
def test_all_gather_exact_with_straggler(world, shape, dtype):
    straggler = world - 1
    results = ThreadWorld(world).run(_all_gather_on_rank, shape, dtype, 3, straggler, 16)
    for rank, outs in enumerate(results):
        for call, out in enumerate(outs):
            expected = torch.cat([shard_of(r, call, shape, dtype) for r in range(world)])
            assert out.dtype == dtype and out.shape == expected.shape
            assert torch.equal(out, expected), (rank, call)


def _all_gather_without_waiting(ctx, n, straggler, pulled):
    """The same steps as PeerAllGather minus the ready-flag waits: a planted race, made certain by
    ordering (the straggler publishes only once the others have pulled), not by a sleep."""
    buf = ctx.alloc_symmetric((ctx.world_size * n,), torch.float32, fill=float("nan"))
    signals = ctx.alloc_symmetric((2 * ctx.world_size,), torch.int64)
    gather = ag.PeerAllGather(buf, signals, n, block=16)
    out = torch.empty(ctx.world_size * n)
    if ctx.rank == straggler:
        assert pulled.wait(timeout=30)
    shard = shard_of(ctx.rank, 0, (n,), torch.float32)
    ag._ag_publish_kernel[(gather.num_blocks,)](shard, buf.peer_ptrs, n, RANK=ctx.rank, BLOCK=16)
    if ctx.rank != straggler:
        for src in range(ctx.world_size):
            gather.pull(out, src)
        pulled.set()
    ctx.barrier()
    return out


def test_planted_race_is_caught():
    """Without the ready-flag wait, a straggler's chunk is read before it exists; the exact
    comparison used above must see that."""
    world, n = 2, 20
    out = ThreadWorld(world).run(_all_gather_without_waiting, n, 1, threading.Event())[0]
    expected = torch.cat([shard_of(r, 0, (n,), torch.float32) for r in range(world)])
    assert torch.equal(out[:n], expected[:n])
    assert not torch.equal(out, expected)


def _all_gather_with_a_missing_rank(ctx, missing):
    n = 8
    buf = ctx.alloc_symmetric((ctx.world_size * n,), torch.float32)
    signals = ctx.alloc_symmetric((2 * ctx.world_size,), torch.int64)
    gather = ag.PeerAllGather(buf, signals, n, block=8, max_spins=50)
    if ctx.rank == missing:
        return "skipped the call"
    gather(torch.ones(n))


def test_missing_rank_times_out_naming_rank_and_chunk():
    with pytest.raises(RankError) as info:
        ThreadWorld(2).run(_all_gather_with_a_missing_rank, 1)
    text = str(info.value)
    assert "SignalTimeoutError: ok/all_gather: rank 0 timed out waiting for chunk 1 from rank 1 (call 1)" in text


def _bad_shard(ctx):
    buf = ctx.alloc_symmetric((ctx.world_size * 4,), torch.float32)
    signals = ctx.alloc_symmetric((2 * ctx.world_size,), torch.int64)
    gather = ag.PeerAllGather(buf, signals, 4)
    with pytest.raises(ValueError, match=r"shard: expected 4 elements of torch.float32, got 5 of torch.float32"):
        gather(torch.ones(5))
    with pytest.raises(ValueError, match="buf has 8 elements; expected world_size\\*chunk_numel = 2\\*3"):
        ag.PeerAllGather(buf, signals, 3)
    return True


def test_bad_input_is_rejected_before_any_signal():
    assert ThreadWorld(2).run(_bad_shard) == [True, True]


def _symmetric_views(ctx):
    sym = ctx.alloc_symmetric((3,), torch.float32)
    sym.local.fill_(ctx.rank)
    ctx.barrier()
    return [float(sym.peer(r)[0]) for r in range(ctx.world_size)], sym.peer_ptrs.tolist()


def test_alloc_symmetric_gives_every_rank_the_same_peers():
    results = ThreadWorld(3).run(_symmetric_views)
    assert all(views == [0.0, 1.0, 2.0] for views, _ in results)
    assert len({tuple(ptrs) for _, ptrs in results}) == 1


def test_symmetric_buffers_must_start_16_byte_aligned():
    """The peer kernels vectorise on that promise (signals.peer_ptr): a misaligned buffer is refused
    where a world hands it out, not left to fault on a GPU."""
    from overlapkernels.comm.symmetric import SymmetricTensor
    storage = torch.zeros(16, dtype=torch.float32)
    aligned, misaligned = storage[:4], storage[1:5]  # 4 bytes in
    ptrs = torch.tensor([aligned.data_ptr(), misaligned.data_ptr()])
    SymmetricTensor(0, 2, aligned, ptrs, (aligned, storage[4:8]))
    with pytest.raises(ValueError, match=r"ranks \[1\] start at addresses not divisible by 16"):
        SymmetricTensor(0, 2, aligned, ptrs, (aligned, misaligned))


def test_thread_world_reports_errors_and_timeouts():
    def fail(ctx):
        if ctx.rank == 1:
            raise KeyError("planted")
        ctx.barrier()  # aborted by the failing rank instead of hanging

    with pytest.raises(RankError, match="(?s)ranks \\[0, 1\\] failed.*KeyError: 'planted'.*BrokenBarrierError") as info:
        ThreadWorld(2).run(fail)
    # each rank's exception in one line under the first, the cause first: a log cut in the middle
    # (CI keeps a head and a tail of long tracebacks) still says why
    assert str(info.value).splitlines()[1:3] == ["  rank 1: KeyError: 'planted'",
                                                 "  rank 0: threading.BrokenBarrierError (a consequence)"]

    def fail_at_length(ctx):  # the summary takes the exception's first line, not its message's tail or a note
        error = ValueError("planted: the first line\nthe second line")
        error.add_note("a note")
        raise error

    with pytest.raises(RankError) as info:
        ThreadWorld(1).run(fail_at_length)
    assert str(info.value).splitlines()[1] == "  rank 0: ValueError: planted: the first line"

    release = threading.Event()

    def stuck(ctx):
        if ctx.rank == 0:
            release.wait(30)

    try:  # the report shows where the stuck rank's thread is (a GPU hang: the host call it sits in)
        with pytest.raises(RankTimeout, match=r"(?s)thread ranks \[0\] of 2 still running after 0.5 s.*"
                                              r"--- rank 0 of 2, still running, at ---\n.*in stuck\n.*release.wait"):
            ThreadWorld(2).run(stuck, timeout=0.5)
    finally:
        release.set()

    # one rank fails, its peer waits for a flag the failed rank would have set, and a third waits in
    # a barrier: the timeout names the blocking rank and keeps the failed rank's traceback
    world, gate = ThreadWorld(3, timeout=0.5), threading.Event()

    def cause(ctx):
        if ctx.rank == 0:
            raise RuntimeError("root cause on rank 0")
        if ctx.rank == 1:
            gate.wait(30)
        else:
            ctx.barrier()

    try:
        with pytest.raises(RankTimeout, match=r"(?s)thread ranks \[1\] of 3 still running after 0.5 s.*"
                                              r"ranks \[0, 2\] failed.*RuntimeError: root cause on rank 0"):
            world.run(cause)
        # the timed-out run's thread still holds the world: a next run is refused, not corrupted
        with pytest.raises(RuntimeError, match=r"ok-thread-rank1 of a run that timed out are still running"):
            world.run(lambda ctx: ctx.barrier())
    finally:
        gate.set()
    for thread in world._stragglers:
        thread.join(10)
    assert world.run(lambda ctx: ctx.rank) == [0, 1, 2]  # once it ended, the world works again
    # a rank that returns without the barrier its peer waits in: named, and the world is reusable
    def early(ctx):
        if ctx.rank == 1:
            ctx.barrier()

    with pytest.raises(RankTimeout, match=r"thread ranks \[1\] of 2 waited 0.3 s in a barrier that ranks \[0\] "
                                          r"never reached"):
        world2 = ThreadWorld(2, timeout=5)
        world2.run(early, timeout=0.3)
    assert world2.run(lambda ctx: ctx.rank) == [0, 1]
    for bad in (0, -5, float("inf")):
        with pytest.raises(ValueError, match=rf"timeout={bad!r}: expected a finite duration of at least 1 ms"):
            ThreadWorld(2, timeout=bad)
    for bad in (None, "3"):
        with pytest.raises(TypeError, match=rf"timeout={bad!r}: expected seconds \(int or float\) or a datetime"):
            ThreadWorld(2, timeout=bad)
    with pytest.raises(ValueError, match=r"world_size=True: expected an integer >= 1"):
        ThreadWorld(True)


def test_the_first_timeout_is_the_one_reported():
    err, flag = new_error_record("cpu"), torch.zeros(1, dtype=torch.int64)
    sig.wait_flag(flag, 1, err, sig.polls(2), code=sig.ERR_READY_TIMEOUT, rank=0, chunk=1, peer=1)
    sig.wait_flag(flag, 1, err, sig.polls(2), code=sig.ERR_PARTIAL_TIMEOUT, rank=0, chunk=2, peer=3)
    assert err[:4].tolist() == [1, 0, 1, 1]  # code, rank, chunk, peer of the first wait that gave up


@pytest.mark.timeout(60)
def test_after_a_timeout_the_calls_other_waits_give_up_at_once():
    """A dead peer costs a call one wait budget, not one per wait: the second wait's budget (10^9
    polls, hours in the interpreter) is never spent, since the record already holds a timeout.
    Without that, a fused GEMM waited once per tile - 16 times its 60 s budget at 8192 rows."""
    err, flag = new_error_record("cpu"), torch.zeros(1, dtype=torch.int64)
    sig.wait_flag(flag, 1, err, sig.polls(2), code=sig.ERR_READY_TIMEOUT, rank=0, chunk=1, peer=1)
    sig.wait_flag(flag, 1, err, sig.polls(10**9), code=sig.ERR_PARTIAL_TIMEOUT, rank=0, chunk=2, peer=3)
    assert err[:4].tolist() == [1, 0, 1, 1]


def test_a_release_timeout_names_the_previous_call():
    with pytest.raises(SignalTimeoutError, match=r"waiting for rank 3 to release chunk 1 of call 4 \(call 5\)"):
        sig.raise_if_timed_out(torch.tensor([2, 0, 1, 3], dtype=torch.int32), "op", 5)


def _partial_reader(ctx):
    buf, pads = ctx.alloc_symmetric((64,), torch.float32), ctx.alloc_symmetric((4,), torch.int64)
    gather = ag.PeerAllGather(buf, pads, 32, block=8)  # 4 blocks per chunk; call 1 may wait for a slow peer
    gather(torch.ones(32))
    ctx.barrier()
    if ctx.rank == 0:
        pads.local[3] = 1  # reader 1 released only 1 of its 4 blocks of call 1
        gather.max_spins = 50  # rank 1 is not coming: the release wait must give up, and quickly
        gather(torch.ones(32))


def test_a_publisher_waits_for_every_block_of_every_reader():
    with pytest.raises(RankError, match="rank 0 timed out waiting for rank 1 to release chunk 0 of call 1"):
        ThreadWorld(2).run(_partial_reader)


def test_a_side_stream_skips_queued_work_after_an_error_and_reports_it_once():
    side, ran = ThreadSideStream("probe"), []
    side.submit(lambda: 1 / 0)
    side.submit(lambda: ran.append("after the error"))
    with pytest.raises(ZeroDivisionError):
        side.synchronize()
    assert ran == []
    side.submit(lambda: ran.append("next"))
    side.synchronize()  # usable again
    side.close()
    assert ran == ["next"]


def test_device_waits_give_up_before_the_run_does():
    """So a hang is reported as the wait that failed (op, rank, chunk), not as a silent thread."""
    assert ThreadWorld(2, timeout=10).run(lambda ctx: ctx.wait_timeout) == [5.0, 5.0]


def test_cpu_world_without_the_interpreter_says_how_to_get_it():
    """Triton picks its interpreter when a kernel is defined: a CPU thread world in a process started
    without TRITON_INTERPRET=1 would fail at the first launch deep inside triton; it says why at once."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = "from overlapkernels.comm.thread_world import ThreadWorld; ThreadWorld(2)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines()[-1] == (
        "RuntimeError: ThreadWorld on CPU runs Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1 in the "
        "environment before triton or overlapkernels is imported (make test does)"), proc.stderr


def test_timed_waits_read_the_clock_in_every_thread():
    """_now_ns takes a block-wide minimum of one reading per lane: with fewer lanes than the
    program's threads, warps hold replicas the minimum does not combine and may leave a timed wait
    at different polls. The GEMMs' lanes cover their widest launch; the flag kernels' match theirs."""
    from overlapkernels.kernels.triton import tile_gemm as tg

    configs = [v for v in vars(tg).values() if isinstance(v, tg.GemmConfig)]
    assert len(configs) >= 5
    assert sig.GEMM_CLOCK_LANES.value >= max(32 * c.num_warps for c in configs)
    assert sig.FLAG_CLOCK_LANES.value == 32 * sig.FLAG_KERNEL_LAUNCH["num_warps"]


class _LaunchSpy:
    """Stands in for a Triton kernel: records each launch's options, then launches the real one."""

    def __init__(self, kernel, name, launches):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches.append((self.name, kwargs.get("num_warps"), kwargs.get("maxnreg")))
            return self.kernel[grid](*args, **kwargs)
        return launch


def _peer_ops_on_rank(ctx):
    import overlapkernels as ok

    for method in ("symm", "fused"):
        for _ in range(2):  # the second call waits for the first's slots to be consumed
            ok.all_gather_matmul(torch.ones(4, 8), torch.ones(8, 2), ctx, method=method)
            ok.matmul_reduce_scatter(torch.ones(4, 8), torch.ones(8, 2), ctx, method=method)
    buf = ctx.alloc_symmetric((ctx.world_size * 8,), torch.float32)
    gather = ag.PeerAllGather(buf, ctx.alloc_symmetric((2 * ctx.world_size,), torch.int64), 8, block=8)
    gather(torch.ones(8))
    return True


def test_flag_kernels_launch_as_one_warp_capped_in_registers(monkeypatch):
    """Every launch of a one-program flag kernel carries FLAG_KERNEL_LAUNCH (one warp, maxnreg 32),
    the options the compile script checks them under, so they fit beside a persistent GEMM's block.
    (Every launch goes through the wrappers in signals.py and all_gather.py, which look the kernel
    up in their module: the spies see the ops' launches too.)"""
    launches = []
    for module, name in ((sig, "_wait_kernel"), (sig, "_set_flag_kernel"), (sig, "_update_peer_flag_kernel"),
                         (ag, "_ag_signal_kernel")):
        monkeypatch.setattr(module, name, _LaunchSpy(getattr(module, name), name, launches))
    assert ThreadWorld(2, timeout=60).run(_peer_ops_on_rank) == [True, True]
    assert {name for name, _, _ in launches} == {"_wait_kernel", "_set_flag_kernel", "_update_peer_flag_kernel",
                                                 "_ag_signal_kernel"}
    bad = {launch for launch in launches if launch[1:] != (1, 32)}
    assert not bad, bad


def test_peer_all_gather_refuses_chunks_past_32_bit_offsets():
    """Its chunk bases are 64-bit; offsets within a chunk (program x block + lane) are not."""
    from types import SimpleNamespace

    buf = SimpleNamespace(world_size=2, local=torch.empty(0))
    with pytest.raises(ValueError, match=r"chunk_numel=2147483392: expected fewer than 2\^31 - block \(256\)"):
        ag.PeerAllGather(buf, None, 2 ** 31 - 256)


def _fails_between_allocations(ctx):
    ctx.alloc_symmetric((4,), torch.float32)
    if ctx.rank == 1:
        raise RuntimeError("planted: rank 1 fails before its second allocation")
    ctx.alloc_symmetric((8,), torch.float32)  # rank 0 alone: the barrier breaks


def _two_allocations(ctx):
    ctx.alloc_symmetric((4,), torch.float32)
    second = ctx.alloc_symmetric((16,), torch.float64)
    return tuple(second.local.shape), second.local.dtype, second.peer_ptrs.tolist()


def test_a_failed_run_leaves_no_half_taken_allocation_behind():
    """Rank 0 took the failed run's second allocation alone; the next run's ranks count theirs from
    0 again, and rank 0 was handed that stale float32 (8,) buffer while rank 1 got a fresh one:
    different shapes, and peer tables pointing at different allocations."""
    world = ThreadWorld(2, timeout=30)
    with pytest.raises(RankError, match="planted: rank 1 fails"):
        world.run(_fails_between_allocations)
    (shape0, dtype0, ptrs0), (shape1, dtype1, ptrs1) = world.run(_two_allocations)
    assert shape0 == shape1 == (16,) and dtype0 == dtype1 == torch.float64 and ptrs0 == ptrs1


def test_a_failed_runs_release_does_not_reach_the_next_run():
    """A rank's failure releases its peers' waits (their error records' abort slot): the next run's
    records start clear, or every wait of a reused world would give up at once."""
    world = ThreadWorld(2)

    def fail(ctx):
        ctx.error_record()
        if ctx.rank == 0:
            raise ValueError("planted")

    with pytest.raises(RankError, match="planted"):
        world.run(fail)
    assert world.run(lambda ctx: int(ctx.error_record()[ABORT_SLOT])) == [0, 0]
