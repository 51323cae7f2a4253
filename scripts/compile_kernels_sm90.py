"""Compile-only check of overlapkernels' Triton kernels for sm_90 (H100/H200), no GPU needed (and of
the flash tables for GPUs with ~100 KB of shared memory a block, for sm_86 against 99 KB).

The interpreter that runs the kernels in CPU tests accepts code the compiler rejects; this catches
that. Arguments go through triton's own JIT binder (what kernel[grid](...) runs), so the signature,
the int specialisations (==1 -> constexpr, %16 -> divisibility) and pointer alignment are what a
real launch produces; then triton.compile(ASTSource, target=sm_90) down to a cubin. Nothing runs.
It uses triton internals (checked with triton 3.3, 3.6 and 3.9); exit code 3 means they moved.
The PTX of every kernel that touches flags or peer data must also show the memory order the flag
protocol needs (system-scope acquire/release) and no TMA: the interpreter cannot show either.

    env -u TRITON_INTERPRET python scripts/compile_kernels_sm90.py [--quick] [name-filter]   (a filter
    matching no configuration exits 1)

``--quick``: one configuration per kernel (what tests/test_kernels_compile.py runs);
``T36_PTXAS=1`` also reports registers and spills from ptxas for every kernel (the persistent GEMMs
and the flag kernels always run through ptxas: a GEMM block must leave room for a flag kernel).
"""
import multiprocessing
import os
import re
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor

import torch
import triton

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
except ImportError as exc:  # the internals this relies on moved in this triton
    print(f"triton {triton.__version__}: internals moved ({exc})")
    sys.exit(3)

from overlapkernels.kernels.triton import ag_gemm as AG, gemm_rs as RS, all_gather as AL, signals as SG, \
    flash_attn as FA, flash_configs as FC, flash_segments as FS
from overlapkernels.kernels.triton import tile_gemm as TG
from overlapkernels.kernels.triton.tile_gemm import dot_precision

TARGET = GPUTarget("cuda", 90, 32)
SMEM_LIMIT = 227 * 1024


def use_target(arch: int, smem_kb: int) -> None:
    """Compile what follows for ``sm_<arch>`` against ``smem_kb`` KB of shared memory a block."""
    global TARGET, SMEM_LIMIT
    TARGET, SMEM_LIMIT = GPUTarget("cuda", arch, 32), smem_kb * 1024

DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
if {"-h", "--help"} & set(sys.argv[1:]):
    print(__doc__)
    sys.exit(0)
if unknown := [a for a in sys.argv[1:] if a.startswith("-") and a != "--quick"]:
    print(f"unknown option {unknown[0]!r}: expected [--quick] [name-filter] (see --help)")
    sys.exit(2)
QUICK = "--quick" in sys.argv[1:]
FILTER = next((a for a in sys.argv[1:] if a != "--quick"), "")
results = []


def compile_like_launch(target, kernel, *args, **kwargs):
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    if hasattr(kernel, "_pack_args"):  # triton >= 3.4
        options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    else:  # triton 3.3 (torch 2.7's pin): what its JITFunction.run does inline before compiling
        from triton.runtime.jit import find_paths_if, get_iterable_path
        options = backend.parse_options(dict(kwargs, debug=kwargs.get("debug", kernel.debug)))
        sigvals = [s[0] for s in specialization]
        signature = {p.name: v for p, v in zip(kernel.params, sigvals)}
        values = list(bound_args.values())
        constexprs = {path: get_iterable_path(values, path)
                      for path in find_paths_if(sigvals, lambda _, v: v == "constexpr")}
        attrvals = [s[1] for s in specialization]
        attrs = {path: backend.parse_attr(get_iterable_path(attrvals, path))
                 for path in find_paths_if(attrvals, lambda _, v: isinstance(v, str))}
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__), signature


def ptxas_usage(ptx, arch):
    """Same ptxas flags triton uses (-lineinfo -v --gpu-name=sm_90a): (registers per thread, spill
    stores, spill loads in bytes per thread)."""
    import re, subprocess, tempfile
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    ptxas = get_ptxas(arch)  # triton 3.3: a (path, version) tuple; later a NVIDIATool with .path
    ptxas = ptxas[0] if isinstance(ptxas, tuple) else ptxas.path
    gpu = f"sm_{arch}a" if arch == 90 else f"sm_{arch}"
    log = subprocess.run([ptxas, "-lineinfo", "-v", f"--gpu-name={gpu}", f.name, "-o", "/dev/null"],
                         capture_output=True, text=True).stderr
    os.remove(f.name)
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert regs and spill, f"ptxas -v said no register count: {log[-500:]}"
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


# The persistent GEMMs spin on flags that one-warp kernels on the copy stream set: a GEMM block must
# leave an SM room for one such block beside it (else they run only on the reserved SMs, which a
# concurrent NCCL kernel can hold). sm_90: 64K 32-bit registers per SM, allocated per warp in
# units of 256; a flag kernel is one warp capped at SG.FLAG_KERNEL_LAUNCH["maxnreg"] registers.
REGISTER_FILE, REG_ALLOC_UNIT, FLAG_KERNEL_MAX_REGS = 65536, 256, SG.FLAG_KERNEL_LAUNCH["maxnreg"]
# A config with two programs per SM needs two blocks resident at once: sm_90 has 228 KB of shared
# memory per SM, of which each block also takes 1 KB for the system.
SM_SHARED, BLOCK_SHARED_RESERVE = 228 * 1024, 1024


def warp_registers(regs_per_thread: int) -> int:
    return -(-regs_per_thread * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT


# The flag protocol's memory order as the PTX must show it (the interpreter, sequentially consistent
# and cacheless, cannot): consumers read flags with acquire, publishers write them with release, both
# at system scope (peers are other GPUs). Qualifier order differs between triton versions.
ACQUIRE_SYS = ("a system-scope acquire load", r"\b(?:ld|atom)(?=[.\w]*\.acquire\b)(?=[.\w]*\.sys\b)[.\w]+")
RELEASE_SYS = ("a system-scope release store", r"\b(?:st|red|atom)(?=[.\w]*\.release\b)(?=[.\w]*\.sys\b)[.\w]+")
# TMA (bulk async copies) goes through the async proxy, which acquire/release of the generic proxy
# does not order: peer data loaded that way could be stale. Kernels touching peer data must not use it,
# but for the GEMMs' TMA configs: their loads read this rank's memory, after a proxy fence where a flag
# said it arrived (ag_gemm), and their stores (to peers in gemm_rs) stay generic. ag_gemm's
# ``tma_store`` configs store its output (this rank's) through a 3-D [W, m, N] descriptor.
NO_TMA = ("cp.async.bulk", "cp.reduce.async.bulk")
TMA_LOADS = "cp.async.bulk.tensor.2d.shared"
TMA_STORES = ("cp.async.bulk.tensor.2d.global.shared", "cp.reduce.async.bulk")
TMA_STORE_3D = "cp.async.bulk.tensor.3d.global.shared"


def ag_gemm_ptx(tma: bool, store: bool) -> dict:
    """What ag_gemm's PTX must and must not hold: descriptor loads after a proxy fence with ``tma``,
    the per-chunk output store with ``store``, no other bulk copy."""
    if not (tma or store):
        return dict(ptx_has=(), ptx_not=NO_TMA)
    return dict(ptx_has=((TMA_LOADS, "fence.proxy.async.global") if tma else ()) + ((TMA_STORE_3D,) if store else ()),
                ptx_not=TMA_STORES + (() if tma else (TMA_LOADS,)) + (() if store else (TMA_STORE_3D,)))


# Compiles queued by check(), run at the end by forked workers (they inherit this list): one kernel
# compiles on one core (LLVM, then ptxas), and the quick set took ~30 s of CI's two cores one by one.
JOBS = []


def check(label, kernel, *args, ptx_has=(), ptx_re=(), ptx_not=(), beside_flag_kernel=0, flag_kernel=False,
          **kwargs):
    """Queue a compile for the current target. ``ptx_has``: instructions the PTX must contain (e.g.
    the vector stores a hint is there for); ``ptx_re``: (what, regular expression) pairs it must
    match; ``ptx_not``: instructions it must not contain; ``beside_flag_kernel``: a persistent GEMM's
    programs per SM (its config's ``programs_per_sm``; 0: not one), whose blocks must fit an SM
    together and leave room for a flag kernel's; ``flag_kernel``: one of those (one warp, at most
    FLAG_KERNEL_MAX_REGS registers, no spills)."""
    if FILTER in label:
        JOBS.append((label, TARGET, SMEM_LIMIT, kernel, args, kwargs, ptx_has, ptx_re, ptx_not, beside_flag_kernel,
                     flag_kernel))


def run_job(index: int) -> str:
    """Compile and check ``JOBS[index]`` -> its report line."""
    (label, target, smem_limit, kernel, args, kwargs, ptx_has, ptx_re, ptx_not, beside_flag_kernel,
     flag_kernel) = JOBS[index]
    t0 = time.time()
    try:
        ck, sig = compile_like_launch(target, kernel, *args, **kwargs)
        md = ck.metadata
        assert "cubin" in ck.asm and "ptx" in ck.asm
        ptx = ck.asm["ptx"]
        missing = [i for i in ptx_has if i not in ptx] + [what for what, r in ptx_re if not re.search(r, ptx)]
        assert not missing, f"the PTX lacks {missing}"
        present = [i for i in ptx_not if i in ptx]
        assert not present, f"the PTX has {present}"
        flag0 = ""
        if os.environ.get("T36_PTXAS") or beside_flag_kernel or flag_kernel:
            regs, spill_st, spill_ld = ptxas_usage(ck.asm["ptx"], target.arch)
            flag0 = f" regs={regs} spills(st/ld)={spill_st}/{spill_ld}"
            if beside_flag_kernel:
                blocks = int(beside_flag_kernel)
                used = warp_registers(regs) * md.num_warps * blocks
                assert used + warp_registers(FLAG_KERNEL_MAX_REGS) <= REGISTER_FILE, (
                    f"{blocks} x {md.num_warps} warps x {regs} registers take {used} of an SM's {REGISTER_FILE}: "
                    f"no room for a flag kernel beside the block{'s' * (blocks > 1)}")
                assert blocks == 1 or blocks * (md.shared + BLOCK_SHARED_RESERVE) <= SM_SHARED, (
                    f"{blocks} blocks of {md.shared} B of shared memory do not fit an SM's {SM_SHARED} B")
            if flag_kernel:
                assert md.num_warps == 1 and regs <= FLAG_KERNEL_MAX_REGS and not spill_st, (md.num_warps, regs, spill_st)
        mma = "wgmma" if "wgmma" in ck.asm["ptx"] else "mma" if "mma.sync" in ck.asm["ptx"] else "no-mma"
        flag = f" {mma}" + flag0 + (f"  ** OVER {smem_limit // 1024} KB **" if md.shared > smem_limit else "")
        return (f"OK    {label}: shared={md.shared} B ({md.shared / 1024:.1f} KB) warps={md.num_warps} "
                f"stages={md.num_stages} cubin={len(ck.asm['cubin'])} B [{time.time() - t0:.1f}s]{flag}")
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exc()
        return f"FAIL  {label}: {type(e).__name__}: {e}\n{tb[-3000:]}"


def t(*shape, dtype):
    return torch.empty(*shape, dtype=dtype)


W, R, M, N, K = 4, 1, 512, 1024, 1024  # rank 1 of 4, chunks of 512 rows
EPOCH, BUDGET = 5, SG.wait_budget(60.0, torch.device("cuda"))  # 6e10 ns of the global timer

# --- ag_gemm / gemm_rs: the configs gemm_config hands out, plus small ones -----------------------
# (config, K values it is chosen for): gemm_config hands ragged K to the small tiles only
EVEN, RAGGED = (K,), (K, K + 8)
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
from bench_fused_gemm import ALTERNATIVES  # noqa: E402 - the configs the GPU benchmark sweeps

GEMM_CONFIGS = {"bf16": [(TG.CUDA_GEMM_16BIT, EVEN), (TG.CUDA_GEMM_16BIT_SMALL, RAGGED), (TG.SMALL_SMEM_GEMM, EVEN),
                         (TG.SMALL_SMEM_GEMM_SMALL, RAGGED)] + [(c, EVEN) for c in ALTERNATIVES],
                "fp16": [(TG.CUDA_GEMM_16BIT, EVEN)], "fp32": [(TG.CUDA_GEMM_FP32, RAGGED), (TG.SMALL_SMEM_GEMM_SMALL, RAGGED)]}
for dname, dt in DT.items():
    prec = dot_precision(dt)
    if QUICK and dname == "fp16":
        continue
    # quick: each dtype's first config, and bf16's first TMA one (descriptor loads, a proxy fence)
    quick = GEMM_CONFIGS[dname][:1] + [(c, ks) for c, ks in GEMM_CONFIGS[dname] if c.tma][:1]
    for cfg, ks in quick if QUICK else GEMM_CONFIGS[dname]:
        # quick: both weight layouts (a linear layer's is the transposed one)
        for layout, kk in ([("b", K), ("bT", K)] if QUICK else [("b", K), ("bT", K)] + [("b", kk) for kk in ks[1:]]):
            a = t(W * M, kk, dtype=dt)
            b = t(kk, N, dtype=dt) if layout == "b" else t(N, kk, dtype=dt).t()
            out = t(W * M, N, dtype=dt)
            arrived, err = t(W, dtype=torch.int64), t(4, dtype=torch.int32)
            tag = f"{dname} {cfg} {layout} K={kk} prec={prec}"
            # what the launch passes: descriptors where the config asks and the operands qualify
            tma, a_desc, b_desc, k_major = TG.tma_operands(a, b, cfg)
            store, c_desc = TG.tma_output(out, W, cfg)
            assert (tma, store) == (cfg.tma, cfg.tma_store) or dname == "fp32", (tag, tma, store)
            descs = dict(TMA=tma, B_K_MAJOR=k_major)
            # (.global: triton's own fence.proxy.async.shared::cta is in every TMA/wgmma kernel)
            check(f"_ag_gemm_kernel {tag}", AG._ag_gemm_kernel,
                  a, b, out, arrived, err, M, N, kk, EPOCH, BUDGET.amount, a.stride(0), a.stride(1), b.stride(0),
                  b.stride(1), out.stride(0), out.stride(1), R, a_desc, b_desc, c_desc, WORLD=W, DOT_PRECISION=prec,
                  TIMED=BUDGET.timed, PROXY_FENCE=tma, TMA_STORE=store, **descs, beside_flag_kernel=cfg.programs_per_sm,
                  ptx_re=(ACQUIRE_SYS,), **ag_gemm_ptx(tma, store), **cfg.meta(kk))
            table = t(W, dtype=torch.int64)
            check(f"_gemm_rs_kernel {tag}", RS._gemm_rs_kernel,
                  a, b, table, table, M, N, kk, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                  R, a_desc, b_desc, WORLD=W, DOT_PRECISION=prec, **descs, **cfg.meta(kk), beside_flag_kernel=cfg.programs_per_sm,
                  # 16-byte remote stores (signals.peer_ptr's alignment)
                  ptx_has=("st.global.v4",) + ((TMA_LOADS,) if tma else ()),
                  ptx_re=(RELEASE_SYS,), ptx_not=TMA_STORES if tma else NO_TMA)  # tiles' stores, then the count

# --- segment ids: the span tables' kernels (the block sizes the flash tables use) --------------------
def check_span_kernels(blocks, where: str = "") -> None:
    """Rows of 1000 ids (a row stride not divisible by 16), and expanded ones (stride 0); CHUNK as
    large as the launches' (powers of two up to 1024) and 1 (specialised)."""
    for block in blocks:
        ranges, spans_out = t(2, 63, 2, dtype=torch.int64), t(2, 63, 2, dtype=torch.int32)
        for ids, how in ((t(2, 1000, dtype=torch.int64), ""), (t(1, 1000, dtype=torch.int64).expand(2, 1000),
                                                              " expanded ids")):
            if QUICK and how:
                continue
            check(f"{where}_tile_range_kernel BLOCK={block}{how}", FS._tile_range_kernel, ids, ranges, 1000,
                  ids.stride(0), ranges.stride(0), BLOCK=block)
            for col_tiles, chunk in ((63, 64), (1, 1)) if QUICK or how else ((63, 64), (1, 1), (900, 1024)):
                # (an argument equal to 1 is specialized into a constant)
                check(f"{where}_tile_span_kernel BLOCK={block} col_tiles={col_tiles} CHUNK={chunk}{how}",
                      FS._tile_span_kernel, ids, ranges, spans_out, 1000, col_tiles, ids.stride(0), ranges.stride(0),
                      spans_out.stride(0), BLOCK=block, CHUNK=chunk)


check_span_kernels((64,) if QUICK else (16, 32, 64, 128))

# --- all_gather ---------------------------------------------------------------------------------
for dname in ("bf16", "fp32"):
    dt = DT[dname]
    shard, out, table = t(M * K, dtype=dt), t(W * M * K, dtype=dt), t(W, dtype=torch.int64)
    nb = triton.cdiv(M * K, 256)
    check(f"_ag_publish_kernel {dname}", AL._ag_publish_kernel, shard, table, M * K, RANK=R, BLOCK=256,
          ptx_not=NO_TMA)
    check(f"_ag_pull_kernel {dname}", AL._ag_pull_kernel, table, table, out, M * K, 2, nb, RANK=R, WORLD=W,
          BLOCK=256, ptx_re=(RELEASE_SYS,), ptx_not=NO_TMA)
# chunk bases are 64-bit (rank x chunk_numel passes 2^31 first); arguments equal to 1 are specialised
# into constants, which the widening must take too
check("_ag_publish_kernel chunk_numel=1", AL._ag_publish_kernel, t(1, dtype=dt), table, 1, RANK=R, BLOCK=256, ptx_not=NO_TMA)
check("_ag_pull_kernel chunk_numel=1 src=1", AL._ag_pull_kernel, table, table, t(W, dtype=dt), 1, 1, 1, RANK=R, WORLD=W,
      BLOCK=256, ptx_re=(RELEASE_SYS,), ptx_not=NO_TMA)
for world, epoch in [(4, 5), (8, 1)]:
    check(f"_ag_signal_kernel WORLD={world} epoch={epoch}", AL._ag_signal_kernel, t(world, dtype=torch.int64), epoch,
          1, WORLD=world, **SG.FLAG_KERNEL_LAUNCH, flag_kernel=True, ptx_re=(RELEASE_SYS,))

# --- signals -------------------------------------------------------------------------------------
pads, err, table = t(2 * W, dtype=torch.int64), t(4, dtype=torch.int32), t(W, dtype=torch.int64)
for name, flag, vals in [("aligned flag, generic ints", pads[2:3], (EPOCH * 37, BUDGET, 2, 3, 2, 3)),
                         ("8B-aligned flag, ints ==1/0", pads[W + 1:W + 2], (0, BUDGET, 1, 1, 1, 0)),
                         ("interpreter-style poll budget", pads[1:2], (7, SG.polls(1000), 1, 1, 1, 0))]:
    target, spins, code, rank, chunk, peer = vals
    check(f"_wait_kernel {name}", SG._wait_kernel, flag, target, err, spins.amount, code, rank, chunk, peer,
          TIMED=spins.timed, **SG.FLAG_KERNEL_LAUNCH, flag_kernel=True, ptx_re=(ACQUIRE_SYS,))
    check(f"_set_flag_kernel {name}", SG._set_flag_kernel, flag, target, **SG.FLAG_KERNEL_LAUNCH,
          flag_kernel=True, ptx_re=(RELEASE_SYS,))
for add in (True, False):
    for peer, index, value in [(2, 5, 7), (1, 1, 1)]:
        check(f"_update_peer_flag_kernel ADD={add} peer={peer} index={index} value={value}",
              SG._update_peer_flag_kernel, table, peer, index, value, ADD=add, **SG.FLAG_KERNEL_LAUNCH,
              flag_kernel=True, ptx_re=(RELEASE_SYS,))

# --- flash attention: the configs flash_configs hands out on GPUs ---------------------------------
B, H, HKV, L = 2, 8, 2, 1024


def _ids(row_stride: int) -> torch.Tensor:
    """[B, L] segment ids whose rows are ``row_stride`` apart (0: one row expanded)."""
    return t(1, L, dtype=torch.int64).expand(B, L) if row_stride == 0 else t(B, row_stride, dtype=torch.int64)[:, :L]


def check_flash(tables: dict, where: str = "", quick_keys=(), kv_heads: int = HKV, ids_stride: int = L,
                segments_only: bool = False) -> None:
    """Each (dtype name, head dim) -> FlashConfigs, causal and not; fp32 twice: IEEE (FMA) and, as
    under torch's allow_tf32 / fp32_precision="tf32", TF32 (mma: other shared memory and registers);
    each also with segment ids (packed documents: every tile masked, loops bounded by tile spans);
    --quick: segment ids for the first key only. ``kv_heads`` = H: GROUP=1 (specialised, another dK/dV
    loop nest); ``ids_stride``: the ids' row stride (L is divisible by 16; 0 and 1 are specialised)."""
    for (dname, hd), cfgs in tables.items():
        dt = DT[dname]
        if QUICK and (dname, hd) not in quick_keys:
            continue
        precisions = ("ieee", "tf32") if dt == torch.float32 and not QUICK else (dot_precision(dt),)
        seg_options = (True,) if segments_only else (False, True) if not QUICK or (dname, hd) == quick_keys[0] \
            else (False,)
        for precision, causal, seg in [(p, c, sg) for p in precisions for c in ((True,) if QUICK else (False, True))
                                       for sg in seg_options]:
            fixed = dict(HEAD_DIM=hd, DOT_PRECISION=precision, SEGMENTS=seg)
            ids = _ids(ids_stride) if seg else None  # (without: q, as the launch passes)
            q, k, v = t(B, H, L, hd, dtype=dt), t(B, kv_heads, L, hd, dtype=dt), t(B, kv_heads, L, hd, dtype=dt)
            o, lse = t(B, H, L, hd, dtype=torch.float32), t(B, H, L, dtype=torch.float32)
            do, delta = t(B, H, L, hd, dtype=dt), t(B, H, L, dtype=torch.float32)
            dq, dk, dv = o, t(B, kv_heads, L, hd, dtype=torch.float32), t(B, kv_heads, L, hd, dtype=torch.float32)
            common = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      lse.stride(0), lse.stride(1))

            sg, sg_b = (ids, ids.stride(0)) if seg else (q, 0)
            spans = t(B, triton.cdiv(L, 16), 2, dtype=torch.int32) if seg else q  # (shape: only its dtype matters)
            span_b = spans.stride(0) if seg else 0

            def pipelined(cfg, *also):  # loads the loop prefetches (segment ids must not lose them: a branch around them did)
                return dict(ptx_has=also + (("cp.async",) if cfg.num_stages > 1 else ()))

            def tag(cfg):
                return (f"{where}{dname} HEAD_DIM={hd} {cfg} CAUSAL={causal}" + (" tf32" if precision == "tf32" else "")
                        + (" SEGMENTS" if seg else ""))

            check(f"_flash_fwd_kernel {tag(cfgs.fwd)}", FA._flash_fwd_kernel, q, k, v, o, lse, sg, sg, spans,
                  q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                  o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), sg_b, sg_b, span_b,
                  H // kv_heads, L, L, hd, 0, 0, 0.125 * FA.LOG2E, CAUSAL=causal, **fixed, **cfgs.fwd.meta(),
                  **pipelined(cfgs.fwd, "fma.rn.f32"))  # multiply-adds contracted (tile_gemm.FP_FUSION, asked per launch)
            check(f"_flash_bwd_dkdv_kernel {tag(cfgs.dkdv)}", FA._flash_bwd_dkdv_kernel, q, k, v, do, lse, delta,
                  dk, dv, sg, sg, spans, *common, dk.stride(0), dk.stride(1), dk.stride(2), sg_b, sg_b, span_b,
                  H // kv_heads, L, L, hd, 0, 0, 0.125, 0.125 * FA.LOG2E, CAUSAL=causal, **fixed, **cfgs.dkdv.meta(),
                  **pipelined(cfgs.dkdv))
            check(f"_flash_bwd_dq_kernel {tag(cfgs.dq)}", FA._flash_bwd_dq_kernel, q, k, v, do, lse, delta, dq,
                  sg, sg, spans, *common, dq.stride(0), dq.stride(1), dq.stride(2), sg_b, sg_b, span_b, H // kv_heads, L,
                  L, hd, 0, 0, 0.125, 0.125 * FA.LOG2E, CAUSAL=causal, **fixed, **cfgs.dq.meta(), **pipelined(cfgs.dq))


check_flash({("bf16", 64): FC.CUDA_FLASH_16BIT[64], ("bf16", 128): FC.CUDA_FLASH_16BIT[128],
             ("bf16", 256): FC.CUDA_FLASH_16BIT[256], ("fp16", 128): FC.CUDA_FLASH_16BIT[128],
             ("fp32", 64): FC.CUDA_FLASH_FP32[64], ("fp32", 128): FC.CUDA_FLASH_FP32[128],
             ("fp32", 256): FC.CUDA_FLASH_FP32[256], ("bf16", 512): FC.CUDA_FLASH_WIDE,
             ("fp32", 512): FC.CUDA_FLASH_WIDE}, quick_keys=(("bf16", 128), ("fp32", 64)))
if not QUICK:  # plain multi-head attention (GROUP=1), and ids whose rows are not 16-divisible apart or expanded
    bf16_128 = {("bf16", 128): FC.CUDA_FLASH_16BIT[128]}
    check_flash(bf16_128, where="GROUP=1 ", kv_heads=H)
    for stride in (L + 8, 0):
        check_flash(bf16_128, where=f"ids stride {stride} ", ids_stride=stride, segments_only=True)
# GPUs with ~100 KB a block (sm_86/89: 99 KB) get the small-memory tables (D <= 256; wider is a test path)
use_target(86, 99)
if not QUICK:
    check_span_kernels((32, 64), where="sm_86 ")
check_flash({("bf16", 128): FC.CUDA_FLASH_SMALL[128], ("bf16", 256): FC.CUDA_FLASH_SMALL[256],
             ("fp32", 64): FC.CUDA_FLASH_FP32_SMALL[64], ("fp32", 128): FC.CUDA_FLASH_FP32_SMALL[128],
             ("fp32", 256): FC.CUDA_FLASH_FP32_SMALL[256]}, where="sm_86 ")

if not JOBS:  # a mistyped filter must not pass as "0 OK, 0 FAIL"
    print(f"no kernel configuration matches the name filter {FILTER!r}")
    sys.exit(1)
# fork: the workers inherit JOBS (kernels and arguments need no pickling); lines print in queue order
with ProcessPoolExecutor(max_workers=max(1, min(len(JOBS), len(os.sched_getaffinity(0)))),  # the cores we may use
                         mp_context=multiprocessing.get_context("fork")) as pool:
    for line in pool.map(run_job, range(len(JOBS))):
        print(line, flush=True)
        results.append(line)

failed = sum(r.startswith("FAIL") for r in results)
print(f"\n{sum(r.startswith('OK') for r in results)} OK, {failed} FAIL, "
      f"{sum('** OVER' in r for r in results)} over the shared-memory limit")
sys.exit(1 if failed else 0)
