"""Collectives microbenchmark, nccl-tests style: size, count, time, algbw, busbw per op.

Runs on the ranks of a launched job (torchrun) or on ``--nproc`` CPU ranks it spawns itself.
Time per call: CUDA events on GPU; a barrier then ``perf_counter`` on CPU. The reported time is
the slowest rank's median (min_us / max_us: the largest over ranks of each rank's fastest and
slowest call), as a collective is only done when its last rank is. Each call runs in an
``ok/<op>[<backend>]`` range, so a ``--profile`` trace reports its comm busy time like the fused ops'.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..comm import collectives as C
from ..parallel import comm_device
from ..profiling.ranges import span
from .metrics import algbw_gbps, busbw_gbps, summarize
from .progress import track
from .timing import DTYPES, check_counts, check_dtype, row_times, slowest_rank, telemetry, time_calls

OPS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
COLUMNS = [("op", "op", ""), ("bytes", "size(B)", "d"), ("count", "count", "d"), ("dtype", "type", ""),
           ("time_us", "time(us)", ".1f"), ("algbw_gbps", "algbw(GB/s)", ".3f"), ("busbw_gbps", "busbw(GB/s)", ".3f")]


@dataclass(frozen=True)
class CollectivesConfig:
    ops: tuple = OPS
    sizes: tuple = (1 << 10,)
    dtype: str = "float32"
    iters: int = 20
    warmup: int = 5

    def validate(self) -> None:
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise ValueError(f"ops={list(self.ops)}: expected a non-empty subset of {list(OPS)}")
        check_dtype(self.dtype)
        check_counts(self.iters, self.warmup)


def _call(op: str, count: int, world: int, dtype: torch.dtype, device: torch.device, group):
    """A closure running ``op`` once on a full buffer of ``count`` elements (nccl-tests sizing:
    the size is the gathered output / the scattered input / the reduced buffer)."""
    full = torch.ones(count, dtype=dtype, device=device)
    shard = torch.ones(count // world, dtype=dtype, device=device)
    call = {
        "all_gather": lambda: C.all_gather(shard, group),
        "reduce_scatter": lambda: C.reduce_scatter(full, group),
        "all_reduce": lambda: C.all_reduce(full, group),
        "all_to_all": lambda: C.all_to_all(full, group),
    }[op]
    name = f"ok/{op}[{dist.get_backend(group)}]"

    def ranged():
        with span(name):
            return call()

    return ranged


def run_collectives(config: CollectivesConfig, group=None) -> list[dict]:
    """Measure every (op, size); every rank returns the same rows (times: slowest rank's)."""
    config.validate()
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    device = comm_device(group)
    dtype = DTYPES[config.dtype]
    elem = torch.empty((), dtype=dtype).element_size()
    rows = []
    sweep = [(op, size) for op in config.ops for size in config.sizes]
    for op, size in track(sweep, "collectives", enabled=dist.get_rank() == 0):
        count = max(world, size // elem // world * world)  # divisible by the world, as nccl-tests
        with telemetry(device) as tel:
            stats = slowest_rank(summarize(time_calls(_call(op, count, world, dtype, device, group),
                                                      config.iters, config.warmup, device, group)), device, group)
        median = stats["median_s"]
        nbytes = count * elem
        rows.append({"op": op, "bytes": nbytes, "count": count, "dtype": config.dtype, "world_size": world,
                     "backend": dist.get_backend(group), **row_times(stats), "algbw_gbps": algbw_gbps(nbytes, median),
                     "busbw_gbps": busbw_gbps(op, nbytes, median, world), **tel.summary()})
    return rows


def rank_main(config_dict: dict) -> list[dict]:
    """Entry point on each spawned rank (picklable: a module-level function of plain data)."""
    return run_collectives(CollectivesConfig(**config_dict))


def config_dict(config: CollectivesConfig) -> dict:
    return asdict(config)
