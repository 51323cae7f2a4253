"""torch.profiler around a benchmark run: one chrome trace per rank."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


def profiled(rank_main, config: dict, trace_dir: str):
    """Run ``rank_main(config)`` under torch.profiler; write ``trace_dir/trace_rank{r}.json``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    os.makedirs(trace_dir, exist_ok=True)
    with torch.profiler.profile(activities=activities) as prof:
        rows = rank_main(config)
    rank = dist.get_rank() if dist.is_initialized() else 0
    prof.export_chrome_trace(os.path.join(trace_dir, f"trace_rank{rank}.json"))
    return rows
