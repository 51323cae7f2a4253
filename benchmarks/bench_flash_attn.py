"""Triton flash attention (forward; backward = dK/dV + dQ kernels) vs SDPA's flash backend on one
GPU, B=1, S=8192, H=32, D=128 bf16 by default; then a row packing 8 documents (segment ids) against
SDPA on each apart, and against SDPA on the row with the dense mask. GPU only. Outputs are checked
against SDPA before any time is reported.

    python benchmarks/bench_flash_attn.py [--seq 8192 --heads 32 --head-dim 128] [--csv F]
"""
import argparse
import sys

import torch
import torch.nn.functional as F
import triton

from overlapkernels.bench.report import RowLog, environment, exit_on_sigterm, format_table, positive_int
from overlapkernels.bench.timing import gpu_median_s
from overlapkernels.kernels.triton import flash_attn as fa
from overlapkernels.kernels.triton import flash_configs as fc
from overlapkernels.kernels.triton.flash_configs import FlashConfig

# Alternatives to the library's tiles (flash_configs), timed one kernel at a time so a GPU run shows
# whether the defaults pick well. All compile for sm_90 at D=128 within shared memory (the 4-warp
# ones spill a little: scripts/compile_kernels_sm90.py).
FWD_ALTERNATIVES = [FlashConfig(128, 128, 8, 2), FlashConfig(64, 64, 4, 3), FlashConfig(128, 32, 4, 3)]
DKDV_ALTERNATIVES = [FlashConfig(32, 64, 8, 3), FlashConfig(16, 128, 8, 3), FlashConfig(64, 64, 8, 2),
                     FlashConfig(32, 128, 8, 2), FlashConfig(64, 128, 8, 2), FlashConfig(64, 128, 8, 3)]


def packed_documents(rows, q, k, v, do, scale, documents: int) -> None:
    """Causal attention over a row packing ``documents`` equal documents, with segment ids (tiles
    between documents skipped), against SDPA's flash kernel run on each document apart (what a
    varlen kernel does). Our result is checked against our kernels on each document first."""
    h, s, d = q.shape[1], q.shape[2], q.shape[3]
    if s % documents:
        print(f"packed documents: seq {s} is not divisible by {documents}: rows skipped", file=sys.stderr)
        return
    n = s // documents
    ids = torch.arange(documents, device=q.device).repeat_interleave(n)[None]
    pieces = [slice(i * n, (i + 1) * n) for i in range(documents)]
    out, lse = fa.block_forward(q, k, v, scale, causal=True, q_segments=ids, k_segments=ids)
    for p in pieces:  # never time a wrong kernel
        alone = fa.block_forward(q[:, :, p], k[:, :, p], v[:, :, p], scale, causal=True)[0]
        torch.testing.assert_close(out[:, :, p], alone, atol=2e-2, rtol=2e-2)
    delta = (do.float() * out).sum(-1)
    flops = 4 * h * n * n * d / 2 * documents
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
        t_sdpa = gpu_median_s(lambda: [F.scaled_dot_product_attention(q[:, :, p], k[:, :, p], v[:, :, p],
                                                                       is_causal=True) for p in pieces])
        outs = [F.scaled_dot_product_attention(qr[:, :, p], kr[:, :, p], vr[:, :, p], is_causal=True) for p in pieces]
        t_sdpa_bwd = gpu_median_s(lambda: torch.autograd.grad(outs, (qr, kr, vr), [do[:, :, p] for p in pieces],
                                                              retain_graph=True))
    # what the attention layer ran without CP before ops.local_attention: SDPA with the dense mask
    # (its flash backend takes no mask: SDPA picks another, computing every tile)
    mask = (ids[0][:, None] == ids[0][None, :]) & torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    t_mask = gpu_median_s(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
    out_masked = F.scaled_dot_product_attention(qr, kr, vr, attn_mask=mask)
    t_mask_bwd = gpu_median_s(lambda: torch.autograd.grad(out_masked, (qr, kr, vr), do, retain_graph=True))
    t_fwd = gpu_median_s(lambda: fa.block_forward(q, k, v, scale, causal=True, q_segments=ids, k_segments=ids))
    t_bwd = gpu_median_s(lambda: fa.block_backward(q, k, v, do, lse, delta, scale, causal=True, q_segments=ids,
                                                   k_segments=ids))
    for reference, fwd_ref, bwd_ref in (("each apart", t_sdpa, t_sdpa_bwd), ("dense mask", t_mask, t_mask_bwd)):
        label = f"{documents} documents of {n} (segment ids; SDPA: {reference})"
        for pass_, t, t_ref, f in (("forward", t_fwd, fwd_ref, flops), ("backward", t_bwd, bwd_ref, 2.5 * flops)):
            rows.add({"pass": pass_, "causal": True, "config": label, "ours_us": t * 1e6, "sdpa_us": t_ref * 1e6,
                      "ours_tflops": f / t / 1e12, "sdpa_tflops": f / t_ref / 1e12, "vs_sdpa": t_ref / t})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=positive_int, default=8192)
    parser.add_argument("--heads", type=positive_int, default=32)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--documents", type=positive_int, default=8,
                        help="the packed-documents rows: this many equal documents in the row (segment ids)")
    parser.add_argument("--csv")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_flash_attn: needs a CUDA GPU", file=sys.stderr)
        return 2
    s, h, d = args.seq, args.heads, args.head_dim
    q, k, v, do = (torch.randn(1, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = d ** -0.5
    env = environment("cuda")
    # each row goes to the CSV as it is measured; a time limit's SIGTERM still prints the table so far
    rows = RowLog(args.csv, {"seq": s, "heads": h, "head_dim": d, "dtype": "bfloat16", **env})
    exit_on_sigterm()
    try:
        default = fc.flash_configs(q.device, q.dtype, max(16, triton.next_power_of_2(d)))
        for causal in (False, True):
            flops = 4 * h * s * s * d / (2 if causal else 1)
            out, lse = fa.block_forward(q, k, v, scale, causal=causal)
            want = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.testing.assert_close(out, want.float(), atol=2e-2, rtol=2e-2)  # never time a wrong kernel
            delta = (do.float() * out).sum(-1)
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
                t_sdpa = gpu_median_s(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
                qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
                o = F.scaled_dot_product_attention(qr, kr, vr, is_causal=causal)
                t_sdpa_bwd = gpu_median_s(
                    lambda: torch.autograd.grad(o, (qr, kr, vr), do, retain_graph=True))
                want_grads = torch.autograd.grad(o, (qr, kr, vr), do)

            grads = fa.block_backward(q, k, v, do, lse, delta, scale, causal=causal)
            for name, got, ref in zip(("dq", "dk", "dv"), grads, want_grads):  # never time a wrong kernel:
                # relative to the norm (bf16 rounding in 8192-term sums rules out an elementwise bound)
                err = ((got - ref.float()).norm() / ref.float().norm()).item()
                if not err < 1e-2:
                    raise AssertionError(f"backward (default tiles, causal={causal}): {name} is off SDPA's by "
                                         f"{err:.3g} of its norm (> 1e-2)")

            def time_with(cfgs, pass_):
                with fc.forced_flash_configs(cfgs):
                    if pass_ == "forward":
                        torch.testing.assert_close(fa.block_forward(q, k, v, scale, causal=causal)[0], out, atol=2e-2,
                                                   rtol=2e-2)
                        return gpu_median_s(lambda: fa.block_forward(q, k, v, scale, causal=causal))
                    for got, ref in zip(fa.block_backward(q, k, v, do, lse, delta, scale, causal=causal), grads):
                        torch.testing.assert_close(got, ref, atol=5e-2, rtol=5e-2)  # alternatives agree with default
                    return gpu_median_s(lambda: fa.block_backward(q, k, v, do, lse, delta, scale, causal=causal))

            trials = [("forward", "default", default), ("backward", "default", default)]
            trials += [("forward", str(c), fc.FlashConfigs(c, default.dkdv, default.dq)) for c in FWD_ALTERNATIVES
                       if c != default.fwd]
            trials += [("backward", f"dkdv {c}", fc.FlashConfigs(default.fwd, c, default.dq))
                       for c in DKDV_ALTERNATIVES if c != default.dkdv]
            for pass_, label, cfgs in trials:
                if label == "default":
                    label = (str(cfgs.fwd) if pass_ == "forward" else f"dkdv {cfgs.dkdv}, dq {cfgs.dq}") + " (default)"
                try:
                    t = time_with(cfgs, pass_)
                except Exception as exc:  # noqa: BLE001 - an alternative that does not fit is a row, not a crash
                    print(f"{pass_} {label}: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
                    t = float("nan")
                t_ref, f = (t_sdpa, flops) if pass_ == "forward" else (t_sdpa_bwd, 2.5 * flops)
                rows.add({"pass": pass_, "causal": causal, "config": label, "ours_us": t * 1e6,
                          "sdpa_us": t_ref * 1e6, "ours_tflops": f / t / 1e12, "sdpa_tflops": f / t_ref / 1e12,
                          "vs_sdpa": t_ref / t})
        packed_documents(rows, q, k, v, do, scale, args.documents)
    finally:
        print(f"# Triton flash attention vs SDPA (flash), B=1 S={s} H={h} D={d} bf16 on {env['gpu_name']} "
              f"(torch {env['torch']}, triton {env['triton']}, commit {env['commit']})")
        print(format_table(rows, [("pass", "pass", ""), ("causal", "causal", ""), ("config", "tiles", ""),
                                  ("ours_us", "ours(us)", ".0f"),
                                  ("sdpa_us", "sdpa(us)", ".0f"), ("ours_tflops", "ours TFLOP/s", ".1f"),
                                  ("sdpa_tflops", "sdpa TFLOP/s", ".1f"), ("vs_sdpa", "vs sdpa", ".3f")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
