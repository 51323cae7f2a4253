"""The gloo process world: N CPU ranks kept alive and reused across many calls.

Spawning a rank costs a torch import (seconds on 2 cores), so tests and the CLI's ``--nproc``
start one pool per world size and send it picklable functions, and ranks are forked from a
forkserver that has imported torch once (``_rank_context``). Every call has a hard timeout: a
rank that blocks (a collective a peer never joins, a spin that never ends) costs one call, not
the whole run. Workers die with their parent (PR_SET_PDEATHSIG), so nothing is left orphaned.

The ranks see the same environment torchrun gives (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and rendezvous on a TCPStore that the parent hosts, as torchrun's agent does, so the
code under test goes through the same ``init_default_process_group`` as production.
"""
from __future__ import annotations

import ctypes
import faulthandler
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
from datetime import timedelta

DEFAULT_CALL_TIMEOUT_S = 120.0
# After one rank has failed, how long the others get to finish before the pool is torn down.
FAILURE_GRACE_S = 10.0
# How long a stuck rank gets to write its Python stacks (SIGUSR1, faulthandler) before it is killed.
STACK_DUMP_WAIT_S = 2.0
STACK_DUMP_LINES = 40


class RankError(RuntimeError):
    """One or more ranks raised; the message carries each failing rank's traceback."""


class RankTimeout(TimeoutError):
    """Ranks did not finish within the call's timeout; the pool was killed and will respawn."""


class Failure(str):
    """A failed rank's traceback text; ``headline``: its exception's first line, for the summary."""
    headline = ""


def current_failure(prefix: str = "") -> Failure:
    """The exception being handled, as a ``Failure`` (``prefix``: a line put before its traceback)."""
    exc = sys.exc_info()[1]
    failure = Failure(prefix + traceback.format_exc())
    if exc is not None:  # the type and the message's first line (not a note, not the message's tail)
        failure.headline = traceback.format_exception_only(type(exc), exc)[0].splitlines()[0].strip()
    return failure


def failure_summary(errors: dict, order, consequences=()) -> str:
    """One line per failed rank, in ``order`` (causes first): its exception and the message's first
    line (a ``Failure``'s headline; a plain text's last line: a death note). It goes right under a report's first line, ahead of the full tracebacks: those can
    run to hundreds of lines (interpreted kernels nest deep), and a log cut in the middle - CI
    keeps a head and a tail - must still say why each rank failed. ``consequences``: ranks that
    failed because another did (marked so)."""
    def headline(text: str) -> str:
        lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
        return (getattr(text, "headline", "") or (lines[-1] if lines else "(no traceback)"))[:300]

    return "".join(f"\n  rank {r}: {headline(errors[r])}{' (a consequence)' if r in consequences else ''}"
                   for r in order)


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: daemon processes still go when the parent exits cleanly
        pass


_PRELOAD = ["torch", "torch.distributed"]


def preload_in_ranks(*modules: str) -> None:
    """Modules the ranks' forkserver imports once besides torch, so that every rank forked from it
    has them (a test suite's torch.compile: dynamo and AOTAutograd take ~3 s of CPU a rank to
    import). Process-wide, and only before the first pool starts the server; a module that does
    not import (another torch's layout) is skipped by multiprocessing."""
    _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _rank_context():
    """Ranks start from multiprocessing's forkserver with torch imported: a fork of it costs
    milliseconds where a spawned interpreter's torch import cost ~2 s of CPU a rank (8 ranks on 2
    cores: ~7 s a pool). Never plain fork: the caller may hold threads and CUDA state (the
    forkserver is a fresh interpreter that only imported torch, no CUDA, no threads). The
    forkserver and its preload list are process-wide: the preload applies when multiprocessing
    starts the server, so a server someone else started first serves as is (only slower)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(_PRELOAD))
    return ctx


def _worker_main(rank: int, world_size: int, port: int, backend: str, conn, pg_timeout_s: float,
                 threads: int, stack_path: str, environ: dict) -> None:
    _die_with_parent()
    # the forkserver's environment is the caller's when the server started: take the caller's as it
    # is now, as a spawned rank would (a test's monkeypatched variable, say). (multiprocessing itself
    # passes sys.path and the working directory.) What torch read at its import in the forkserver
    # keeps the old values, but for TORCH_DISTRIBUTED_DEBUG, read again here; other variables that
    # torch reads at import only (TORCH_LOGS, say) must be set before the first pool starts.
    os.environ.clear()
    os.environ.update(environ)
    import torch.distributed

    torch.distributed.set_debug_level_from_env()
    # a rank that hangs (in a collective, a spin) is asked for its stacks before it is killed: the
    # only way a hang's report can say where each rank sat (its own timeout would fire too late)
    stack_file = open(stack_path, "w")  # (open as long as the process lives)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    os.environ.update({
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        # every rank connects as a client to the parent's store, as under torchrun
        "TORCHELASTIC_USE_AGENT_STORE": "True", "OMP_NUM_THREADS": str(threads),
    })
    try:
        import torch

        torch.set_num_threads(threads)
        from overlapkernels.parallel import init_default_process_group

        init_default_process_group(backend, timeout=timedelta(seconds=pg_timeout_s))
        conn.send(("ready", None, 1))
    except BaseException:
        conn.send(("error", current_failure(), 0))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        except Exception:  # the call did not unpickle here: report it, as a failure of this rank's call
            conn.send(("error", current_failure("the call's function or arguments could not be unpickled on this "
                                                "rank:\n"), _group_count()))
            continue
        if msg is None:
            break
        fn, args, kwargs = msg
        try:
            reply = ("ok", fn(*args, **kwargs), _group_count())
        except BaseException:
            reply = ("error", current_failure(), _group_count())
        try:
            conn.send(reply)
        except Exception:  # the result did not pickle
            conn.send(("error", current_failure(), _group_count()))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _group_count() -> int:
    """Process groups this rank holds (torch has no public list; destroy_process_group reads this)."""
    import torch.distributed as dist

    world = getattr(dist.distributed_c10d, "_world", None)
    return len(getattr(world, "pg_map", ())) if dist.is_initialized() else 0


class RankPool:
    """``RankPool(4).run(fn, *args)`` -> ``[fn(*args) on rank 0, ..., on rank 3]``.

    ``fn`` must be picklable (a module-level function). A raising rank turns into ``RankError``
    with its traceback; a call past ``timeout`` seconds into ``RankTimeout`` with the stuck ranks'
    Python stacks. After either (or any exception that interrupts a call) the pool is killed and
    respawns on the next call: a failed call can leave messages in flight that the next would
    receive.

    ``max_groups``: once a call leaves a rank holding more process groups than this, the pool is
    closed and respawns on the next call. Every ``init_parallel`` makes a device mesh of groups
    that live as long as the process, and each idle gloo group keeps threads that wake up: a pool
    living through a whole test session collected hundreds (measured: 300 idle groups cost a rank
    a quarter of a core and made its GEMMs 40% slower). Destroying a task's groups instead would
    break what caches them across calls (torch's DTensor redistribution plans, Megatron's
    parallel_state); a fresh process has no such caches.
    """

    def __init__(self, world_size: int, *, backend: str = "gloo", timeout: float = DEFAULT_CALL_TIMEOUT_S,
                 threads_per_rank: int = 1, max_groups: int | None = None):
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r}: expected an integer >= 1")
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        self.threads_per_rank = threads_per_rank
        self.max_groups = max_groups
        self.respawns = 0  # pools closed for holding more than max_groups groups
        self._procs: list = []
        self._conns: list = []
        self._store = None
        self._stack_dir = None

    # -- lifecycle -----------------------------------------------------------------------------
    def _start(self) -> None:
        import torch.distributed as dist

        # A fresh store per generation: keys of a killed generation must not leak into the next.
        self._store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=self.timeout))
        ctx = _rank_context()
        self._stack_dir = tempfile.mkdtemp(prefix="ok-rank-pool-")
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_worker_main, daemon=True, name=f"ok-rank{rank}",
                               args=(rank, self.world_size, self._store.port, self.backend, child_conn,
                                     self.timeout, self.threads_per_rank, self._stack_path(rank), dict(os.environ)))
            proc.start()
            child_conn.close()
            self._procs.append(proc)
            self._conns.append(parent_conn)
        try:
            self._collect("start-up", self.timeout)
        except BaseException:
            self._kill()
            raise

    def close(self) -> None:
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        deadline = time.monotonic() + 5.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self._kill()

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join()
        for conn in self._conns:
            conn.close()
        if self._stack_dir is not None:
            shutil.rmtree(self._stack_dir, ignore_errors=True)
        self._procs, self._conns, self._store, self._stack_dir = [], [], None, None

    def _stack_path(self, rank: int) -> str:
        return os.path.join(self._stack_dir, f"rank{rank}.txt")

    def _stacks_of(self, ranks: list) -> str:
        """The Python stacks of every thread of ``ranks`` (still alive), as faulthandler writes them."""
        alive = [r for r in ranks if self._procs[r].is_alive()]
        for r in alive:
            try:
                os.kill(self._procs[r].pid, signal.SIGUSR1)
            except OSError:
                pass
        # written from a signal handler, in pieces: done once every file has stopped growing
        deadline, sizes = time.monotonic() + STACK_DUMP_WAIT_S, None
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = [os.path.getsize(self._stack_path(r)) for r in alive]
            if now == sizes and all(now):
                break
            sizes = now
        out = ""
        for r in alive:
            with open(self._stack_path(r)) as f:
                lines = f.read().strip().splitlines()[:STACK_DUMP_LINES] or ["(no stack written)"]
            out += f"\n--- rank {r} of {self.world_size}, stuck, at (innermost first) ---\n" + "\n".join(lines) + "\n"
        return out

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- calls ---------------------------------------------------------------------------------
    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        name = getattr(fn, "__qualname__", repr(fn))
        if self._procs and not all(p.is_alive() for p in self._procs):  # one died since the last call
            dead = {r: p.exitcode for r, p in enumerate(self._procs) if not p.is_alive()}
            self._kill()
            raise RankError(f"{name}: ranks {sorted(dead)} died since the last call (exit codes "
                            f"{list(dead.values())}); the pool will respawn on the next call")
        if not self._procs:
            self._start()
        try:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send((fn, args, kwargs))
                except OSError as exc:  # (BrokenPipeError: the rank died just now)
                    raise RankError(f"{name}: rank {rank} could not be sent the call ({exc}); the pool will "
                                    "respawn on the next call") from exc
            results = self._collect(name, timeout or self.timeout)
        except BaseException:
            # Whatever ended the call early (a failed rank, a timeout, pytest-timeout's or Ctrl-C's
            # exception in the middle of _collect) leaves this generation unfit for another: replies
            # still unread would answer the next call, an async op or P2P message a failed rank left
            # behind would pair with the next call's. The next call starts a fresh one (seconds).
            self._kill()
            raise
        if self.max_groups is not None and self._most_groups > self.max_groups:
            self.close()
            self.respawns += 1
        return results

    def _death_note(self, rank: int) -> str:
        self._procs[rank].join(1.0)  # its pipe closed: the exit code follows within moments
        return f"process died with exit code {self._procs[rank].exitcode}"

    def _collect(self, what: str, timeout: float) -> list:
        deadline = time.monotonic() + timeout
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        self._most_groups = 0
        waiting = {conn: rank for rank, conn in enumerate(self._conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        while waiting:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            ready = mpc.wait(list(waiting) + list(sentinels), timeout=remaining)
            for obj in ready:
                if obj in waiting:
                    rank = waiting.pop(obj)
                    try:
                        status, value, groups = obj.recv()
                        self._most_groups = max(self._most_groups, groups)
                    except EOFError:
                        status, value = "error", self._death_note(rank)
                    except Exception:  # the reply did not unpickle here (its pipe is drained)
                        status, value = "error", current_failure("the rank's result could not be unpickled in "
                                                                 "the caller:\n")
                    if status == "error":
                        errors[rank] = value
                    else:
                        results[rank] = value
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = self._conns[rank]
                    if conn in waiting and not conn.poll():
                        waiting.pop(conn)
                        errors[rank] = self._death_note(rank)
            if errors:
                deadline = min(deadline, time.monotonic() + FAILURE_GRACE_S)
        stuck = sorted(waiting.values())
        if stuck or errors:
            report = failure_summary(errors, sorted(errors)) + "".join(
                f"\n--- rank {r} of {self.world_size} ---\n{tb}" for r, tb in sorted(errors.items()))
            if stuck:
                report += self._stacks_of(stuck)
            if errors:
                hung = f"; ranks {stuck} did not finish" if stuck else ""
                raise RankError(f"{what}: ranks {sorted(errors)} failed{hung}{report}")
            raise RankTimeout(f"{what}: ranks {stuck} of {self.world_size} did not finish within "
                              f"{timeout:g} s; the pool was killed and will respawn on the next call{report}")
        return [results[r] for r in range(self.world_size)]
