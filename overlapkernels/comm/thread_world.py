"""The thread world: N ranks as N threads of one process (tests of peer-memory kernels).

On CPU every rank's buffers are plain tensors of one address space, so the int64 peer-pointer
tables that kernels get are real, and Triton kernels run on them under ``TRITON_INTERPRET=1``
exactly as they would on peer-mapped GPU memory: loads and stores through the table, spin-waits
on ``tl.atomic_*`` flags that another rank's kernel sets. With ``device="cuda"`` it is the
one-GPU world: the N ranks share one GPU, each on its own stream (so one rank's spin-wait never
blocks another's signal), and the same compiled kernels run for real. No autograd there: torch
runs every CUDA backward node on one engine thread per device, shared by all calling threads, so
the ranks' backward passes would run one after another and deadlock at their first collective
(on CPU each thread runs its own backward; on GPUs use processes).
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
import traceback
import warnings
import weakref

import torch

from .._compat import make_triton_interpreter_threadsafe
from ..kernels.errors import ABORT_SLOT, SignalTimeoutError, new_error_record
from ..parallel import concrete_device, resolve_timeout
from .rank_pool import RankError, RankTimeout, current_failure, failure_summary
from .side_stream import CudaSideStream, ThreadSideStream, hardware_queues, own_streams
from .symmetric import SymmetricTensor


def _seconds(timeout) -> float:
    """A thread world's timeout (seconds or a timedelta), checked as the process groups' are."""
    resolved = resolve_timeout(timeout)
    if resolved is None:
        raise TypeError("timeout=None: expected seconds (int or float) or a datetime.timedelta")
    return resolved.total_seconds()


# How long released ranks get to finish their call (interpreted GEMMs over what did arrive) and
# raise, before they count as stuck.
RELEASE_GRACE_S = 10.0


class ThreadRank:
    """What one rank's function gets: its rank, a barrier and collective symmetric allocation."""

    def __init__(self, world: "ThreadWorld", rank: int):
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.device = world.device
        self.ranks_per_device = world.world_size if world.device.type == "cuda" else 1
        self.shares_context = world.device.type == "cuda"  # one process: one CUDA context for every rank
        self.timeout = world.timeout
        # device-side waits give up well before run() stops waiting for the threads, so a hang is
        # reported as the wait that failed (op, rank, chunk, peer) and no kernel outlives the call
        self.wait_timeout = world.timeout / 2
        self._alloc_seq = 0
        self._workspaces: dict = {}
        self._side = None

    def workspace(self, key, factory):
        """Buffers kept across calls (symmetric ones, epoch counters); ``factory(self)`` builds them
        on first use. Collective when the factory allocates: all ranks ask for the same keys in the
        same order, as they make the same op calls."""
        if key not in self._workspaces:
            with torch.inference_mode(False):  # (kept across calls: see alloc_symmetric)
                self._workspaces[key] = factory(self)
        return self._workspaces[key]

    def side_stream(self):
        """This rank's copy engine: work submitted here runs in order, concurrently with the rank."""
        if self._side is None:
            self._side = (CudaSideStream(self.device, slot=_stream_slot(self.world_size, self.rank, "side"))
                          if self.device.type == "cuda"
                          else ThreadSideStream(f"ok-thread-rank{self.rank}-copy"))
        return self._side

    def error_record(self) -> torch.Tensor:
        """A call's device error record, known to the world: when a rank fails, or the run's time is
        up, the world releases the interpreted waits that read it (``errors.ABORT_SLOT``)."""
        record = new_error_record(self.device)
        with self.world._lock:
            self.world._records.add(record)
            if self.world._released and self.device.type == "cpu":  # (a call begun after the release)
                record[ABORT_SLOT] = 1
        return record

    def check_errors(self, err: torch.Tensor, op: str, epoch: int) -> None:
        """Raise at once if a device-side wait of this call timed out (a test world: sync is fine;
        on a GPU only once the stream is idle: see raise_if_timed_out)."""
        from ..kernels.triton.signals import raise_if_timed_out

        raise_if_timed_out(err, op, epoch)

    def barrier(self) -> None:
        self.world._in_barrier.add(self.rank)
        try:
            self.world._barrier.wait(timeout=self.world.timeout)
        except threading.BrokenBarrierError:
            if self.world._failed.is_set():
                raise  # reported after the failing rank's own error
            raise RankTimeout(f"thread rank {self.rank}: barrier timed out after {self.world.timeout:g} s; a rank "
                              "did not arrive (finished early or stuck)") from None
        finally:
            self.world._in_barrier.discard(self.rank)

    def alloc_symmetric(self, shape, dtype: torch.dtype, *, fill=0) -> SymmetricTensor:
        """Collective: every rank calls it in the same order and gets its view of one allocation.
        Never an inference tensor, though the call that asks for it runs under inference_mode (an
        eval first): later calls outside it write into the buffer, which torch refuses for those."""
        with torch.inference_mode(False):
            return self._alloc_symmetric(shape, dtype, fill)

    def _alloc_symmetric(self, shape, dtype: torch.dtype, fill) -> SymmetricTensor:
        seq = self._alloc_seq
        self._alloc_seq += 1
        buffers = self.world._shared_allocation(seq, tuple(shape), dtype, fill)
        if self.device.type == "cuda":  # the fill must land before any peer writes a flag or partial
            torch.cuda.synchronize(self.device)
        self.barrier()  # like a symmetric-memory rendezvous: nobody uses it before all have it
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=self.device)
        return SymmetricTensor(self.rank, self.world_size, buffers[self.rank], ptrs, tuple(buffers))


# Threads of timed-out runs on each GPU, whatever world ran them: they go on spinning and queueing
# kernels on their streams (a later world of the same size reuses those streams), so every later
# one-GPU run would wait behind them and fail for their sake, or pass by their timing.
_gpu_stragglers: dict = {}


def _stream_slot(world_size: int, rank: int, use: str) -> tuple:
    return ("thread-world", world_size, rank, use)


def _where_stuck(thread: threading.Thread, frames: int = 10) -> str:
    """The innermost ``frames`` frames of a running thread: where a rank that never returned waits
    (on a GPU the host call a hang sits in - a device sync, a copy, a launch - says more than any
    timeout message can)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "  (ended meanwhile)\n"
    return "".join(traceback.format_stack(frame)[-frames:])


def _check_connections(world_size: int) -> None:
    """Warn when the GPU's hardware queues are too few for every rank's two streams: streams sharing
    a queue run in its order, so a rank's spin-wait could hold up the peer work it waits for."""
    need = 2 * world_size + 1  # each rank's stream and side stream, and the default stream
    if (hardware_queues() or 0) < need:
        raw = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")
        warnings.warn(f"ThreadWorld({world_size}) on a GPU: CUDA_DEVICE_MAX_CONNECTIONS={raw!r} gives fewer than {need} "
                      "hardware queues, so ranks' streams may share one and a spin-wait may block the signal it "
                      "waits for; set it (up to 32) before CUDA starts, as make gpu-check does", stacklevel=3)


def _check_triton_interprets() -> None:
    """On CPU the peer kernels only run in Triton's interpreter, which triton picks when a kernel is
    defined: without it the first launch fails deep inside triton ("0 active drivers")."""
    from ..kernels.triton import signals  # (lazily: comm itself does not need triton)

    if type(signals.peer_ptr).__name__ != "InterpretedFunction":
        raise RuntimeError("ThreadWorld on CPU runs Triton kernels in Triton's interpreter: set TRITON_INTERPRET=1 "
                           "in the environment before triton or overlapkernels is imported (make test does)")


class ThreadWorld:
    """``ThreadWorld(4).run(fn, *args)`` runs ``fn(ThreadRank, *args)`` on 4 threads -> 4 results."""

    def __init__(self, world_size: int, *, timeout: float = 60.0, device="cpu"):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: expected an integer >= 1")
        self.world_size = world_size
        self.timeout = _seconds(timeout)
        self.device = concrete_device(device)
        self._barrier = threading.Barrier(world_size)
        self._lock = threading.Lock()
        self._allocs: dict[int, list] = {}
        self._records: weakref.WeakSet = weakref.WeakSet()  # the run's error records (error_record)
        self._released = None  # why the run's waits were released: "failure", "deadline" or None
        self._failed = threading.Event()  # a rank raised: barrier breaks are consequences
        self._in_barrier: set = set()  # ranks waiting in barrier(): stuck because of the others
        self._stragglers: list = []  # threads of a timed-out run that have not ended yet
        if self.device.type == "cpu":
            _check_triton_interprets()
            make_triton_interpreter_threadsafe()
        else:  # every rank's stream and side stream: ours, made together (side_stream.own_streams)
            self._rank_streams = own_streams(self.device, [_stream_slot(world_size, r, use) for use in ("rank", "side")
                                                           for r in range(world_size)])[:world_size]
            _check_connections(world_size)

    def _shared_allocation(self, seq: int, shape: tuple, dtype: torch.dtype, fill) -> tuple:
        with self._lock:
            if seq not in self._allocs:
                self._allocs[seq] = [tuple(torch.full(shape, fill, dtype=dtype, device=self.device) for _ in range(self.world_size)), 0]
            entry = self._allocs[seq]
            entry[1] += 1
            if entry[1] == self.world_size:  # the last rank to arrive drops the world's reference
                del self._allocs[seq]
            return entry[0]

    def _release_waits(self, why: str) -> None:
        """End the run's interpreted spin-waits: each records its own timeout (naming its chunk and
        peer) and the op raises. Their poll budget alone cannot do it: an interpreted poll takes
        10-50x the nominal time on a loaded machine, so a peer that failed (or never came) would
        keep this rank spinning - a thread that cannot be killed, holding a core - for minutes.
        On a GPU the waits stop on the global timer instead, and a host write could not reach a
        record whose stream is busy spinning."""
        if self.device.type != "cpu":
            return
        with self._lock:
            self._released = self._released or why
            records = list(self._records)
        for record in records:
            record[ABORT_SLOT] = 1

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        if timeout is not None:
            timeout = _seconds(timeout)
        self._stragglers = [t for t in self._stragglers if t.is_alive()]
        if self.device.type == "cuda":  # any world's, on this GPU: see _gpu_stragglers
            _gpu_stragglers[self.device] = [t for t in _gpu_stragglers.get(self.device, []) if t.is_alive()]
            if _gpu_stragglers[self.device]:
                raise RuntimeError(f"ThreadWorld on {self.device}: {', '.join(t.name for t in _gpu_stragglers[self.device])} "
                                   "of an earlier run that timed out are still running; the kernels they queue "
                                   "would hold up this run's (and its device syncs wait for them), so its result "
                                   "would say nothing: run it in a new process")
        if self._stragglers:  # it would meet this run's ranks in the shared barrier and buffers
            raise RuntimeError(f"ThreadWorld: {', '.join(t.name for t in self._stragglers)} of a run that timed "
                               "out are still running (threads cannot be killed); use a new ThreadWorld")
        self._barrier.reset()
        self._in_barrier.clear()
        self._failed.clear()
        with self._lock:
            # a failed run can leave allocations some ranks never reached: this run's ranks count
            # their allocations from 0 again, and must not be handed those half-taken buffers
            self._allocs.clear()
            self._records, self._released = weakref.WeakSet(), None
        results: list = [None] * self.world_size
        errors: dict[int, str] = {}
        secondary: set[int] = set()

        def body(rank: int) -> None:
            ctx = ThreadRank(self, rank)
            try:
                if self.device.type == "cuda":  # one stream per rank: ranks run concurrently on the GPU
                    torch.cuda.set_device(self.device)
                    stream = self._rank_streams[rank]
                    try:
                        with torch.cuda.stream(stream):
                            results[rank] = fn(ctx, *args, **kwargs)
                    except BaseException:  # its kernels may still use buffers the next run reuses
                        with contextlib.suppress(Exception):  # (a second error must not hide the first)
                            stream.synchronize()
                        raise
                    stream.synchronize()
                else:
                    results[rank] = fn(ctx, *args, **kwargs)
            except threading.BrokenBarrierError:  # a consequence, reported after the cause
                secondary.add(rank)
                errors[rank] = current_failure("(barrier aborted because another rank failed)\n")
            except SignalTimeoutError:
                if self._released == "failure":  # a consequence too
                    secondary.add(rank)
                    errors[rank] = current_failure("(waits released because another rank failed)\n")
                else:
                    errors[rank] = current_failure()
                    self._failed.set()
                    self._barrier.abort()
            except BaseException:
                errors[rank] = current_failure()
                self._failed.set()
                self._barrier.abort()  # peers waiting on a barrier fail fast instead of hanging
                self._release_waits("failure")  # and peers spinning on this rank's signals too
            finally:
                if ctx._side is not None:
                    ctx._side.close()

        threads = [threading.Thread(target=body, args=(r,), name=f"ok-thread-rank{r}", daemon=True)
                   for r in range(self.world_size)]
        for t in threads:
            t.start()
        limit = timeout or self.timeout
        deadline = time.monotonic() + limit
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if any(t.is_alive() for t in threads) and self.device.type == "cpu" and len(self._records):
            # time is up, and a call is in flight: ranks spinning in its waits record which chunk
            # they waited for and raise (then a failed rank aborts the barrier its peers wait in)
            self._release_waits("deadline")
            grace = time.monotonic() + RELEASE_GRACE_S
            for r, t in enumerate(threads):
                if r not in self._in_barrier:
                    t.join(max(0.0, grace - time.monotonic()))
            if self._failed.is_set():
                for t in threads:
                    t.join(max(0.0, min(grace, time.monotonic() + 1.0) - time.monotonic()))
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        name = getattr(fn, "__qualname__", repr(fn))
        order = sorted(errors, key=lambda r: (r in secondary, r))
        report = failure_summary(errors, order, secondary) + "".join(
            f"\n--- rank {r} of {self.world_size} ---\n{errors[r]}" for r in order)
        if stuck:
            waiting = sorted(self._in_barrier.intersection(stuck))
            self._barrier.abort()
            for r in waiting:  # released by the abort: they end at once (only truly stuck ones stay)
                threads[r].join(1.0)
            self._stragglers = [threads[r] for r in stuck if threads[r].is_alive()]
            if self.device.type == "cuda":
                _gpu_stragglers.setdefault(self.device, []).extend(self._stragglers)
            blocking = [r for r in stuck if r not in waiting]
            report += "".join(f"\n--- rank {r} of {self.world_size}, still running, at ---\n{_where_stuck(threads[r])}"
                              for r in blocking)
            if blocking:
                what = (f"thread ranks {blocking} of {self.world_size} still running after {limit:g} s"
                        f"{f' (ranks {waiting} waiting for them in a barrier)' if waiting else ''}")
            else:
                what = (f"thread ranks {waiting} of {self.world_size} waited {limit:g} s in a barrier that ranks "
                        f"{[r for r in range(self.world_size) if r not in stuck]} never reached")
            raise RankTimeout(f"{name}: {what}{f'; ranks {sorted(errors)} failed' if errors else ''} (threads cannot "
                              f"be killed; spin-waits end at their own timeout){report}")
        if errors:
            released = f" (their waits released at the run's {limit:g} s limit)" if self._released == "deadline" else ""
            raise RankError(f"{name}: ranks {sorted(errors)} failed{released}{report}")
        return results

