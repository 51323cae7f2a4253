"""How much communication was hidden behind computation, read off a chrome trace.

For every op range (``ok/<op>[<method>]`` and its ``.../backward``, as ``profiling.ranges.span``
names them in the fused ops, ring attention, fsdp and the pipeline runner) it takes the comm events
(NCCL kernels, gloo work, our ``/comm`` ranges) and the compute events (GEMM and attention kernels
or aten ops, our ``/compute`` ranges) that fall inside the op's window, on any thread or stream,
and reports the time each was busy (union of intervals), their intersection, and the fraction of
comm time hidden = intersection / comm busy. Works on torch.profiler traces from CPU (gloo) and
GPU (NCCL, CUDA kernels) runs alike.
"""
from __future__ import annotations

import bisect
import gzip
import json
import math
import os
import re
from collections import defaultdict

OP_RANGE = re.compile(r"^ok/([a-z_]+)(\[[^\]/]+\])?(/backward)?$")
# our own signalling / copy kernels are communication too, though their names end in _kernel
# (csrc's C++ kernels, signal_set_kernel(...), are named with their signature, so no "$" anchors).
# Memcpy DtoD is comm for the one-GPU thread world's pulls, and so also counts a rank's local copies.
COMM = re.compile(r"(^gloo:|nccl|/comm$|^c10d::|Memcpy PtoP|Memcpy DtoD|_wait_kernel|_signal_kernel|_pull_kernel|"
                  r"_publish_kernel|_flag_kernel|reduce_sum_kernel|signal_\w+_kernel)", re.IGNORECASE)
# cuBLAS names its Hopper GEMMs nvjet_* (CUDA >= 12.4), cuDNN its attention cudnn_*sdpa*; our Triton
# kernels end in _kernel (kineto names C++ kernels with their signature, ending in ")")
COMPUTE = re.compile(r"(/compute$|^aten::(mm|addmm|bmm|matmul|linear|_scaled_dot_product|scaled_dot_product)|"
                     r"gemm|gemv|sm\d+_xmma|cutlass|nvjet|splitKreduce|cudnn|fmha|sdpa|_kernel$|flash)", re.IGNORECASE)


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a, b) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# torch.profiler's GPU timeline; every other category (cpu_op, user_annotation, ...) is the host's
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"})
GPU_WORK_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
LAUNCH_CATS = frozenset({"cuda_runtime", "cuda_driver"})  # cudaLaunchKernel, cuLaunchKernel (Triton), ...


def load_events(trace) -> list[dict]:
    """The complete ("X") events of a chrome trace, and its begin/end ("B"/"E") pairs as complete
    events: a path, a parsed object with ``traceEvents``,
    or a list of events. Anything else is a ValueError naming the trace and what was expected."""
    where = "the trace"
    if isinstance(trace, (str, bytes)) or hasattr(trace, "__fspath__"):
        where = f"trace {os.fsdecode(trace)!r}"
        try:
            with open(trace, "rb") as f:  # torch writes .json.gz when asked: gzip's magic bytes tell
                gzipped = f.read(2) == b"\x1f\x8b"
            with (gzip.open(trace, "rt", encoding="utf-8") if gzipped else open(trace, encoding="utf-8")) as f:
                trace = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError, EOFError, gzip.BadGzipFile) as exc:  # (first: a
            # BadGzipFile is an OSError)
            raise ValueError(f"{where}: not JSON ({exc}); expected a chrome trace (torch.profiler "
                             "export_chrome_trace)") from None
        except OSError as exc:
            raise ValueError(f"{where}: cannot read it ({exc.strerror or exc}); expected a chrome trace JSON "
                             "file") from None
    if isinstance(trace, dict):
        if "traceEvents" not in trace:
            raise ValueError(f"{where}: a JSON object without 'traceEvents' (keys: {sorted(trace)[:5]}); expected "
                             "a chrome trace (torch.profiler export_chrome_trace)")
        trace = trace["traceEvents"]
    if not isinstance(trace, list):
        raise ValueError(f"{where}: {type(trace).__name__} where a list of trace events was expected")
    events, begun = [], defaultdict(list)  # (pid, tid) -> [(ts, index, "B"/"E" event)]
    for i, e in enumerate(trace):
        if not isinstance(e, dict):
            raise ValueError(f"{where}: event {i} is {type(e).__name__} {e!r:.40}; expected an object")
        if e.get("ph") in ("B", "E"):
            ts = e.get("ts")
            if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts):
                raise ValueError(f"{where}: duration event {i} ({e.get('name')!r}, ph {e['ph']!r}) needs a finite "
                                 f"numeric 'ts', got {ts!r}")
            begun[(e.get("pid"), e.get("tid"))].append((ts, i, e))
            continue
        if e.get("ph") != "X":
            continue
        if not isinstance(e.get("name"), str) or any(
                isinstance(e.get(k), bool) or not isinstance(e.get(k), (int, float)) for k in ("ts", "dur")):
            raise ValueError(f"{where}: complete event {i} ({e.get('name')!r}) needs a string 'name' and numeric "
                             f"'ts' and 'dur', got ts={e.get('ts')!r}, dur={e.get('dur')!r}")
        if not (math.isfinite(e["ts"]) and math.isfinite(e["dur"]) and e["dur"] >= 0):
            raise ValueError(f"{where}: complete event {i} ({e['name']!r}) needs a finite 'ts' and a finite 'dur' >= 0, "
                             f"got ts={e['ts']!r}, dur={e['dur']!r}")
        events.append(e)
    return events + _paired(begun)


def _paired(begun: dict) -> list[dict]:
    """Begin/end ("B"/"E") duration events - what some converters (Nsight's, Perfetto's) write
    instead of complete ones - as complete events: on each thread an E closes the latest open B
    (the trace format's nesting rule). A B never closed is left out (a trace cut short)."""
    complete = []
    for thread in begun.values():
        stack = []
        for ts, _, e in sorted(thread, key=lambda t: (t[0], t[1])):
            if e["ph"] == "B":
                stack.append(e)
            elif stack:
                b = stack.pop()
                if not isinstance(b.get("name"), str):
                    continue
                complete.append({**b, "ph": "X", "dur": ts - b["ts"], "args": {**(b.get("args") or {}),
                                                                               **(e.get("args") or {})}})
    return complete


def _timeline(events: list[dict]) -> list[dict]:
    """On CUDA, torch.profiler exports every range twice: on the host timeline (user_annotation,
    from enqueue to return) and on the GPU one (gpu_user_annotation, per stream, spanning the
    kernels launched inside it). Using both would count each op twice and mix host-side waits with
    kernels, so the GPU timeline, where the overlap actually happens, is used alone when present.
    (Op windows on GPU traces come from the host ranges instead: ``_launched_windows``.)"""
    if any(e.get("cat") in GPU_CATS for e in events):
        return [e for e in events if e.get("cat") in GPU_CATS]
    return [e for e in events if e.get("cat") not in GPU_CATS]


def _op_windows(events: list[dict]) -> list[tuple[str, float, float]]:
    """(name, start, end) per op call. A GPU range shows once per stream it launched work on:
    copies that carry the host range's ``External id`` (kineto's link to the call that made them)
    are one call, from the first copy's start to the last one's end, even where the streams' work
    did not overlap (an unoverlapped baseline: the collective, then the GEMM). Without that id,
    same-named ranges that overlap are one call (back-to-back ones, which only touch, are two)."""
    windows: list[list] = []
    last: dict[str, list] = {}
    by_call: dict[tuple, list] = {}
    for e in sorted((e for e in events if OP_RANGE.match(e["name"])), key=lambda e: e["ts"]):
        lo, hi = e["ts"], e["ts"] + e["dur"]
        call = (e.get("args") or {}).get("External id") if e.get("cat") == "gpu_user_annotation" else None
        prev = by_call.get((e["name"], call)) if call is not None else last.get(e["name"])
        if prev is not None and (call is not None or lo < prev[2]):
            prev[2] = max(prev[2], hi)
            continue
        window = [e["name"], lo, hi]
        windows.append(window)
        if call is not None:
            by_call[(e["name"], call)] = window
        else:
            last[e["name"]] = window
    return [tuple(w) for w in windows]


def _correlation(e: dict):
    return (e.get("args") or {}).get("correlation")


def _launched_windows(events: list[dict]) -> list[tuple[str, float, float]] | None:
    """GPU traces: (name, start, end) per op call, from the GPU work its host range launched.

    Kineto ties each kernel or copy to the innermost ``record_function`` range open at its launch
    only, so an op's GPU range misses the work launched inside its nested ``/comm`` and
    ``/compute`` ranges (and inside c10d's ``nccl:*`` ones): the op's window would shrink to the
    few kernels launched directly in it. Here every launch (``cuda_runtime`` / ``cuda_driver``
    events) made on the op range's thread between its start and end counts, through the
    correlation id it shares with its kernel or copy; the window spans that GPU work. So does every
    launch made while the range was open by a thread of the process that opens no op range: on CUDA
    the autograd engine launches backward's kernels from a device thread of its own, so a range
    around ``loss.backward()`` (fsdp's backward, a pipeline step) launched only the seed gradient
    itself, and its window had shrunk to that one fill kernel. A range that launched nothing keeps
    its host interval. None where the trace links no launch to GPU work (no correlation ids): then
    the GPU ranges are all there is (``_op_windows``)."""
    work: dict = {}
    for e in events:
        if e.get("cat") in GPU_WORK_CATS and (c := _correlation(e)) is not None:
            lo, hi = work.get(c, (math.inf, -math.inf))
            work[c] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    launches = defaultdict(list)  # (pid, tid) -> [(launch time, correlation)], sorted
    for e in events:
        if e.get("cat") in LAUNCH_CATS and (c := _correlation(e)) in work:
            launches[(e.get("pid"), e.get("tid"))].append((e["ts"], c))
    if not launches:
        return None
    ranges = sorted((e for e in events if e.get("cat") not in GPU_CATS | LAUNCH_CATS and OP_RANGE.match(e["name"])),
                    key=lambda e: e["ts"])
    open_on = defaultdict(list)  # (pid, tid) -> the op ranges' host intervals
    for e in ranges:
        open_on[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e["dur"]))
    # per process, the launches of threads that open no op range at all (the autograd engine's device
    # threads): not those of a thread that has ranges of its own, such as another rank's in the thread
    # world (ranks are threads of one process there), whose work outside its ops is no other rank's
    unowned = defaultdict(list)
    for (pid, tid), calls in launches.items():
        calls.sort()
        if (pid, tid) not in open_on:
            unowned[pid] += calls
    for calls in unowned.values():
        calls.sort()
    windows = []
    for e in ranges:
        lo, hi = e["ts"], e["ts"] + e["dur"]
        spans = []
        for calls in (launches.get((e.get("pid"), e.get("tid")), []), unowned.get(e.get("pid"), [])):
            first, last = bisect.bisect_left(calls, (lo,)), bisect.bisect_right(calls, (hi, math.inf))
            spans += [work[c] for _, c in calls[first:last]]
        windows.append((e["name"], min(s[0] for s in spans), max(s[1] for s in spans)) if spans else (e["name"], lo, hi))
    return windows


def overlap_report(trace) -> list[dict]:
    """One row per op call: name, start (us), duration, comm / compute busy, both, hidden fraction."""
    loaded = load_events(trace)
    windows = _launched_windows(loaded)
    events = _timeline(loaded)
    # op ranges are windows, never busy time themselves (ok/all_gather[nccl] names a backend), and
    # every other event is one or the other, never both (else it would overlap with itself)
    inner = [e for e in events if not OP_RANGE.match(e["name"])]
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in inner if COMM.search(e["name"])]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in inner
               if COMPUTE.search(e["name"]) and not COMM.search(e["name"])]
    rows = []
    for name, lo, hi in windows if windows is not None else _op_windows(events):
        clip = lambda ivs: _union([(max(s, lo), min(e, hi)) for s, e in ivs if e > lo and s < hi])  # noqa: E731
        c, k = clip(comm), clip(compute)
        busy_comm, busy_compute, both = _length(c), _length(k), _intersection(c, k)
        rows.append({"op": name, "start_us": lo, "dur_us": hi - lo, "comm_us": busy_comm,
                     "compute_us": busy_compute, "both_us": both,
                     "hidden": both / busy_comm if busy_comm > 0 else float("nan")})
    return rows


def summarize(rows: list[dict]) -> list[dict]:
    """Totals per op name (hidden fraction of the summed comm time)."""
    out = {}
    for r in rows:
        s = out.setdefault(r["op"], {"op": r["op"], "calls": 0, "dur_us": 0.0, "comm_us": 0.0, "compute_us": 0.0,
                                     "both_us": 0.0})
        s["calls"] += 1
        for k in ("dur_us", "comm_us", "compute_us", "both_us"):
            s[k] += r[k]
    for s in out.values():
        s["hidden"] = s["both_us"] / s["comm_us"] if s["comm_us"] > 0 else float("nan")
    return list(out.values())
