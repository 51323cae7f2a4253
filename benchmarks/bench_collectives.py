"""Collectives bandwidth, nccl-tests style (== `overlapkernels bench collectives ...`).

    python benchmarks/bench_collectives.py --nproc 4 --sizes 1K:4M             # CPU ranks (gloo)
    torchrun --nproc-per-node 8 benchmarks/bench_collectives.py --csv benchmarks/results/collectives.csv
"""
import sys

from overlapkernels.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "collectives", *sys.argv[1:]]))
