"""The csrc fixed-order reduce (GEMM + reduce-scatter's reduction) vs a device-to-device copy of the
same bytes: achieved bandwidth. GPU only; the result is checked before any time is reported.

    python benchmarks/bench_reduce.py [--numel 67108864] [--srcs 8] [--csv F]
"""
import argparse
import sys

import torch

from overlapkernels.bench.report import RowLog, environment, exit_on_sigterm, format_table, positive_int
from overlapkernels.bench.timing import gpu_median_s
from overlapkernels.kernels import cuda as cuda_lib


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--numel", type=positive_int, default=64 << 20)
    parser.add_argument("--srcs", type=positive_int, default=8)
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_reduce: needs a CUDA GPU", file=sys.stderr)
        return 2
    env = environment("cuda")
    # each row goes to the CSV as it is measured; a time limit's SIGTERM still prints the table so far
    rows = RowLog(args.csv, env)
    exit_on_sigterm()
    try:
        for dtype in (torch.bfloat16, torch.float32):
            srcs = [torch.randn(args.numel, device="cuda").to(dtype) for _ in range(args.srcs)]
            dst = torch.empty_like(srcs[0])
            cuda_lib.reduce_sum(dst, srcs)
            want = torch.zeros(args.numel, device="cuda")
            for s in srcs:
                want += s.float()
            torch.testing.assert_close(dst, want.to(dtype), atol=0, rtol=0)  # fixed order, fp32: exact
            t_reduce = gpu_median_s(lambda: cuda_lib.reduce_sum(dst, srcs))
            src_all = torch.cat(srcs)
            copy_dst = torch.empty_like(src_all)
            t_copy = gpu_median_s(lambda: copy_dst.copy_(src_all))
            moved = (args.srcs + 1) * dst.numel() * dst.element_size()  # read P sources, write one
            copied = 2 * src_all.numel() * src_all.element_size()       # read and write
            rows.add({"kernel": "ok_reduce_sum", "dtype": str(dtype).replace("torch.", ""), "srcs": args.srcs,
                      "numel": args.numel, "time_us": t_reduce * 1e6, "gbps": moved / t_reduce / 1e9,
                      "copy_gbps": copied / t_copy / 1e9, "vs_copy": (moved / t_reduce) / (copied / t_copy)})
    finally:
        print(f"# csrc reduce vs device-to-device copy on {env['gpu_name']} (commit {env['commit']})")
        print(format_table(rows, [("kernel", "kernel", ""), ("dtype", "dtype", ""), ("srcs", "srcs", "d"),
                                  ("time_us", "time(us)", ".1f"), ("gbps", "GB/s", ".0f"),
                                  ("copy_gbps", "copy GB/s", ".0f"), ("vs_copy", "vs copy", ".3f")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
