"""The fused all-gather GEMM with every chunk already arrived (world 1) vs torch.mm: the GEMM
core's own speed, the ceiling of method="fused". GPU only.

    python benchmarks/bench_fused_gemm.py [--m 8192 --n 8192 --k 1024] [--csv benchmarks/results/gpu.csv]
"""
import argparse
import sys

import torch

from overlapkernels.bench.report import RowLog, environment, exit_on_sigterm, format_table, positive_int
from overlapkernels.bench.timing import gpu_median_s
from overlapkernels.kernels.errors import new_error_record
from overlapkernels.kernels.triton.ag_gemm import ag_gemm
from overlapkernels.kernels.triton.signals import FLAG_DTYPE, polls
from overlapkernels.kernels.triton.tile_gemm import GemmConfig, gemm_config

# Alternatives to the library's choice (first row), so one GPU run shows whether gemm_config picks
# well. Only those no GPU has timed yet: the pointer-load tiles Triton usually picks on Hopper were
# timed on an H200 (benchmarks/results/h200_2026-11-30.md: 0.49-0.81x torch.mm, the default best).
# The candidates for the gap (compiled for sm_90 by scripts/compile_kernels_sm90.py, no spills):
# - tensor-descriptor (TMA) loads: fewer registers than pointer loads, no per-thread addresses;
# - TMA stores of the output: the tile's global writes drain while the next tile starts, where a
#   pointer store keeps the SM until they are issued (64 KB a 128x256 tile, against 16 K steps at K=1024);
# - two programs per SM (128x128 tiles, one warpgroup each): one block's epilogue and pipeline fill
#   run while the other's main loop keeps the tensor cores busy.
# Most promising first: rows are written as measured, so a step cut short keeps them. (128x256 with
# 4 stages and TMA stores needs 256 KB of shared memory with triton 3.6, the H200 image's: left out.)
ALTERNATIVES = [GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True, tma_store=True),
                GemmConfig(128, 128, 64, num_warps=4, num_stages=2, tma=True, tma_store=True, programs_per_sm=2),
                GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma_store=True),
                GemmConfig(128, 128, 64, num_warps=4, num_stages=3, tma=True, programs_per_sm=2),
                GemmConfig(128, 128, 64, num_warps=4, num_stages=3, programs_per_sm=2),
                GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True, tma_store=True),
                GemmConfig(128, 256, 64, num_warps=8, num_stages=3, tma=True),
                GemmConfig(128, 256, 64, num_warps=8, num_stages=4, tma=True),
                GemmConfig(128, 128, 64, num_warps=8, num_stages=4, tma=True)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--m", type=positive_int, default=8192)
    parser.add_argument("--n", type=positive_int, default=8192)
    parser.add_argument("--k", type=positive_int, default=1024)
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fused_gemm: needs a CUDA GPU", file=sys.stderr)
        return 2
    a = torch.randn(args.m, args.k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(args.k, args.n, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(args.m, args.n, device="cuda", dtype=torch.bfloat16)
    arrived = torch.ones(1, dtype=FLAG_DTYPE, device="cuda")
    err = new_error_record("cuda")
    flops = 2 * args.m * args.n * args.k
    env = environment("cuda")
    # each row goes to the CSV as it is measured; a time limit's SIGTERM still prints the table so far
    rows = RowLog(args.csv, {"M": args.m, "N": args.n, "K": args.k, "dtype": "bfloat16", **env})
    exit_on_sigterm()
    try:
        t_mm = gpu_median_s(lambda: torch.mm(a, b), warmup=50, rep=300)
        rows.add({"kernel": "torch.mm", "config": "cuBLAS", "time_us": t_mm * 1e6, "tflops": flops / t_mm / 1e12,
                  "vs_mm": 1.0})
        ref = a.float() @ b.float()
        default = gemm_config(a.device, a.dtype, args.m, args.n, args.k)
        for name, cfg in [("ag_gemm (default)", default)] + [("ag_gemm", c) for c in ALTERNATIVES if c != default]:
            def run(cfg=cfg):
                return ag_gemm(a, b, out, arrived, err, rank=0, world_size=1, epoch=1, budget=polls(1), config=cfg)

            try:
                out.fill_(float("nan"))  # (else a config that stores nothing passes on the last one's output)
                run()
                torch.testing.assert_close(out.float(), ref, atol=0.5, rtol=2e-2)  # never report a wrong kernel's speed
            except Exception as exc:  # noqa: BLE001 - a config that fails or is wrong is a row, not a crash
                print(f"{name} {cfg}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
                rows.add({"kernel": name, "config": str(cfg), "time_us": float("nan"), "tflops": float("nan"),
                          "vs_mm": float("nan"), "error": type(exc).__name__})
                continue
            t = gpu_median_s(run, warmup=50, rep=300)
            rows.add({"kernel": name, "config": str(cfg), "time_us": t * 1e6, "tflops": flops / t / 1e12,
                      "vs_mm": t_mm / t})
    finally:
        print(f"# fused GEMM core vs torch.mm, {args.m}x{args.n}x{args.k} bf16 on {env['gpu_name']} "
              f"(torch {env['torch']}, triton {env['triton']}, commit {env['commit']})")
        print(format_table(rows, [("kernel", "kernel", ""), ("config", "BMxBNxBK warps stages", ""),
                                  ("time_us", "time(us)", ".1f"), ("tflops", "TFLOP/s", ".1f"),
                                  ("vs_mm", "vs torch.mm", ".3f")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
