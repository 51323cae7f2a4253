"""all_gather_matmul benchmark (== `overlapkernels bench ag-matmul ...`): every method on Llama-3 TP
layer shapes; time, TFLOP/s, speedup vs baseline, overlap efficiency E.

    python benchmarks/bench_ag_matmul.py --nproc 2 --shapes llama3-8b          # CPU ranks (gloo), scaled down 8x
    torchrun --nproc-per-node 8 benchmarks/bench_ag_matmul.py --shapes llama3-8b,llama3-70b --dtype bfloat16 \\
        --csv benchmarks/results/ag_matmul.csv
"""
import sys

from overlapkernels.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "ag-matmul", *sys.argv[1:]]))
