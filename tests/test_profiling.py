"""Overlap report arithmetic on a synthetic trace with a known answer, and on a real CPU trace."""
import json
import math
import os

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.profiling.overlap_report import overlap_report, summarize
from overlapkernels.profiling.ranges import span
from overlapkernels.profiling.trace import profiled


def _x(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


def test_known_answer():
    trace = {"traceEvents": [
        _x("ok/all_gather_matmul[decomposed]", 0, 100),
        _x("gloo:send", 10, 40, tid=2),          # comm 10-50
        _x("gloo:recv", 40, 20, tid=3),          # comm 40-60 (overlaps the send: union 10-60)
        _x("aten::mm", 30, 20),                  # compute 30-50
        _x("ok/x/chunk1/compute", 55, 30),       # compute 55-85
        _x("aten::mm", 150, 10),                 # outside the op window: ignored
        _x("ok/matmul_reduce_scatter[baseline]", 200, 50),
        _x("ncclDevKernel_ReduceScatter", 200, 20, tid=7),
        _x("sm90_xmma_gemm_bf16", 225, 20, tid=7),
        {"ph": "i", "name": "gloo:send", "ts": 0},  # instant events are not intervals
    ]}
    rows = overlap_report(trace)
    assert [r["op"] for r in rows] == ["ok/all_gather_matmul[decomposed]", "ok/matmul_reduce_scatter[baseline]"]
    first, second = rows
    assert (first["comm_us"], first["compute_us"], first["both_us"]) == (50, 50, 25)  # 30-50 and 55-60
    assert first["hidden"] == 0.5
    assert (second["comm_us"], second["compute_us"], second["both_us"], second["hidden"]) == (20, 20, 0, 0.0)
    total = summarize(rows + [dict(first)])
    assert total[0]["calls"] == 2 and total[0]["hidden"] == 0.5


def test_no_comm_is_nan_not_zero():
    (row,) = overlap_report({"traceEvents": [_x("ok/ring_attention", 0, 10), _x("aten::mm", 1, 5)]})
    assert row["comm_us"] == 0 and math.isnan(row["hidden"])


def _traced_ops(trace_dir):
    def work(_):
        a, b = torch.randn(256, 128), torch.randn(128, 64)
        for method in ("baseline", "decomposed"):
            ok.all_gather_matmul(a, b, method=method)
        with span("ok/custom/step0/comm"):
            dist.barrier()
        return True

    profiled(work, {}, trace_dir)
    return os.path.exists(os.path.join(trace_dir, f"trace_rank{dist.get_rank()}.json"))


def test_real_cpu_trace(rank_pool, tmp_path):
    assert rank_pool(2).run(_traced_ops, str(tmp_path)) == [True, True]
    rows = {r["op"]: r for r in summarize(overlap_report(str(tmp_path / "trace_rank0.json")))}
    base, dec = rows["ok/all_gather_matmul[baseline]"], rows["ok/all_gather_matmul[decomposed]"]
    for r in (base, dec):
        assert r["calls"] == 1 and r["comm_us"] > 0 and r["compute_us"] > 0 and r["dur_us"] > 0
        assert 0.0 <= r["hidden"] <= 1.0
    json.dumps(list(rows.values()))  # serialisable


def test_cli_report(tmp_path, capsys):
    from overlapkernels.cli import main

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("ok/all_gather_matmul[fused]", 0, 10), _x("nccl:x", 0, 4),
                                                _x("aten::mm", 2, 6)]}))
    assert main(["profile", "report", str(path)]) == 0
    assert "50.0%" in capsys.readouterr().out
    assert main(["profile", "report", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["hidden"] == pytest.approx(0.5)


def test_an_event_is_comm_or_compute_never_both():
    """Our signalling kernels end in _kernel like GEMMs do: they must count as comm only."""
    (row,) = overlap_report({"traceEvents": [
        _x("ok/all_gather_matmul[fused]", 0, 100),
        _x("_wait_kernel", 0, 40, tid=2), _x("_ag_gemm_kernel", 50, 30, tid=3), _x("reduce_sum_kernel<float>", 90, 5)]})
    assert (row["comm_us"], row["compute_us"], row["both_us"]) == (45, 30, 0)
