"""What cutting one GEMM into per-rank chunks costs on this device: the compute side of
method="decomposed" (and of every ring overlap). all_gather_matmul on P ranks runs P GEMMs of
[M/P, K] @ [K, N] instead of one [M, K] @ [K, N]; the overlap can only pay when the transfer it
hides is larger than what the chunking costs. This is the one-GPU measurement behind
ops/dispatch.py's CUDA_MIN_ROWS_PER_RANK (the NCCL side needs a multi-GPU node: make bench-node).

    python benchmarks/bench_chunked_gemm.py [--worlds 2,4,8] [--rows 256,512,1024,2048,4096] [--csv F]

chunk_cost = time(P chunk GEMMs) / time(one GEMM): 1.0 means chunking is free. "two streams" runs
the chunks alternately on two streams, as decomposed does on CUDA to fill the waves that one small
GEMM leaves idle.
"""
import argparse
import statistics
import sys
import time

import torch

from overlapkernels.bench.report import RowLog, environment, exit_on_sigterm, format_table, positive_int

# Llama-3 TP column-parallel shapes per rank: (K = hidden, N = outputs per rank at TP 8)
SHAPES = {"8B qkv": (4096, 768), "8B gate_up": (4096, 3584), "70B gate_up": (8192, 7168)}


def _ints(text):
    return [int(part) for part in text.split(",")]


def _median_s(fn, device, iters):
    if device.type == "cuda":
        from overlapkernels.bench.timing import gpu_median_s
        return gpu_median_s(fn, warmup=10, rep=40)
    fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def chunked_runners(a, b, world):
    """The output all three write, and the runners: one GEMM, P chunk GEMMs on one stream, P chunk
    GEMMs alternating on two streams (None off CUDA)."""
    chunks = a.chunk(world)
    out = torch.empty(a.shape[0], b.shape[1], device=a.device, dtype=a.dtype)
    out_chunks = out.chunk(world)

    def one():
        torch.mm(a, b, out=out)

    def chunked():
        for a_c, o_c in zip(chunks, out_chunks):
            torch.mm(a_c, b, out=o_c)

    if a.device.type != "cuda":
        return out, one, chunked, None
    main = torch.cuda.current_stream(a.device)
    streams = [torch.cuda.Stream(a.device), torch.cuda.Stream(a.device)]

    def two_streams():
        for s in streams:
            s.wait_stream(main)
        for i, (a_c, o_c) in enumerate(zip(chunks, out_chunks)):
            with torch.cuda.stream(streams[i % 2]):
                torch.mm(a_c, b, out=o_c)
        for s in streams:
            main.wait_stream(s)

    return out, one, chunked, two_streams


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=_ints, default=[2, 4, 8])
    parser.add_argument("--rows", type=_ints, default=[256, 512, 1024, 2048, 4096], help="rows per rank")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated names from {list(SHAPES)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--iters", type=positive_int, default=5,
                        help="timed calls per figure (CPU only; CUDA uses do_bench)")
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_chunked_gemm: no CUDA GPU (pass --device cpu for a smoke run)", file=sys.stderr)
        return 2
    if device.type == "cuda":  # do_bench's events and sync, and the row's GPU name, use the current device
        torch.cuda.set_device(device)
    shapes = args.shapes.split(",")
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or min(args.worlds + args.rows) < 1:
        parser.error(f"--shapes {unknown} not in {list(SHAPES)}" if unknown else "--worlds/--rows must be >= 1")
    dtype = getattr(torch, args.dtype)
    env = environment(device.type)
    rows = RowLog(args.csv, {"dtype": args.dtype, **env})
    exit_on_sigterm()
    try:
        for shape in shapes:
            k, n = SHAPES[shape]
            b = torch.randn(k, n, device=device, dtype=dtype)
            for world in args.worlds:
                for m in args.rows:
                    a = torch.randn(world * m, k, device=device, dtype=dtype)
                    _, one, chunked, two_streams = chunked_runners(a, b, world)
                    t_one = _median_s(one, device, args.iters)
                    row = {"shape": shape, "world": world, "rows_per_rank": m, "K": k, "N": n,
                           "gemm_us": t_one * 1e6, "tflops": 2 * world * m * k * n / t_one / 1e12,
                           "chunk_cost": _median_s(chunked, device, args.iters) / t_one}
                    # nan on CPU: one stream only
                    row["chunk_cost_2streams"] = (_median_s(two_streams, device, args.iters) / t_one
                                                  if two_streams is not None else float("nan"))
                    rows.add(row)
    finally:
        print(f"# one GEMM [P*m, K] @ [K, N] vs P chunk GEMMs [m, K] @ [K, N] on {env.get('gpu_name') or device}, "
              f"{args.dtype} (commit {env['commit']}); chunk_cost 1.0 = chunking is free")
        print(format_table(rows, [("shape", "shape", ""), ("world", "P", ""), ("rows_per_rank", "m", ""),
                                  ("gemm_us", "GEMM(us)", ".1f"), ("tflops", "TFLOP/s", ".0f"),
                                  ("chunk_cost", "chunked", ".3f"), ("chunk_cost_2streams", "2 streams", ".3f")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
