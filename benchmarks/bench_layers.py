"""One transformer block fwd+bwd under TP + SP (== `overlapkernels bench layers ...`): baseline vs
decomposed vs auto, with the per-method counters of what ran.

    python benchmarks/bench_layers.py --nproc 2
    torchrun --nproc-per-node 8 benchmarks/bench_layers.py --seq 8192 --hidden 4096 --heads 32 --kv-heads 8 \\
        --ffn-hidden 14336 --dtype bfloat16 --csv benchmarks/results/layers.csv
"""
import sys

from overlapkernels.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "layers", *sys.argv[1:]]))
