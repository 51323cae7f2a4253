"""Overlap report arithmetic on a synthetic trace with a known answer, and on a real CPU trace."""
import json
import math
import os

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.profiling.overlap_report import load_events, overlap_report, summarize
from overlapkernels.profiling.ranges import span
from overlapkernels.profiling.trace import profiled


def _x(name, ts, dur, tid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid}


@pytest.mark.parametrize("events, want", [
    # a recv nested inside a send: comm is their union (50), not the last end seen
    ([_x("ok/all_gather[x]", 0, 100), _x("gloo:send", 0, 50, 2), _x("gloo:recv", 10, 10, 3), _x("aten::mm", 30, 30)],
     [dict(comm_us=50, both_us=20, hidden=0.4)]),
    # comm spilling over both edges of the op's window: only the parts inside count
    ([_x("ok/all_gather[x]", 100, 100), _x("gloo:send", 50, 100, 2), _x("gloo:recv", 180, 60, 3),
      _x("aten::mm", 100, 100)], [dict(comm_us=70, compute_us=100, both_us=70, hidden=1.0)]),
    # two back-to-back calls of one op: two rows
    ([_x("ok/all_gather[x]", 0, 10), _x("ok/all_gather[x]", 10, 10), _x("gloo:send", 2, 16, 2)],
     [dict(start_us=0, dur_us=10, comm_us=8), dict(start_us=10, dur_us=10, comm_us=8)]),
])
def test_interval_edges(events, want):
    rows = overlap_report(events)
    assert [{k: row[k] for k in w} for row, w in zip(rows, want)] == want and len(rows) == len(want)


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
    # the total's hidden fraction is of the summed comm time (25 of 80 us), not the mean of the calls' (0.25)
    total = summarize(rows + [dict(first, comm_us=30, both_us=0, hidden=0.0)])
    assert total[0]["hidden"] == 25 / 80


def test_begin_end_events_read_like_complete_ones():
    """Converters (Nsight's, Perfetto's) may write B/E pairs instead of X events: they were skipped and
    the report said "no op ranges". Each E closes its thread's latest open B, nested ones too."""
    def as_begin_end(events):
        out = []
        for e in events:
            if e.get("ph") == "X":
                begin = {k: v for k, v in e.items() if k != "dur"}
                out += [{**begin, "ph": "B"}, {"ph": "E", "ts": e["ts"] + e["dur"], "pid": e["pid"], "tid": e["tid"]}]
        return sorted(out, key=lambda e: (e["ts"], e["ph"] == "B"))  # (an E before a B at the same time)

    events = [_x("ok/all_gather_matmul[decomposed]", 0, 100), _x("ok/x/chunk1/comm", 5, 50),  # nested on tid 1
              _x("gloo:send", 10, 40, tid=2), _x("aten::mm", 30, 20), _x("ok/x/chunk1/compute", 55, 30),
              _x("ok/matmul_reduce_scatter[baseline]", 200, 50), _x("gloo:recv", 200, 20, tid=3)]
    want = overlap_report(events)
    assert overlap_report(as_begin_end(events)) == want and len(want) == 2
    unclosed = as_begin_end(events)[:-1]  # the last E lost (a trace cut short): that range is left out
    assert [r["op"] for r in overlap_report(unclosed)] == ["ok/all_gather_matmul[decomposed]"]


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


def _strict_json(text):
    def refuse(constant):
        raise ValueError(f"non-standard JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def test_cli_report(tmp_path, capsys):
    from overlapkernels.cli import main

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("ok/all_gather_matmul[fused]", 0, 10), _x("nccl:x", 0, 4),
                                                _x("aten::mm", 2, 6), _x("ok/ring_attention", 20, 5)]}))
    assert main(["profile", "report", str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].endswith(" 50.0%") and table[2].strip().startswith("ok/ring_attention") and table[2].endswith(" -")
    # calls, time, comm busy (0-4), compute busy (2-8), their overlap: each in its own column
    assert table[1].split() == ["ok/all_gather_matmul[fused]", "1", "10", "4", "6", "2", "50.0%"]
    assert main(["profile", "report", str(path), "--json"]) == 0
    rows = _strict_json(capsys.readouterr().out)  # standard JSON: an op without comm has hidden null, not NaN
    assert rows[0]["hidden"] == pytest.approx(0.5) and rows[1]["op"] == "ok/ring_attention"
    assert rows[1]["hidden"] is None


def test_cli_report_without_op_ranges_says_so(tmp_path, capsys):
    from overlapkernels.cli import main

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": [_x("aten::mm", 2, 6), _x("ok/pipeline/F0.0", 0, 9)]}))
    assert main(["profile", "report", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no op ranges" in out and str(path) in out and "was it recorded" not in out


@pytest.mark.parametrize("content, expected", [
    (None, "cannot read it"),                                   # missing file
    ("dir", "cannot read it"),                                  # a directory
    ("", "not JSON"),                                           # empty file
    ("{bad", "not JSON"),                                       # malformed
    ('{"foo": 1}', "without 'traceEvents'"),
    ("[1, 2]", "event 0 is int"),
    ("3", "int where a list of trace events was expected"),
    ('{"traceEvents": {"a": 1}}', "dict where a list of trace events was expected"),
    ('{"traceEvents": [{"ph": "X", "name": "aten::mm", "dur": 3}]}', "numeric 'ts' and 'dur'"),
    ('[{"ph": "X", "name": "aten::mm", "ts": "0", "dur": 3}]', "numeric 'ts' and 'dur'"),
    ('[{"ph": "X", "name": "aten::mm", "ts": 0, "dur": -30}]', "a finite 'dur' >= 0, got ts=0, dur=-30"),
    ('[{"ph": "X", "name": "aten::mm", "ts": NaN, "dur": 3}]', "got ts=nan, dur=3"),
    ('[{"ph": "X", "name": "aten::mm", "ts": 0, "dur": Infinity}]', "got ts=0, dur=inf"),
])
def test_bad_traces_name_the_file_and_what_was_expected(tmp_path, capsys, content, expected):
    from overlapkernels.cli import main

    path = tmp_path / "trace.json"
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=expected) as err:
        load_events(str(path))
    assert str(path) in str(err.value)
    assert main(["profile", "report", str(path)]) == 2  # one line, no traceback
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("overlapkernels: error: trace ") and expected in lines[0]


def test_gpu_timeline_is_used_alone_when_present():
    """On CUDA torch.profiler writes each range on the host timeline (user_annotation) and on the
    GPU one (gpu_user_annotation, once per stream it launched on). Only the GPU one counts: the op
    is one call, its window the union of its per-stream copies, and host events are ignored."""
    def ev(cat, name, ts, dur, tid):
        return {**_x(name, ts, dur, tid), "cat": cat}

    trace = {"traceEvents": [
        ev("user_annotation", "ok/all_gather_matmul[decomposed]", 0, 30, 1),   # host: enqueue, returns early
        ev("user_annotation", "ok/ag_matmul/chunk1/comm", 1, 2, 1),
        ev("cpu_op", "aten::mm", 3, 2, 1),
        ev("gpu_user_annotation", "ok/all_gather_matmul[decomposed]", 10, 60, 7),   # compute stream
        ev("gpu_user_annotation", "ok/all_gather_matmul[decomposed]", 5, 45, 20),   # comm stream
        ev("kernel", "ncclDevKernel_SendRecv", 5, 40, 20),                         # comm 5-45
        ev("gpu_user_annotation", "ok/ag_matmul/chunk1/comm", 5, 40, 20),          # the same interval again
        ev("kernel", "sm90_xmma_gemm_f32f32", 10, 20, 7),                           # compute 10-30
        ev("gpu_user_annotation", "ok/ag_matmul/chunk1/compute", 40, 30, 7),       # compute 40-70
        ev("kernel", "sm90_xmma_gemm_f32f32", 40, 30, 7),
        ev("gpu_user_annotation", "ok/all_gather_matmul[decomposed]", 80, 20, 7),  # the next call (alone)
        ev("kernel", "ncclDevKernel_SendRecv", 80, 20, 20),
    ]}
    rows = overlap_report(trace)
    assert [(r["op"], r["start_us"], r["dur_us"]) for r in rows] == [
        ("ok/all_gather_matmul[decomposed]", 5, 65), ("ok/all_gather_matmul[decomposed]", 80, 20)]
    assert (rows[0]["comm_us"], rows[0]["compute_us"], rows[0]["both_us"]) == (40, 50, 25)  # 10-30, 40-45
    assert rows[0]["hidden"] == 25 / 40 and rows[1]["hidden"] == 0.0
    # without GPU annotations (a CPU run) the host timeline is used, as before
    host_only = [e for e in trace["traceEvents"] if e["cat"] in ("user_annotation", "cpu_op")]
    (row,) = overlap_report(host_only)
    assert (row["dur_us"], row["comm_us"], row["compute_us"]) == (30, 2, 2)


def test_gpu_copies_of_one_call_are_one_window_by_external_id():
    """An unoverlapped baseline on GPU: the collective's stream, then the GEMM's, so the range's two
    per-stream copies do not overlap; kineto's External id (the host call that made them) still
    makes them one call, with the gap between them in its duration and nothing hidden."""
    def gpu(name, ts, dur, tid, call=None):
        e = {**_x(name, ts, dur, tid), "cat": "gpu_user_annotation" if name.startswith("ok/") else "kernel"}
        return {**e, "args": {"External id": call}} if call is not None else e

    op = "ok/all_gather_matmul[baseline]"
    events = [gpu(op, 100, 40, 7, call=3), gpu("ncclDevKernel_AllGather_RING_LL", 100, 40, 7),
              gpu(op, 145, 60, 0, call=3), gpu("sm90_xmma_gemm_bf16bf16_bf16f32", 145, 60, 0),
              gpu(op, 300, 10, 7, call=4), gpu("ncclDevKernel_AllGather_RING_LL", 300, 10, 7)]
    rows = overlap_report(events)
    assert [(r["start_us"], r["dur_us"], r["comm_us"], r["compute_us"], r["hidden"]) for r in rows] == [
        (100, 105, 40, 60, 0.0), (300, 10, 10, 0, 0.0)]
    # without the id (an older trace), copies that do not overlap cannot be told from two calls
    no_ids = [{k: v for k, v in e.items() if k != "args"} for e in events]
    assert len(overlap_report(no_ids)) == 3


def test_gpu_op_windows_span_the_work_their_host_range_launched():
    """Kineto ties a kernel to the innermost range open at its launch only: the op's own GPU range
    holds just what was launched directly in it (here one small kernel), not the NCCL and GEMM
    kernels launched inside its /comm and /compute ranges. The window comes from the host range:
    every launch on its thread within it, through the correlation id its kernel carries; a range
    on another thread (autograd's, backward) owns only its own thread's launches."""
    def ev(cat, name, ts, dur, tid, corr=None, pid=100):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
        return {**e, "args": {"correlation": corr}} if corr is not None else e

    fwd, bwd = "ok/all_gather_matmul[decomposed]", "ok/all_gather_matmul[decomposed]/backward"
    events = [
        ev("user_annotation", fwd, 0, 30, 1), ev("user_annotation", "ok/ag_matmul/chunk1/comm", 1, 3, 1),
        ev("cuda_runtime", "cudaLaunchKernel", 2, 1, 1, corr=11),                    # inside /comm
        ev("user_annotation", "ok/ag_matmul/chunk1/compute", 4, 3, 1),
        ev("cuda_driver", "cuLaunchKernel", 5, 1, 1, corr=12),                       # inside /compute
        ev("cuda_runtime", "cudaLaunchKernel", 8, 1, 1, corr=14),                    # directly in the op
        ev("user_annotation", bwd, 5, 35, 2), ev("cuda_runtime", "cudaLaunchKernel", 6, 1, 2, corr=13),
        ev("kernel", "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", 10, 40, 20, corr=11, pid=0),
        ev("kernel", "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", 12, 48, 7, corr=12, pid=0),
        ev("kernel", "void at::native::fill_kernel(float*)", 60, 1, 7, corr=14, pid=0),
        ev("gpu_user_annotation", fwd, 60, 1, 7, pid=0),                             # kineto: only corr 14
        ev("gpu_user_annotation", "ok/ag_matmul/chunk1/comm", 10, 40, 20, pid=0),
        ev("kernel", "ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 70, 20, 20, corr=13,
           pid=0),
    ]
    rows = overlap_report(events)
    assert [(r["op"], r["start_us"], r["dur_us"], r["comm_us"], r["compute_us"], r["both_us"]) for r in rows] == [
        (fwd, 10, 51, 40, 48, 38), (bwd, 70, 20, 20, 0, 0)]
    assert rows[0]["hidden"] == 38 / 40 and rows[1]["hidden"] == 0.0


def test_a_range_around_backward_spans_what_the_autograd_thread_launched():
    """On CUDA the autograd engine launches backward's kernels from its own device thread: a range
    around ``loss.backward()`` on the main thread (fsdp's backward, a pipeline step) launched only
    the seed gradient's fill there, and its window shrank to that 2 us kernel (0 comm, 0 compute).
    Launches made inside no op range of their thread count for the process's ranges open then."""
    def ev(cat, name, ts, dur, tid, corr=None, pid=100):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid}
        return {**e, "args": {"correlation": corr}} if corr is not None else e

    events = [
        ev("user_annotation", "ok/fsdp[zero3]/backward", 0, 1000, 1),
        ev("cuda_runtime", "cudaLaunchKernel", 5, 2, 1, corr=1),  # the seed gradient, on the main thread
        ev("cuda_runtime", "cudaLaunchKernel", 22, 2, 2, corr=2),  # the autograd thread: a dgrad GEMM,
        ev("cuda_runtime", "cudaLaunchKernel", 62, 2, 2, corr=3),  # a reduce-scatter,
        ev("cuda_runtime", "cudaLaunchKernel", 80, 2, 2, corr=4),  # the next GEMM
        ev("cuda_runtime", "cudaLaunchKernel", 1500, 2, 2, corr=5),  # after the range closed: not its
        ev("kernel", "void at::native::vectorized_elementwise_kernel<4, FillFunctor<float>>(int)", 10, 2, 7, corr=1,
           pid=0),
        ev("kernel", "sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x32", 25, 300, 7, corr=2, pid=0),
        ev("kernel", "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 70, 400, 20,
           corr=3, pid=0),
        ev("kernel", "sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x32", 330, 200, 7, corr=4, pid=0),
        ev("kernel", "sm90_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x32", 1600, 50, 7, corr=5, pid=0),
    ]
    (row,) = overlap_report(events)
    assert (row["start_us"], row["dur_us"], row["comm_us"], row["compute_us"], row["both_us"]) == (10, 520, 400, 500, 395)
    assert row["hidden"] == 395 / 400
    # the thread world: ranks are threads of one process, each with op ranges of its own; what rank 1
    # launches outside its ops (at 30, while rank 0's op is open) is not rank 0's
    ranks = [ev("user_annotation", "ok/all_gather_matmul[fused]", 0, 50, 1), ev("cuda_runtime", "cudaLaunchKernel", 2, 1, 1, corr=1),
             ev("user_annotation", "ok/all_gather_matmul[fused]", 100, 50, 3), ev("cuda_runtime", "cudaLaunchKernel", 30, 1, 3, corr=2),
             ev("cuda_runtime", "cudaLaunchKernel", 101, 1, 3, corr=3),
             ev("kernel", "sm90_xmma_gemm_bf16", 5, 40, 7, corr=1, pid=0), ev("kernel", "sm90_xmma_gemm_bf16", 45, 2000, 7, corr=2, pid=0),
             ev("kernel", "sm90_xmma_gemm_bf16", 2050, 10, 7, corr=3, pid=0)]
    assert [(r["start_us"], r["dur_us"]) for r in overlap_report(ranks)] == [(5, 40), (2050, 10)]
    # nor is what a thread of another process launched while the op was open (pid 200, at 30)
    other = ranks + [ev("cuda_runtime", "cudaLaunchKernel", 30, 1, 9, corr=6, pid=200),
                     ev("kernel", "sm90_xmma_gemm_bf16", 3000, 10, 7, corr=6, pid=0)]
    assert [(r["start_us"], r["dur_us"]) for r in overlap_report(other)] == [(5, 40), (2050, 10)]


def _fwd_bwd_ranges(trace_dir):
    """Every op forward and backward on 2 gloo ranks under the profiler -> the range names seen."""
    from overlapkernels.ops.ring_attention import ring_attention

    def work(_):
        torch.manual_seed(0)
        for method in ("baseline", "decomposed"):
            a = torch.randn(4, 6, requires_grad=True)
            b = torch.randn(6, 8, requires_grad=True)
            ok.all_gather_matmul(a, b, method=method).sum().backward()
            c = torch.randn(8, 4, requires_grad=True)
            ok.matmul_reduce_scatter(c, b.detach()[:4].clone().requires_grad_(), method=method).sum().backward()
        q, k, v = (torch.randn(1, 4, 2, 4, requires_grad=True) for _ in range(3))
        ring_attention(q, k, v).sum().backward()
        return True

    profiled(work, {}, trace_dir)
    return True


def test_forward_and_backward_have_op_windows_and_chunk_names(rank_pool, tmp_path):
    assert rank_pool(2).run(_fwd_bwd_ranges, str(tmp_path)) == [True, True]
    names = {e["name"] for e in load_events(str(tmp_path / "trace_rank0.json")) if e["name"].startswith("ok/")}
    for method in ("baseline", "decomposed"):
        for op in ("all_gather_matmul", "matmul_reduce_scatter"):
            assert {f"ok/{op}[{method}]", f"ok/{op}[{method}]/backward"} <= names
    # decomposed ranges are named by chunk (the ok/ag_matmul/chunk3/comm), never by step. Rank 0
    # of 2 gathers chunk 1 only (chunk 0 is its own); it reduces both chunks' running sums
    for op in ("ag_matmul", "ag_wgrad"):
        assert {f"ok/{op}/chunk1/comm", f"ok/{op}/chunk0/compute", f"ok/{op}/chunk1/compute"} <= names, op
        assert f"ok/{op}/chunk0/comm" not in names
    assert {f"ok/matmul_rs/chunk{c}/{kind}" for c in (0, 1) for kind in ("comm", "compute")} <= names
    assert not [n for n in names if "/step" in n and ("ag_" in n or "matmul_rs" in n)]
    assert {"ok/ring_attention", "ok/ring_attention/backward", "ok/ring_attention/backward/step0/compute",
            "ok/ring_attention/backward/step1/comm"} <= names
    rows = {r["op"]: r for r in summarize(overlap_report(str(tmp_path / "trace_rank0.json")))}
    for name in ("ok/all_gather_matmul[decomposed]/backward", "ok/matmul_reduce_scatter[decomposed]/backward",
                 "ok/ring_attention/backward"):
        assert rows[name]["calls"] == 1 and rows[name]["comm_us"] > 0 and rows[name]["compute_us"] > 0


def test_an_event_is_comm_or_compute_never_both():
    """Our signalling kernels end in _kernel like GEMMs do: they must count as comm only."""
    (row,) = overlap_report({"traceEvents": [
        _x("ok/all_gather_matmul[fused]", 0, 100),
        _x("_wait_kernel", 0, 40, tid=2), _x("_ag_gemm_kernel", 50, 30, tid=3), _x("reduce_sum_kernel<float>", 90, 5)]})
    assert (row["comm_us"], row["compute_us"], row["both_us"]) == (45, 30, 0)


@pytest.mark.parametrize("name, kind", [
    ("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT", "compute"),  # cuBLAS's Hopper GEMMs (CUDA >= 12.4)
    ("void splitKreduce_kernel<32, 16, int, float, __nv_bfloat16>(cublasSplitKParams<float>)", "compute"),
    ("cudnn_generated_fort_native_sdpa_sm90_knob_7_64x128x128_4x1x1_kernel0_0", "compute"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "compute"),
    ("_flash_fwd_kernel", "compute"),
    ("signal_set_kernel(unsigned long long*, unsigned long long)", "comm"),  # csrc's, named with a signature
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "comm"),
    ("_update_peer_flag_kernel", "comm"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>(int, float)", None),
])
def test_kernel_names_of_real_gpu_traces_are_classified(name, kind):
    (row,) = overlap_report([_x("ok/all_gather_matmul[fused]", 0, 100), _x(name, 10, 20, tid=2)])
    assert (row["comm_us"], row["compute_us"]) == {"comm": (20, 0), "compute": (0, 20), None: (0, 0)}[kind]


def test_a_gzipped_trace_reads_like_a_plain_one(tmp_path):
    """torch.profiler writes .json.gz when asked (export_chrome_trace("x.json.gz"))."""
    import gzip

    trace = {"traceEvents": [_x("ok/all_gather[gloo]", 0, 10), _x("gloo:all_gather", 2, 5, tid=2)]}
    (tmp_path / "t.json").write_text(json.dumps(trace))
    with gzip.open(tmp_path / "t.json.gz", "wt") as f:
        json.dump(trace, f)
    assert overlap_report(str(tmp_path / "t.json.gz")) == overlap_report(str(tmp_path / "t.json"))
    (tmp_path / "bad.json.gz").write_bytes(b"\x1f\x8b" + b"not gzip")
    with pytest.raises(ValueError, match="not JSON"):
        load_events(str(tmp_path / "bad.json.gz"))


def test_an_op_range_is_a_window_never_busy_time():
    """The collectives bench's range names its backend (ok/all_gather[nccl]): only the NCCL kernel
    inside it is comm, not the whole range."""
    (row,) = overlap_report({"traceEvents": [
        {**_x("ok/all_gather[nccl]", 0, 100, tid=7), "cat": "gpu_user_annotation"},
        {**_x("ncclDevKernel_AllGather_RING_LL", 30, 20, tid=7), "cat": "kernel"}]})
    assert (row["dur_us"], row["comm_us"], row["compute_us"]) == (100, 20, 0)


def test_fsdp_pipeline_and_collectives_traces_have_op_windows(rank_pool, tmp_path):
    """`bench fsdp|pipeline|collectives --profile` traces used to hold no op range, so the report
    had nothing to say about them."""
    from overlapkernels.bench import collectives as cb
    from overlapkernels.bench import fsdp as fb
    from overlapkernels.bench import pipeline as pb

    runs = {"fsdp": (fb.rank_main, fb.config_dict(fb.FsdpConfig(layers=2, width=8, batch=4, stages=(3,),
                                                                prefetches=(1,), iters=1, warmup=0))),
            "pipeline": (pb.rank_main, pb.config_dict(pb.PipelineBenchConfig(kinds=("1f1b",), microbatches=2,
                                                                             width=4, layers_per_stage=2, batch=4,
                                                                             iters=1, warmup=0))),
            "collectives": (cb.rank_main, cb.config_dict(cb.CollectivesConfig(ops=("all_gather",), sizes=(64,),
                                                                              iters=1, warmup=0)))}
    expected = {"fsdp": ["ok/fsdp[zero3]", "ok/fsdp[zero3]/backward"], "pipeline": ["ok/pipeline[1f1b]"],
                "collectives": ["ok/all_gather[gloo]"]}
    for kind, (rank_main, config) in runs.items():
        rank_pool(2).run(profiled, rank_main, config, str(tmp_path / kind))
        rows = {r["op"]: r for r in summarize(overlap_report(str(tmp_path / kind / "trace_rank0.json")))}
        for name in expected[kind]:
            assert rows[name]["calls"] >= 1 and rows[name]["comm_us"] > 0, (kind, sorted(rows))
        if kind != "collectives":  # (a collective has nothing to hide behind)
            assert all(rows[name]["compute_us"] > 0 for name in expected[kind]), (kind, rows)


def test_an_nvtx_range_is_closed_when_its_body_raises(monkeypatch):
    """On CUDA a span pushes an NVTX range: an exception inside must still pop it, else every later
    range nests under the failed one on the Nsight timeline."""
    seen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: seen.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: seen.append(("pop",)))
    with pytest.raises(RuntimeError, match="planted"):
        with span("ok/ag_matmul/chunk3/comm"):
            raise RuntimeError("planted")
    with span("ok/ag_matmul/chunk3/compute"):
        pass
    assert seen == [("push", "ok/ag_matmul/chunk3/comm"), ("pop",), ("push", "ok/ag_matmul/chunk3/compute"), ("pop",)]
