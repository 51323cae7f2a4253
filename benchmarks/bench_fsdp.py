"""fsdp.shard step time per ZeRO stage and prefetch depth, bytes per step vs 2/3 Psi
(== `overlapkernels bench fsdp ...`).

    python benchmarks/bench_fsdp.py --nproc 2
    torchrun --nproc-per-node 8 benchmarks/bench_fsdp.py --layers 32 --width 4096 --csv benchmarks/results/fsdp.csv
"""
import sys

from overlapkernels.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "fsdp", *sys.argv[1:]]))
