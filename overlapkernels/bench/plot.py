"""PNG charts of benchmark rows (matplotlib, the optional ``bench`` extra)."""
from __future__ import annotations

import math

# kind -> (title, [(chart type, x key, series key, y key, y label)])
CHARTS = {
    "collectives": ("collectives vs size", [("line", "bytes", "op", "time_us", "time (us)"),
                                            ("line", "bytes", "op", "busbw_gbps", "busbw (GB/s)")]),
    "ag-matmul": ("all_gather_matmul", [("bar", "layer", "method", "time_us", "time (us)"),
                                        ("bar", "layer", "method", "efficiency", "overlap efficiency E")]),
    "matmul-rs": ("matmul_reduce_scatter", [("bar", "layer", "method", "time_us", "time (us)"),
                                            ("bar", "layer", "method", "efficiency", "overlap efficiency E")]),
    "ring-attention": ("ring attention", [("bar", "layout", "causal", "fwd_ring_us", "ring forward (us)"),
                                          ("bar", "layout", "causal", "efficiency", "overlap efficiency E")]),
    "layers": ("transformer block fwd+bwd", [("bar", "method", "seq", "time_us", "time (us)")]),
    "fsdp": ("fsdp step", [("bar", "stage", "variant", "time_us", "step (us)")]),
    "pipeline": ("pipeline schedules", [("bar", "kind", "microbatches", "step_us", "measured step (us)"),
                                        ("bar", "kind", "microbatches", "sim_us", "simulated (us)")]),
}


def plot_rows(kind: str, rows: list[dict], path: str) -> bool:
    """Write ``path``; False (and nothing written) when matplotlib is missing or the kind unknown."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    if kind not in CHARTS or not rows:
        return False
    title, charts = CHARTS[kind]
    fig, axes = plt.subplots(1, len(charts), figsize=(6 * len(charts), 4), squeeze=False)
    for ax, (chart, x, series, y, label) in zip(axes[0], charts):
        groups = list(dict.fromkeys(str(r[x]) for r in rows))
        names = list(dict.fromkeys(str(r[series]) for r in rows))
        for i, name in enumerate(names):
            pts = [(str(r[x]), r[y]) for r in rows if str(r[series]) == name and isinstance(r[y], (int, float))
                   and not math.isnan(r[y])]
            if chart == "line":
                ax.plot([float(p[0]) for p in pts], [p[1] for p in pts], marker="o", label=name)
                ax.set_xscale("log", base=2)
                if y == "time_us":  # latency-bound small messages and bandwidth-bound large ones
                    ax.set_yscale("log")
            else:
                width = 0.8 / len(names)
                ax.bar([groups.index(p[0]) + i * width for p in pts], [p[1] for p in pts], width, label=name)
                ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], groups, rotation=20, fontsize=8)
        ax.set_xlabel(x)
        ax.set_ylabel(label)
        ax.legend(title=series, fontsize=8)
    fig.suptitle(f"{title} ({rows[0].get('world_size', '?')} ranks, {rows[0].get('device', '')})")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
