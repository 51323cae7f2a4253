"""Pipeline schedules as action lists, one per rank (the torch.distributed.pipelining IR, small).

An ``Action(op, stage, microbatch)`` is "F" (forward), "B" (input gradient), "W" (weight gradient)
or "BW" (both). Stage s lives on rank s % p; with ``num_virtual`` v each rank holds v stages
(s = chunk * p + rank), as in Megatron's interleaved schedule.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import NamedTuple

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
OPS = ("F", "B", "W", "BW")


class Action(NamedTuple):
    """A named tuple, as torch.distributed.pipelining's ``_Action``: ``op, stage, mb = action`` and
    comparisons with plain tuples work."""
    op: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{self.op}{self.stage}.{self.microbatch}"


@dataclass
class Schedule:
    kind: str
    num_ranks: int
    num_microbatches: int
    num_virtual: int
    actions: list = field(default_factory=list)  # actions[rank] -> list of Action

    @property
    def num_stages(self) -> int:
        return self.num_ranks * self.num_virtual

    def rank_of(self, stage: int) -> int:
        return stage % self.num_ranks


def _check(kind, p, m, v):
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    for name, value in (("num_stages", p), ("num_microbatches", m), ("num_virtual", v)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    if v != 1 and kind != "interleaved-1f1b":
        raise ValueError(f"num_virtual={v} needs kind='interleaved-1f1b' (got {kind!r})")
    if kind == "interleaved-1f1b" and m % p:
        raise ValueError(f"interleaved-1f1b needs num_microbatches to be a multiple of num_stages={p} "
                         f"(allowed: {p}, {2 * p}, {3 * p}, ...); got {m}")


def _gpipe(p, m):
    return [[Action("F", r, i) for i in range(m)] + [Action("BW", r, i) for i in range(m)] for r in range(p)]


def _one_f_one_b(p, m):
    out = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", r, i) for i in range(warmup)]
        f, b = warmup, 0
        while f < m:  # steady state: one forward, one backward
            acts.append(Action("F", r, f))
            acts.append(Action("BW", r, b))
            f, b = f + 1, b + 1
        acts += [Action("BW", r, i) for i in range(b, m)]
        out.append(acts)
    return out


def _interleaved(p, m, v):
    """Megatron's interleaved 1F1B: forward k runs chunk (k mod pv) // p on microbatch
    (k // pv) p + k mod p; backward k the same with chunks reversed."""
    total = m * v

    def fwd(k, r):
        chunk = (k % (p * v)) // p
        return Action("F", chunk * p + r, (k // (p * v)) * p + k % p)

    def bwd(k, r):
        chunk = v - 1 - (k % (p * v)) // p
        return Action("BW", chunk * p + r, (k // (p * v)) * p + k % p)

    out = []
    for r in range(p):
        # Megatron's warm-up; with one chunk per rank (which Megatron never interleaves) 1F1B's: the
        # same bubble, and a peak of p - r microbatches, not 2 (p - r) - 1
        warmup = min((p - r - 1) * 2 + (v - 1) * p if v > 1 else p - r - 1, total)
        acts = [fwd(k, r) for k in range(warmup)]
        for i in range(total - warmup):
            acts += [fwd(warmup + i, r), bwd(i, r)]
        acts += [bwd(k, r) for k in range(total - warmup, total)]
        out.append(acts)
    return out


def _zb_h1(p, m):
    """ZB-H1 (Qi et al. 2024, figure 3): 1F1B's order with each BW split into B and then its W at
    once, except rank r's first r W's, which move to the end of its list: rank r runs its last B
    r slots before rank 0 does and would idle until the step ends, so they fill that cool-down
    bubble. With t_f = t_b = t_w its bubble is a third of 1F1B's, and
    rank r holds at most p - r microbatches' activations plus r microbatches' W inputs: p at most,
    1F1B's peak (the tests check both). Running every W as late as possible instead fills the same
    bubble but keeps all m microbatches' W inputs alive until the end of the step."""
    out = []
    for r, acts in enumerate(_one_f_one_b(p, m)):
        order, tail = [], []
        for a in acts:
            if a.op != "BW":
                order.append(a)
                continue
            order.append(Action("B", r, a.microbatch))
            (tail if a.microbatch < r else order).append(Action("W", r, a.microbatch))
        out.append(order + tail)
    return out


def make_schedule(kind: str, num_stages: int, num_microbatches: int, *, num_virtual: int = 1) -> Schedule:
    """Action lists for ``num_stages`` pipeline ranks. ``num_stages`` counts ranks (the pipeline
    group's size, as in the issue's API); with ``num_virtual`` v each rank holds v stages, so the
    model is cut into ``num_stages * v`` pieces (``Schedule.num_stages``)."""
    _check(kind, num_stages, num_microbatches, num_virtual)
    p, m, v = int(num_stages), int(num_microbatches), int(num_virtual)  # (a numpy integer: a plain int)
    actions = {"gpipe": lambda: _gpipe(p, m), "1f1b": lambda: _one_f_one_b(p, m),
               "interleaved-1f1b": lambda: _interleaved(p, m, v), "zb-h1": lambda: _zb_h1(p, m)}[kind]()
    return Schedule(kind, p, m, v, actions)
