"""The benchmark harness's call counts: every rank makes exactly warmup + iters calls, and only the
last iters are timed (no timing asserts: a fake clock)."""
import types

import pytest
import torch

from overlapkernels.bench import timing

pytestmark = pytest.mark.usefixtures("world_of_one")


def test_time_calls_times_only_the_calls_after_the_warmup(monkeypatch):
    """Call k takes 2**k seconds of a fake clock, so each sample says which call it timed: with
    warmup=2 and iters=3, calls 0-1 are untimed and the samples are calls 2, 3 and 4."""
    clock, calls = [0.0], []

    def fn():
        clock[0] += 2.0 ** len(calls)
        calls.append(len(calls))

    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    samples = timing.time_calls(fn, iters=3, warmup=2, device=torch.device("cpu"))
    assert calls == [0, 1, 2, 3, 4]
    assert samples == [4.0, 8.0, 16.0]
    assert timing.time_local(fn, iters=1, warmup=0, device=torch.device("cpu")) == [32.0]  # the CPU path too
    assert calls == [0, 1, 2, 3, 4, 5]
