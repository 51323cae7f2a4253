"""Ring attention benchmark (== `overlapkernels bench ring-attention ...`): ring vs all-gather-K/V,
zigzag vs contiguous, forward and forward+backward, overlap efficiency.

    python benchmarks/bench_ring_attention.py --nproc 2 --seq 2048                 # CPU ranks (gloo)
    torchrun --nproc-per-node 8 benchmarks/bench_ring_attention.py --seq 65536 --heads 32 --kv-heads 8 \\
        --head-dim 128 --dtype bfloat16 --csv benchmarks/results/ring_attention.csv
"""
import sys

from overlapkernels.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ring-attention", *sys.argv[1:]]))
