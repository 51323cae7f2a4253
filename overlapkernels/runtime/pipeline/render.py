"""Text (and optionally PNG) timelines of a schedule or a simulation."""
from __future__ import annotations

import os
import warnings

from .schedule import Schedule
from .simulate import SimResult, simulate

_WIDTH = 6  # characters per unit of time, at least
_MAX_COLS = 2000  # cells a row may take: a finer grid than this coarsens (actions may then share a cell)


def _grid(res) -> float:
    """Time per cell: the shortest gap between any two event times (starts and ends), so every
    action starts and ends on a cell boundary. The shortest op alone is not enough: with t_comm, or
    costs that are not its multiples, actions start between cells and two would land in one."""
    times = sorted({round(t, 9) for tl in res.timeline for s, e, _ in tl for t in (0.0, s, e)})
    gaps = [b - a for a, b in zip(times, times[1:]) if b - a > 1e-9]
    return max(min(gaps, default=1.0), res.makespan / _MAX_COLS)


def render(sched_or_res, path: str | None = None) -> str:
    """A text timeline, one row per rank (unit op costs for a bare schedule). With ``path`` and
    matplotlib installed, also a PNG there (without it, a warning says none was written)."""
    if not isinstance(sched_or_res, (Schedule, SimResult)):
        raise TypeError(f"render: expected a Schedule or a SimResult (simulate's), got {type(sched_or_res).__name__}")
    if path is not None and not isinstance(path, (str, bytes, os.PathLike)):
        raise TypeError(f"path={path!r}: expected a file path (str, bytes or os.PathLike) for the PNG, or None")
    res = sched_or_res if isinstance(sched_or_res, SimResult) else simulate(sched_or_res, t_w=1.0) \
        if _has_split(sched_or_res) else simulate(sched_or_res)
    unit = _grid(res)
    cols = int(round(res.makespan / unit))
    lines = [f"{res.schedule.kind}: {res.schedule.num_ranks} ranks, {res.schedule.num_microbatches} microbatches"
             f"{f', {res.schedule.num_virtual} virtual' if res.schedule.num_virtual > 1 else ''}; makespan "
             f"{res.makespan:g}, bubble {res.bubble_fraction:.1%}, peak activations {res.peak_activations}"]
    # a cell fits the longest label ("BW12.10"), so labels are never cut into each other's
    width = max([_WIDTH] + [len(str(a)) + 1 for tl in res.timeline for _, _, a in tl])
    for r, tl in enumerate(res.timeline):
        row = ["." * width] * cols
        for start, end, a in tl:
            if end <= start:  # takes no time (W at t_w=0): drawn it would cover its neighbour
                continue
            first, n = int(round(start / unit)), max(1, int(round((end - start) / unit)))
            for i in range(first, min(first + n, cols)):
                row[i] = str(a).ljust(width)
        lines.append(f"rank {r}: " + "".join(row))
    if path:
        _png(res, os.fsdecode(path))  # (matplotlib reads bytes as a file object)
    return "\n".join(lines)


def _has_split(schedule: Schedule) -> bool:
    return any(a.op == "W" for acts in schedule.actions for a in acts)


def _png(res: SimResult, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn(f"render: no PNG written to {path!r}: it needs matplotlib (pip install 'overlapkernels[bench]')",
                      stacklevel=3)
        return
    colors = {"F": "tab:blue", "B": "tab:orange", "BW": "tab:orange", "W": "tab:green"}
    # half an inch per cell of the text grid, whatever the unit of the times (a makespan in us is
    # not a width in inches), within what a viewer opens
    cells = res.makespan / _grid(res)
    fig, ax = plt.subplots(figsize=(min(max(6, cells / 2), 60), 0.6 * len(res.timeline) + 1))
    for r, tl in enumerate(res.timeline):
        for start, end, a in tl:
            ax.barh(r, end - start, left=start, color=colors[a.op], edgecolor="black")
            ax.text((start + end) / 2, r, f"{a.stage}.{a.microbatch}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(res.timeline)), [f"rank {r}" for r in range(len(res.timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("time")
    ax.set_title(f"{res.schedule.kind}: bubble {res.bubble_fraction:.1%}")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
