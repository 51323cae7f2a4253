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


def test_overlap_efficiency_takes_every_time_from_one_timer(monkeypatch):
    """E = 1 - (T - T_gemm) / (T_baseline - T_gemm) subtracts times: the GEMM alone is timed as the
    methods are (barrier-started calls), not by do_bench, whose cache flush between calls and
    back-to-back launches measured another thing. A fake timer: GEMM 1 s, baseline 3 s,
    decomposed 2 s -> E 0.5, speedup 3 / 2."""
    import triton.testing

    from overlapkernels.bench import tp_ops

    fake = iter([1.0, 3.0, 2.0])
    monkeypatch.setattr(tp_ops, "time_calls", lambda fn, iters, *a, **k: [next(fake)] * iters)
    monkeypatch.setattr(triton.testing, "do_bench", lambda *a, **k: pytest.fail("do_bench times a row's reference"))
    monkeypatch.setattr(tp_ops.dist, "get_world_size", lambda group=None: 2)  # E is nan at world size 1
    config = tp_ops.TpOpsConfig(op="ag-matmul", shapes=(("tiny", (4, 4, 4)),), methods=("baseline", "decomposed"),
                                iters=2, warmup=0)
    rows = tp_ops.run_tp_ops(config)
    assert [(r["method"], r["gemm_us"], r["time_us"], r["efficiency"], r["speedup"]) for r in rows] == [
        ("baseline", 1e6, 3e6, 0.0, 1.0), ("decomposed", 1e6, 2e6, 0.5, 1.5)]


def test_overlap_efficiency_is_undefined_in_a_world_of_one(monkeypatch):
    """One rank communicates nothing: E is NaN whatever the (fake) times, the speedup still a ratio."""
    import math

    from overlapkernels.bench import tp_ops

    fake = iter([1.0, 3.0, 2.0])
    monkeypatch.setattr(tp_ops, "time_calls", lambda fn, iters, *a, **k: [next(fake)] * iters)
    config = tp_ops.TpOpsConfig(op="ag-matmul", shapes=(("tiny", (4, 4, 4)),), methods=("baseline", "decomposed"),
                                iters=1, warmup=0)
    rows = tp_ops.run_tp_ops(config)
    assert [(r["world_size"], r["speedup"]) for r in rows] == [(1, 1.0), (1, 1.5)]
    assert all(math.isnan(r["efficiency"]) for r in rows)
