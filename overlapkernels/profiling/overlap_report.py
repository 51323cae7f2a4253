"""How much communication was hidden behind computation, read off a chrome trace.

For every op range (``ok/<op>[<method>]``, as ``profiling.ranges.span`` names them) it takes the
comm events (NCCL kernels, gloo work, our ``/comm`` ranges) and the compute events (GEMM and
attention kernels or aten ops, our ``/compute`` ranges) that fall inside the op's window, on any
thread or stream, and reports the time each was busy (union of intervals), their intersection,
and the fraction of comm time hidden = intersection / comm busy. Works on torch.profiler traces
from CPU (gloo) and GPU (NCCL, CUDA kernels) runs alike.
"""
from __future__ import annotations

import json
import re

OP_RANGE = re.compile(r"^ok/([a-z_]+)(\[[a-z]+\])?$")
# our own signalling / copy kernels are communication too, though their names end in _kernel
COMM = re.compile(r"(^gloo:|nccl|/comm$|^c10d::|Memcpy PtoP|Memcpy DtoD|_wait_kernel|_signal_kernel|_pull_kernel|"
                  r"_publish_kernel|_flag_kernel|reduce_sum_kernel)", re.IGNORECASE)
COMPUTE = re.compile(r"(/compute$|^aten::(mm|addmm|bmm|matmul|linear|_scaled_dot_product|scaled_dot_product)|"
                     r"gemm|sm\d+_xmma|cutlass|_kernel$|flash)", re.IGNORECASE)


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


def _events(trace) -> list:
    if isinstance(trace, (str, bytes)) or hasattr(trace, "__fspath__"):
        with open(trace) as f:
            trace = json.load(f)
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def overlap_report(trace) -> list[dict]:
    """One row per op range: name, start (us), duration, comm / compute busy, both, hidden fraction."""
    events = _events(trace)
    # every event is one or the other, never both (else it would overlap with itself)
    comm = [(e["ts"], e["ts"] + e["dur"]) for e in events if COMM.search(e["name"])]
    compute = [(e["ts"], e["ts"] + e["dur"]) for e in events
               if COMPUTE.search(e["name"]) and not COMM.search(e["name"])]
    rows = []
    for op in sorted((e for e in events if OP_RANGE.match(e["name"])), key=lambda e: e["ts"]):
        lo, hi = op["ts"], op["ts"] + op["dur"]
        clip = lambda ivs: _union([(max(s, lo), min(e, hi)) for s, e in ivs if e > lo and s < hi])  # noqa: E731
        c, k = clip(comm), clip(compute)
        busy_comm, busy_compute, both = _length(c), _length(k), _intersection(c, k)
        rows.append({"op": op["name"], "start_us": lo, "dur_us": op["dur"], "comm_us": busy_comm,
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
