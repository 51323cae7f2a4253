"""all_gather_matmul with N ranks sharing one GPU (the one-GPU world: a thread and a stream per
rank, copy-engine pulls between their buffers): time per method vs max(GEMM alone, copy alone),
the best overlap can reach. GPU only; every rank's output is checked against torch before timing.

    CUDA_DEVICE_MAX_CONNECTIONS=32 python benchmarks/bench_one_gpu_ag_matmul.py [--world 4 --m 2048 --k 4096 --n 4096] [--csv F]
"""
import argparse
import sys
import time

import torch

from overlapkernels.bench.report import RowLog, environment, exit_on_sigterm, format_table, positive_int
from overlapkernels.comm.thread_world import ThreadWorld


def _inputs(rank, m, k, n):
    a = torch.randn(m, k, generator=torch.Generator().manual_seed(rank)).to("cuda", torch.bfloat16)
    b = torch.randn(k, n, generator=torch.Generator().manual_seed(99)).to("cuda", torch.bfloat16)
    return a, b


def _rank(ctx, method, m, k, n, iters):
    import overlapkernels as ok

    a, b = _inputs(ctx.rank, m, k, n)
    for _ in range(3):  # warm-up: compiles, workspaces, and epochs past the first
        out = ok.all_gather_matmul(a, b, ctx, method=method)
    want = torch.cat([_inputs(q, m, k, n)[0] for q in range(ctx.world_size)]).float() @ b.float()
    torch.testing.assert_close(out.float(), want, atol=0.5, rtol=2e-2)  # never time a wrong result
    torch.cuda.current_stream().synchronize()
    ctx.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        out = ok.all_gather_matmul(a, b, ctx, method=method)
    torch.cuda.current_stream().synchronize()
    elapsed = (time.perf_counter() - start) / iters
    ctx.barrier()
    return elapsed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--world", type=positive_int, default=4)
    parser.add_argument("--m", type=positive_int, default=2048, help="rows per rank")
    parser.add_argument("--k", type=positive_int, default=4096)
    parser.add_argument("--n", type=positive_int, default=4096)
    parser.add_argument("--iters", type=positive_int, default=10)
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_one_gpu_ag_matmul: needs a CUDA GPU", file=sys.stderr)
        return 2
    w, m, k, n = args.world, args.m, args.k, args.n
    a_full = torch.randn(w * m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
    torch.mm(a_full, b)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        torch.mm(a_full, b)
    torch.cuda.synchronize()
    t_gemm = (time.perf_counter() - t0) / args.iters * w  # all ranks' GEMMs share the GPU
    dst = torch.empty_like(a_full)
    t0 = time.perf_counter()
    for _ in range(args.iters):
        dst.copy_(a_full)
    torch.cuda.synchronize()
    t_copy = (time.perf_counter() - t0) / args.iters * w * (w - 1) / w  # each rank pulls W-1 chunks
    env = environment("cuda")
    # each row goes to the CSV as it is measured; a time limit's SIGTERM still prints the table so far
    rows = RowLog(args.csv, env)
    exit_on_sigterm()
    try:
        for method in ("symm", "fused"):
            t = max(ThreadWorld(w, device="cuda", timeout=40).run(_rank, method, m, k, n, args.iters))
            rows.add({"method": method, "world": w, "m": m, "k": k, "n": n, "time_us": t * 1e6,
                      "gemm_us": t_gemm * 1e6, "copy_us": t_copy * 1e6, "vs_bound": max(t_gemm, t_copy) / t})
    finally:
        print(f"# all_gather_matmul, {w} ranks sharing {env['gpu_name']}, bf16, a_shard {m}x{k} @ {k}x{n} "
              f"(commit {env['commit']}); vs_bound = max(GEMM, copy) / time (1 = perfect overlap)")
        print(format_table(rows, [("method", "method", ""), ("time_us", "time(us)", ".0f"),
                                  ("gemm_us", "GEMM(us)", ".0f"), ("copy_us", "copy(us)", ".0f"),
                                  ("vs_bound", "vs bound", ".3f")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
