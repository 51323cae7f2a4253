"""Pipeline schedules: measured step vs simulated makespan and bubbles (== `overlapkernels bench pipeline`).

    python benchmarks/bench_pipeline.py --nproc 2
    torchrun --nproc-per-node 8 benchmarks/bench_pipeline.py --width 4096 --csv benchmarks/results/pipeline.csv
"""
import sys

from overlapkernels.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "pipeline", *sys.argv[1:]]))
