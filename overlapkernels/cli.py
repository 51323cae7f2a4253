"""``overlapkernels {info,bench}`` (== ``python -m overlapkernels ...``)."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _info(args) -> int:
    from .profiling.inventory import format_inventory, inventory

    info = inventory()
    print(json.dumps(info, indent=2, default=str) if args.json else format_inventory(info))
    return 0


def _launched() -> bool:
    """True under torchrun (or any launcher that sets the env:// variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _bench_collectives(args) -> int:
    from .bench.collectives import COLUMNS, CollectivesConfig, config_dict, rank_main
    from .bench.metrics import parse_size_range
    from .bench.report import append_csv, environment, format_table

    config = CollectivesConfig(ops=tuple(o.strip() for o in args.ops.split(",")) if args.ops != "all" else
                               CollectivesConfig.ops, sizes=tuple(parse_size_range(args.sizes)),
                               dtype=args.dtype, iters=args.iters, warmup=args.warmup)
    config.validate()  # before any rank is started or communicates
    if _launched():
        import torch.distributed as dist

        from .parallel import init_default_process_group

        init_default_process_group()
        rows = rank_main(config_dict(config))
        if dist.get_rank() != 0:
            return 0
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    else:
        if args.nproc < 1:
            raise SystemExit(f"--nproc {args.nproc}: expected >= 1")
        from .comm.rank_pool import RankPool

        threads = max(1, (os.cpu_count() or 1) // args.nproc)
        with RankPool(args.nproc, timeout=args.timeout, threads_per_rank=threads) as pool:
            rows = pool.run(rank_main, config_dict(config))[0]
        device = "cpu"
    env = environment(device)
    rows = [{**row, **env} for row in rows]
    first = rows[0]
    print(f"# collectives: {first['world_size']} ranks, backend {first['backend']}, {env['device']}"
          f"{' ' + env['gpu_name'] if env['gpu_name'] else ''}; torch {env['torch']}; median of {config.iters} "
          f"calls after {config.warmup} warm-up; busbw as nccl-tests")
    print(format_table(rows, COLUMNS))
    if args.csv:
        append_csv(args.csv, rows)
        print(f"# appended {len(rows)} rows to {args.csv}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlapkernels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, backends, GPUs, NVLink and topology")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_info)

    bench = sub.add_parser("bench", help="microbenchmarks")
    kinds = bench.add_subparsers(dest="kind", required=True)
    coll = kinds.add_parser("collectives", help="all_gather / reduce_scatter / all_reduce / all_to_all bandwidth")
    coll.add_argument("--ops", default="all", help="comma-separated subset of "
                      "all_gather,reduce_scatter,all_reduce,all_to_all (default: all)")
    coll.add_argument("--sizes", default="1K:64M", help="MIN:MAX bytes, doubling (default 1K:64M)")
    coll.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 | float64")
    coll.add_argument("--nproc", type=int, default=4, help="CPU ranks to spawn when not under torchrun")
    coll.add_argument("--iters", type=int, default=20)
    coll.add_argument("--warmup", type=int, default=5)
    coll.add_argument("--timeout", type=float, default=3600.0, help="seconds before spawned ranks are killed")
    coll.add_argument("--csv", help="append result rows (with hardware, versions, commit, date) to this CSV")
    coll.set_defaults(func=_bench_collectives)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # bad input: a one-line message, not a traceback
        print(f"overlapkernels: error: {exc}", file=sys.stderr)
        return 2
