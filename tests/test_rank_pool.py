"""The gloo rank pool: results per rank, tracebacks in the report, hard timeouts, no orphans."""
import multiprocessing
import os
import signal

import pytest
import torch
import torch.distributed as dist

from overlapkernels.comm import rank_pool as rank_pool_module
from overlapkernels.comm.rank_pool import RankError, RankPool, RankTimeout


def _rank_and_sum():
    t = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t), os.environ["LOCAL_RANK"]


def test_runs_on_every_rank(rank_pool):
    assert rank_pool(2).run(_rank_and_sum) == [(0, 2, 3.0, "0"), (1, 2, 3.0, "1")]
    assert rank_pool(4).run(_rank_and_sum) == [(r, 4, 10.0, str(r)) for r in range(4)]


def _environment(name):
    return os.environ.get(name), torch.get_num_threads(), str(dist.get_debug_level())


def test_ranks_see_the_callers_environment_of_now(rank_pool, monkeypatch):
    """Ranks fork from a forkserver (torch imported once), whose environment is the caller's when it
    started: a variable set since must still reach a new pool's ranks, as it did a spawned rank's."""
    rank_pool(2).run(_rank_and_sum)  # the forkserver runs by now
    monkeypatch.setenv("OK_TEST_SET_LATER", "42")
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")  # torch read it at import, in the forkserver
    monkeypatch.delenv("HOME", raising=False)  # in the forkserver's environment, gone from the caller's since
    pool = RankPool(2, threads_per_rank=2)
    try:
        assert pool.run(_environment, "OK_TEST_SET_LATER") == [("42", 2, "DebugLevel.INFO")] * 2
        assert pool.run(_environment, "HOME") == [(None, 2, "DebugLevel.INFO")] * 2
    finally:
        pool.close()


def _fail_on_rank_1(message):
    if dist.get_rank() == 1:
        raise ZeroDivisionError(message)
    return "fine"


def test_failing_rank_traceback_is_reported(rank_pool):
    pool = rank_pool(2)
    with pytest.raises(RankError) as info:
        pool.run(_fail_on_rank_1, "planted failure 42")
    text = str(info.value)
    assert "ranks [1] failed" in text and "--- rank 1 of 2 ---" in text
    assert text.splitlines()[1] == "  rank 1: ZeroDivisionError: planted failure 42"  # ahead of the tracebacks
    assert "ZeroDivisionError: planted failure 42" in text and "_fail_on_rank_1" in text
    assert pool.run(_rank_and_sum)[1][2] == 3.0  # the pool is still usable


def _block_forever_on_rank_1():
    if dist.get_rank() == 1:
        dist.recv(torch.empty(1), src=0)  # rank 0 never sends: blocks until killed
    return dist.get_rank()


def _exit_on_rank_0():
    if dist.get_rank() == 0:
        os._exit(3)
    return "alive"


def test_timeout_and_death_are_failures_not_hangs():
    seen = []  # every generation of rank processes this pool started
    with RankPool(2, timeout=60.0) as pool:
        seen += [pool.run(os.getpid)]
        # with where the stuck rank sat: its own timeout (the process group's) would fire too late
        with pytest.raises(RankTimeout, match=r"(?s)ranks \[1\] of 2 did not finish within 3 s.*"
                                              r"--- rank 1 of 2, stuck, at \(innermost first\) ---.*"
                                              r"line \d+ in _block_forever_on_rank_1"):
            pool.run(_block_forever_on_rank_1, timeout=3.0)
        assert pool.run(_rank_and_sum)[0][2] == 3.0  # respawned after the kill
        seen += [pool.run(os.getpid)]
        with pytest.raises(RankError, match="rank 0 of 2 ---\nprocess died with exit code 3"):
            pool.run(_exit_on_rank_0, timeout=30.0)
        seen += [pool.run(os.getpid)]  # respawned after the death
    pids = [pid for generation in seen for pid in generation]
    assert len(set(pids)) == 6
    children = {p.pid for p in multiprocessing.active_children()}
    assert not children & set(pids), "a rank process outlived its pool"


class _Interrupted(Exception):
    pass


def test_an_interrupted_call_leaves_nothing_to_the_next():
    """pytest-timeout, Ctrl-C or a SIGTERM can interrupt a call while the pool waits for replies.
    The pool stayed up with the call's ranks still in it: their late replies answered the next call
    (every later call off by one), or, blocked as here, they never read it."""
    def interrupt(signum, frame):
        raise _Interrupted()

    with RankPool(2, timeout=60.0) as pool:
        first = pool.run(os.getpid)
        before = signal.signal(signal.SIGALRM, interrupt)
        try:
            signal.setitimer(signal.ITIMER_REAL, 1.0)
            with pytest.raises(_Interrupted):
                pool.run(_block_forever_on_rank_1)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, before)
        assert pool.run(_whoami, "next") == [("next", 0), ("next", 1)]
        assert not set(first) & set(pool.run(os.getpid))  # a fresh generation


def _fail_on_rank_0_while_rank_1_works():
    if dist.get_rank() == 0:
        raise RuntimeError("planted failure on rank 0")
    dist.recv(torch.empty(1), src=0)  # waits for rank 0, which will never send: only a kill ends it
    return "finished"


@pytest.mark.timeout(60)  # without the grace the call would wait for its own hour-long timeout
def test_a_failure_gives_the_others_a_grace_then_names_who_did_not_finish(monkeypatch):
    """A failed rank's peers may be blocked on it: after FAILURE_GRACE_S the call ends, naming them,
    instead of waiting for the call's own timeout."""
    monkeypatch.setattr(rank_pool_module, "FAILURE_GRACE_S", 0.5)
    with RankPool(2, timeout=3600.0) as pool:
        with pytest.raises(RankError, match=r"ranks \[0\] failed; ranks \[1\] did not finish"):
            pool.run(_fail_on_rank_0_while_rank_1_works)
        assert pool.run(_rank_and_sum)[0][2] == 3.0  # respawned after the kill


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size=0"):
        RankPool(0)


def _make_mesh_groups():
    import overlapkernels as ok

    ok.init_parallel(tp=2)  # a device mesh: a group per dimension, kept for the process's life
    return len(dist.distributed_c10d._world.pg_map)


def _group_count():
    return len(dist.distributed_c10d._world.pg_map)


def test_a_pool_holding_many_groups_respawns():
    """Idle gloo groups keep threads that wake up (hundreds slowed a whole session): past
    max_groups the pool closes after the call and the next call starts fresh ranks."""
    with RankPool(2, timeout=60.0, max_groups=3) as pool:
        assert pool.run(_group_count) == [1, 1] and pool.respawns == 0
        made = pool.run(_make_mesh_groups)
        assert min(made) > 3 and pool.respawns == 1
        assert pool.run(_group_count) == [1, 1] and pool.respawns == 1
    with RankPool(2, timeout=60.0, max_groups=1) as pool:  # at the limit, not past it: the ranks stay
        first = pool.run(os.getpid)
        assert pool.run(_group_count) == [1, 1] and pool.run(os.getpid) == first and pool.respawns == 0


class _NoUnpickle(Exception):
    """Pickles, but its __init__ takes two arguments, so unpickling (which calls it with the one
    in .args) fails."""

    def __init__(self, a, b):
        super().__init__(a)


def _reply_that_does_not_unpickle(call):
    import time

    if dist.get_rank() == 0:
        return _NoUnpickle(call, 2)
    time.sleep(0.3)  # answers after rank 0's reply failed in the caller
    return (call, dist.get_rank())


def _whoami(call):
    return (call, dist.get_rank())


def _exit_soon_on_rank_1():
    import threading

    if dist.get_rank() == 1:  # as an OOM kill, or os._exit from a library thread, between calls
        threading.Timer(0.2, lambda: os._exit(3)).start()
    return dist.get_rank()


class _FailsToUnpickle:
    def __reduce__(self):
        return (int, ("not a number",))


def test_replies_and_calls_that_do_not_unpickle_and_ranks_dying_between_calls():
    """A reply that failed to unpickle in the caller escaped before the other ranks' replies were
    read: they answered the next call (every later call off by one). A rank dying between calls
    broke every later call (BrokenPipeError). A call that failed to unpickle in a rank killed it
    and lost the traceback. Now each is a RankError and the pool goes on."""
    with RankPool(2, timeout=60) as pool:
        with pytest.raises(RankError, match="(?s)ranks \\[0\\] failed.*result could not be unpickled in the caller"):
            pool.run(_reply_that_does_not_unpickle, "call1")
        assert pool.run(_whoami, "call2") == [("call2", 0), ("call2", 1)]
        with pytest.raises(RankError, match="(?s)could not be unpickled on this rank.*invalid literal for int"):
            pool.run(_whoami, _FailsToUnpickle())
        assert pool.run(_whoami, "call3") == [("call3", 0), ("call3", 1)]
        assert pool.run(_exit_soon_on_rank_1) == [0, 1]
        pool._procs[1].join(10)
        with pytest.raises(RankError, match=r"ranks \[1\] died since the last call \(exit codes \[3\]\)"):
            pool.run(_whoami, "call4")
        assert pool.run(_whoami, "call5") == [("call5", 0), ("call5", 1)]  # a fresh generation
