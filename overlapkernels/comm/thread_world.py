"""The thread world: N ranks as N threads of one process (CPU tests of peer-memory kernels).

Every rank's buffers are plain CPU tensors of one address space, so the int64 peer-pointer
tables that kernels get are real, and Triton kernels run on them under ``TRITON_INTERPRET=1``
exactly as they would on peer-mapped GPU memory: loads and stores through the table, spin-waits
on ``tl.atomic_*`` flags that another rank's kernel sets.
"""
from __future__ import annotations

import queue
import threading
import time
import traceback

import torch

from .._compat import make_triton_interpreter_threadsafe
from .rank_pool import RankError, RankTimeout
from .symmetric import SymmetricTensor


class ThreadRank:
    """What one rank's function gets: its rank, a barrier and collective symmetric allocation."""

    def __init__(self, world: "ThreadWorld", rank: int):
        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.device = torch.device("cpu")
        self.timeout = world.timeout  # device-side waits give up after this many seconds
        self._alloc_seq = 0
        self._workspaces: dict = {}
        self._side = None

    def workspace(self, key, factory):
        """Buffers kept across calls (symmetric ones, epoch counters); ``factory(self)`` builds them
        on first use. Collective when the factory allocates: all ranks ask for the same keys in the
        same order, as they make the same op calls."""
        if key not in self._workspaces:
            self._workspaces[key] = factory(self)
        return self._workspaces[key]

    def side_stream(self) -> "SideStream":
        """This rank's copy engine: work submitted here runs in order, concurrently with the rank."""
        if self._side is None:
            self._side = SideStream(f"ok-thread-rank{self.rank}-copy")
        return self._side

    def barrier(self) -> None:
        try:
            self.world._barrier.wait(timeout=self.world.timeout)
        except threading.BrokenBarrierError:
            if self.world._failed.is_set():
                raise  # reported after the failing rank's own error
            raise RankTimeout(f"thread rank {self.rank}: barrier timed out after {self.world.timeout:g} s; a rank "
                              "did not arrive (finished early or stuck)") from None

    def alloc_symmetric(self, shape, dtype: torch.dtype, *, fill=0) -> SymmetricTensor:
        """Collective: every rank calls it in the same order and gets its view of one allocation."""
        seq = self._alloc_seq
        self._alloc_seq += 1
        buffers = self.world._shared_allocation(seq, tuple(shape), dtype, fill)
        self.barrier()  # like a symmetric-memory rendezvous: nobody uses it before all have it
        ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64)
        return SymmetricTensor(self.rank, self.world_size, buffers[self.rank], ptrs, tuple(buffers))


class SideStream:
    """A thread that runs submitted callables in order: the thread world's stand-in for a CUDA
    side stream driving the copy engine. ``synchronize`` waits and re-raises the first error."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, done = self._queue.get()
            if fn is None:
                done.set()
                return
            try:
                if self._error is None:
                    fn()
            except BaseException as exc:  # reported by synchronize, on the rank's thread
                self._error = exc
            finally:
                done.set()

    def submit(self, fn) -> threading.Event:
        done = threading.Event()
        self._queue.put((fn, done))
        return done

    def synchronize(self, timeout: float | None = None) -> None:
        if not self.submit(lambda: None).wait(timeout):
            raise TimeoutError(f"{self._thread.name}: side stream still busy after {timeout} s")
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._queue.put((None, threading.Event()))


class ThreadWorld:
    """``ThreadWorld(4).run(fn, *args)`` runs ``fn(ThreadRank, *args)`` on 4 threads -> 4 results."""

    def __init__(self, world_size: int, *, timeout: float = 60.0):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: expected an integer >= 1")
        self.world_size = world_size
        self.timeout = timeout
        self._barrier = threading.Barrier(world_size)
        self._lock = threading.Lock()
        self._allocs: dict[int, list] = {}
        self._failed = threading.Event()  # a rank raised: barrier breaks are consequences
        make_triton_interpreter_threadsafe()

    def _shared_allocation(self, seq: int, shape: tuple, dtype: torch.dtype, fill) -> tuple:
        with self._lock:
            if seq not in self._allocs:
                self._allocs[seq] = [tuple(torch.full(shape, fill, dtype=dtype) for _ in range(self.world_size)), 0]
            entry = self._allocs[seq]
            entry[1] += 1
            if entry[1] == self.world_size:  # the last rank to arrive drops the world's reference
                del self._allocs[seq]
            return entry[0]

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        self._barrier.reset()
        self._failed.clear()
        results: list = [None] * self.world_size
        errors: dict[int, str] = {}
        secondary: set[int] = set()

        def body(rank: int) -> None:
            ctx = ThreadRank(self, rank)
            try:
                results[rank] = fn(ctx, *args, **kwargs)
            except threading.BrokenBarrierError:  # a consequence, reported after the cause
                secondary.add(rank)
                errors[rank] = "(barrier aborted because another rank failed)\n" + traceback.format_exc()
            except BaseException:
                errors[rank] = traceback.format_exc()
                self._failed.set()
                self._barrier.abort()  # peers waiting on a barrier fail fast instead of hanging
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
        stuck = [r for r, t in enumerate(threads) if t.is_alive()]
        name = getattr(fn, "__qualname__", repr(fn))
        if stuck:
            self._barrier.abort()
            raise RankTimeout(f"{name}: thread ranks {stuck} of {self.world_size} still running after "
                              f"{limit:g} s (threads cannot be killed; spin-waits end at their own timeout)")
        if errors:
            order = sorted(errors, key=lambda r: (r in secondary, r))
            report = "".join(f"\n--- rank {r} of {self.world_size} ---\n{errors[r]}" for r in order)
            raise RankError(f"{name}: ranks {sorted(errors)} failed{report}")
        return results
