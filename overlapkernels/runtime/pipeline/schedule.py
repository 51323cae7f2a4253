"""Pipeline schedules as action lists, one per rank (the torch.distributed.pipelining IR, small).

An ``Action(op, stage, microbatch)`` is "F" (forward), "B" (input gradient), "W" (weight gradient)
or "BW" (both). Stage s lives on rank s % p; with ``num_virtual`` v each rank holds v stages
(s = chunk * p + rank), as in Megatron's interleaved schedule. ZB-V places its two chunks per rank
in a V instead: stage s on rank s going down, stage 2p - 1 - s coming back up (``Schedule.rank_of``,
``Schedule.stage_of``), so rank 0 holds the first and the last stage.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import NamedTuple

KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
V_KINDS = ("zb-v",)  # kinds whose two chunks per rank sit in a V (see the module's docstring)
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
        """The pipeline rank that runs ``stage``."""
        _check_index("stage", stage, self.num_stages)
        if self.kind in V_KINDS:  # down the ranks, then back up: stages r and 2p - 1 - r on rank r
            return stage if stage < self.num_ranks else self.num_stages - 1 - stage
        return stage % self.num_ranks

    def stage_of(self, rank: int, chunk: int) -> int:
        """The stage that ``rank`` runs as its chunk ``chunk`` (its ``chunk``-th stage module)."""
        _check_index("rank", rank, self.num_ranks)
        _check_index("chunk", chunk, self.num_virtual)
        if self.kind in V_KINDS:
            return rank if chunk == 0 else self.num_stages - 1 - rank
        return chunk * self.num_ranks + rank


def _check_index(name: str, value, count: int) -> None:
    # (a stage, rank or chunk out of range mapped quietly to another one's place: -1, or a V's mirror)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < count:
        raise ValueError(f"{name}={value!r}: expected an integer from 0 to {count - 1}")


def _check(kind, p, m, v):
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}: expected one of {list(KINDS)}")
    for name, value in (("num_stages", p), ("num_microbatches", m), ("num_virtual", v)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name}={value!r}: expected an integer >= 1")
    if kind in V_KINDS and v not in (1, 2):
        raise ValueError(f"num_virtual={v}: {kind} runs exactly 2 chunks per rank (the V); pass 2, or leave the default")
    if v != 1 and kind not in ("interleaved-1f1b", *V_KINDS):
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


def _zb_v(p, m):
    """ZB-V (Qi et al. 2024, section 6): rank r holds stage r of the way down and stage 2p - 1 - r of
    the way back up, each half a 1F1B stage. Warm-up: the way down fills (2(p - r) - 1 forwards),
    then the way up reaches the rank, then its first backwards start (each W at once); steady
    state: F, B and W of each chunk in turn; cool-down: the last r pairs of B's go first and their
    W's fill the tail. At t_f = t_b = t_w and m >= 2p - 1 rank r runs without a gap from its start
    (after r forwards) for 6m (chunk) forwards' time, so the makespan is 6m + p - 1, the least any
    schedule can have (rank p - 1 waits p - 1 forwards for its first input; each rank idles p - 1
    in all, before and after), with 2p half-stage activations per rank at most: 1F1B's peak of p
    stages. The pattern needs 2p - 1 microbatches to fill the V;
    with fewer it is built for 2p - 1 and the missing microbatches' actions are left out."""
    n = max(m, 2 * p - 1)
    out = []
    for r in range(p):
        down, up = r, 2 * p - 1 - r
        done = {(op, s): 0 for op in "FBW" for s in (down, up)}  # actions of each kind made so far
        acts = []

        def run(*ops):
            for op in ops:
                acts.append(Action(op[0], op[1], done[op]))
                done[op] += 1

        f0, b0, w0, f1, b1, w1 = ("F", down), ("B", down), ("W", down), ("F", up), ("B", up), ("W", up)
        run(*[f0] * (2 * (p - r) - 1))
        for _ in range(r):
            run(f1, f0)
        for _ in range(p - r):
            run(f1, b1, w1)
        while done[f0] < n or done[f1] < done[f0]:
            run(*([f0] if done[f0] < n else []), b0, w0, f1, b1, w1)
        for _ in range(r):
            run(b0, b1)
        for _ in range(p - r):
            run(b0, w0)
        run(*[w1] * (done[b1] - done[w1]), *[w0] * (done[b0] - done[w0]))
        out.append([a for a in acts if a.microbatch < m])
    return out


def make_schedule(kind: str, num_stages: int, num_microbatches: int, *, num_virtual: int = 1) -> Schedule:
    """Action lists for ``num_stages`` pipeline ranks. ``num_stages`` counts ranks (the pipeline
    group's size, as in the issue's API); with ``num_virtual`` v each rank holds v stages, so the
    model is cut into ``num_stages * v`` pieces (``Schedule.num_stages``). "zb-v" always holds two
    chunks per rank (``num_virtual`` 2, or the default 1 taken as 2)."""
    _check(kind, num_stages, num_microbatches, num_virtual)
    p, m, v = int(num_stages), int(num_microbatches), int(num_virtual)  # (a numpy integer: a plain int)
    v = 2 if kind in V_KINDS else v
    actions = {"gpipe": lambda: _gpipe(p, m), "1f1b": lambda: _one_f_one_b(p, m),
               "interleaved-1f1b": lambda: _interleaved(p, m, v), "zb-h1": lambda: _zb_h1(p, m),
               "zb-v": lambda: _zb_v(p, m)}[kind]()
    return Schedule(kind, p, m, v, actions)
