"""matmul_reduce_scatter benchmark (== `overlapkernels bench matmul-rs ...`): every method on Llama-3 TP
layer shapes; time, TFLOP/s, speedup vs baseline, overlap efficiency E.

    python benchmarks/bench_matmul_rs.py --nproc 2 --shapes llama3-8b          # CPU ranks (gloo), scaled down 8x
    torchrun --nproc-per-node 8 benchmarks/bench_matmul_rs.py --shapes llama3-8b,llama3-70b --dtype bfloat16 \\
        --csv benchmarks/results/matmul_rs.csv
"""
import sys

from overlapkernels.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "matmul-rs", *sys.argv[1:]]))
