"""Simulator of pipeline schedules: makespan, bubble, per-rank busy time and peak activations.

Each rank runs its actions in order; an action starts when its rank is free and its inputs exist:
F(s, m) needs F(s-1, m); B/BW(s, m) needs F(s, m) and the input gradient of B/BW(s+1, m); W(s, m)
needs B(s, m). Crossing ranks adds ``t_comm``. An action that can never start is a deadlock,
reported by name. Both ``simulate`` and ``validate`` check completeness first.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from .schedule import OPS, Action, Schedule


class ScheduleError(ValueError):
    """A schedule is incomplete, misplaced or deadlocks; the message names the action."""


@dataclass
class SimResult:
    schedule: Schedule
    makespan: float
    bubble_fraction: float
    busy: list
    peak_activations: list  # per rank: the most microbatches whose F ran and whose B (or BW) has not
    timeline: list  # per rank: [(start, end, Action)]
    # per rank: the most microbatches whose F ran and whose W (or BW) has not. Under a W-split schedule
    # a microbatch's B frees its activations but its W still reads the linears' inputs and output
    # gradients, held until then; equal to peak_activations for schedules without W
    peak_held: list = None


def _deps(action, last_stage):
    s, m = action.stage, action.microbatch
    if action.op == "F":
        return [("F", s - 1, m)] if s > 0 else []
    if action.op in ("B", "BW"):
        deps = [("F", s, m)]
        if s < last_stage:
            deps.append(("grad", s + 1, m))
        return deps
    return [("B", s, m)]  # W


def _deadlock_message(schedule: Schedule, pos: list, done: dict) -> str:
    """Names the first violated dependency: follow what the first blocked action waits for, and
    what holds that back, until the chain closes; in the loop some action waits for one queued
    behind another on its rank (dependencies alone never form a loop): that order is the error."""
    where = {(a.op, a.stage, a.microbatch): (r, i) for r, acts in enumerate(schedule.actions)
             for i, a in enumerate(acts)}
    heads = [acts[pos[r]] if pos[r] < len(acts) else None for r, acts in enumerate(schedule.actions)]
    blocked = ", ".join(str(h) for h in heads if h is not None)
    name = "{}{}.{}".format
    action, chain = next(h for h in heads if h is not None), []
    while action not in [c[0] for c in chain]:
        for dep in _deps(action, schedule.num_stages - 1):
            if dep[0] == "grad":  # the input gradient comes from B or BW of the next stage
                dep = ("B", dep[1], dep[2]) if ("B", dep[1], dep[2]) in where else ("BW", dep[1], dep[2])
            if dep not in done:
                break
        if dep not in where:
            return f"deadlock: {action} needs {name(*dep)}, which no rank runs; next on each rank: {blocked}"
        rank = where[dep][0]
        chain.append((action, dep, rank))
        action = heads[rank]  # dep itself when it is next on its rank, else what stands before it
    loop = chain[[c[0] for c in chain].index(action):]
    first, dep, rank = next(c for c in loop if heads[c[2]] != schedule.actions[c[2]][where[c[1]][1]])
    behind = "it" if heads[rank] == first else f"{heads[rank]} (blocked too)"
    return f"deadlock: {first} needs {name(*dep)}, which rank {rank} queues after {behind}; next on each rank: {blocked}"


def validate(schedule: Schedule) -> None:
    """Raise ``ScheduleError`` naming the first problem: a misplaced, duplicated or missing action,
    or a dependency that can never be met (deadlock)."""
    simulate(schedule)  # checks the actions first, then finds deadlocks by running them


def _check_actions(schedule: Schedule) -> None:
    """Every action once, on its stage's rank; every (stage, microbatch) forward and backward."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"schedule={type(schedule).__name__}: expected a Schedule (make_schedule(kind, num_ranks, "
                        "num_microbatches))")
    p, m, stages = schedule.num_ranks, schedule.num_microbatches, schedule.num_stages
    if len(schedule.actions) != p:
        raise ScheduleError(f"{len(schedule.actions)} action lists for {p} ranks")
    seen = set()
    for rank, acts in enumerate(schedule.actions):
        for a in acts:
            if not isinstance(a, Action):
                raise ScheduleError(f"rank {rank}: {a!r} is a {type(a).__name__}, not an Action(op, stage, microbatch)")
            if a.op not in OPS:
                raise ScheduleError(f"rank {rank}: {a} has unknown op {a.op!r}")
            if not (0 <= a.stage < stages and 0 <= a.microbatch < m):
                raise ScheduleError(f"rank {rank}: {a} is outside {stages} stages x {m} microbatches")
            if schedule.rank_of(a.stage) != rank:
                raise ScheduleError(f"rank {rank}: {a} belongs to rank {schedule.rank_of(a.stage)}")
            if (a.op, a.stage, a.microbatch) in seen:
                raise ScheduleError(f"rank {rank}: {a} appears twice")
            seen.add((a.op, a.stage, a.microbatch))
    for s in range(stages):
        for mb in range(m):
            if ("F", s, mb) not in seen:
                raise ScheduleError(f"F{s}.{mb} is missing")
            split = ("B", s, mb) in seen or ("W", s, mb) in seen
            if split and not (("B", s, mb) in seen and ("W", s, mb) in seen):
                raise ScheduleError(f"stage {s} microbatch {mb}: B and W must both appear")
            if split == (("BW", s, mb) in seen):
                raise ScheduleError(f"stage {s} microbatch {mb}: expected either BW or both B and W")


def simulate(schedule: Schedule, *, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 0.0,
             t_comm: float = 0.0) -> SimResult:
    for name, value in (("t_f", t_f), ("t_b", t_b), ("t_w", t_w), ("t_comm", t_comm)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
            raise ValueError(f"{name}={value!r}: expected a finite time >= 0")
    _check_actions(schedule)  # figures for an incomplete schedule would look valid and mean nothing
    cost = {"F": t_f, "B": t_b, "W": t_w, "BW": t_b + t_w}
    p, last = schedule.num_ranks, schedule.num_stages - 1
    done: dict = {}  # (kind, stage, mb) -> (finish time, rank)
    pos = [0] * p
    free = [0.0] * p
    timeline = [[] for _ in range(p)]
    live, held = [set() for _ in range(p)], [set() for _ in range(p)]
    peak, peak_held = [0] * p, [0] * p
    total = sum(len(a) for a in schedule.actions)
    finished = 0
    while finished < total:
        best = None
        for r in range(p):
            if pos[r] >= len(schedule.actions[r]):
                continue
            a = schedule.actions[r][pos[r]]
            start, ready = free[r], True
            for dep in _deps(a, last):
                key = dep if dep[0] != "grad" else None
                if dep[0] == "grad":  # the input gradient comes from B or BW of the next stage
                    key = ("B", dep[1], dep[2]) if ("B", dep[1], dep[2]) in done else ("BW", dep[1], dep[2])
                if key not in done:
                    ready = False
                    break
                t_dep, r_dep = done[key]
                start = max(start, t_dep + (t_comm if r_dep != r else 0.0))
            if ready and (best is None or start < best[0]):
                best = (start, r, a)
        if best is None:
            raise ScheduleError(_deadlock_message(schedule, pos, done))
        start, r, a = best
        end = start + cost[a.op]
        done[(a.op, a.stage, a.microbatch)] = (end, r)
        timeline[r].append((start, end, a))
        free[r] = end
        pos[r] += 1
        finished += 1
        if a.op == "F":
            live[r].add((a.stage, a.microbatch))
            held[r].add((a.stage, a.microbatch))
            peak[r], peak_held[r] = max(peak[r], len(live[r])), max(peak_held[r], len(held[r]))
        if a.op in ("B", "BW"):
            live[r].discard((a.stage, a.microbatch))
        if a.op in ("W", "BW"):
            held[r].discard((a.stage, a.microbatch))
    makespan = max(free)
    busy = [sum(e - s for s, e, _ in tl) for tl in timeline]
    bubble = (makespan * p - sum(busy)) / (makespan * p) if makespan > 0 else 0.0
    return SimResult(schedule, makespan, bubble, busy, peak, timeline, peak_held)
