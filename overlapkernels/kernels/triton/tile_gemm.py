"""The GEMM core shared by the fused kernels: one [BLOCK_M, BLOCK_N] output tile in fp32, and the
tile configuration each device gets."""
from __future__ import annotations

import contextlib
import importlib.util
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..._compat import matmul_allows_tf32
from ..interpreter import bf16_message, bf16_miscomputed, interpreted
from ..offsets import FUSED_DTYPES, last_offset, offsets_error


RESERVED_SMS = 4  # left free for the copy stream's wait/signal kernels (default)
RESERVED_SMS_ENV = "OVERLAPKERNELS_RESERVED_SMS"


@triton.jit
def tile_dot(a_ptr, b_ptr, rows, row_mask, cols, col_mask, K, stride_am, stride_ak, stride_bk, stride_bn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
             EVEN_K: tl.constexpr):
    """``a[rows, :] @ b[:, cols]`` accumulated in fp32 (masked rows/cols/K read as 0).

    The main loop covers whole K blocks without a K mask; a ragged K (``EVEN_K`` false) adds one
    masked step after it. (A K mask inside the pipelined loop makes ptxas spill the 128x256
    accumulator on sm_90: scripts/compile_kernels_sm90.py.)"""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    a_ptrs = a_ptr + rows[:, None] * stride_am + tl.arange(0, BLOCK_K)[None, :] * stride_ak
    b_ptrs = b_ptr + tl.arange(0, BLOCK_K)[:, None] * stride_bk + cols[None, :] * stride_bn
    k_whole = K // BLOCK_K * BLOCK_K
    for k0 in range(0, k_whole, BLOCK_K):
        a = tl.load(a_ptrs + k0 * stride_ak, mask=row_mask[:, None], other=0.0)
        b = tl.load(b_ptrs + k0 * stride_bk, mask=col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if not EVEN_K:
        ks = k_whole + tl.arange(0, BLOCK_K)
        a = tl.load(a_ptrs + k_whole * stride_ak, mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
        b = tl.load(b_ptrs + k_whole * stride_bk, mask=(ks < K)[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


@triton.jit
def tile_dot_tma(a_desc, b_desc, row0, col0, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 B_K_MAJOR: tl.constexpr):
    """``tile_dot`` through tensor descriptors (TMA on Hopper): ``a[row0:row0+BLOCK_M, :] @
    b[:, col0:col0+BLOCK_N]`` in fp32. The copy engine of each SM moves whole tiles: no per-thread
    addresses (ptxas, triton 3.6, sm_90: 197-212 registers at 128x256x64 w8, where the pointer loads take
    216-220) and no masks - reads past the tensor's edge, ragged K included, come back 0.
    ``B_K_MAJOR``: ``b_desc`` describes b's transpose [N, K] (a linear layer's weight as stored)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = a_desc.load([row0, k0])
        if B_K_MAJOR:
            b = b_desc.load([col0, k0]).T
        else:
            b = b_desc.load([k0, col0])
        acc = tl.dot(a, b, acc)
    return acc


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and launch options of the fused GEMMs. Every rank must derive the same config
    for a call (gemm_rs owners wait for a tile count), so it depends only on shape, dtype and the
    device model, never on timing (no autotuning inside an op)."""
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    # 16-bit operands loaded through tensor descriptors (tma_operands) where they qualify; pointer
    # loads otherwise. Not in the defaults until a GPU run times it (bench_fused_gemm sweeps it).
    tma: bool = False
    # The all-gather GEMM's 16-bit output tiles stored through a tensor descriptor (tma_output): the
    # tile goes registers -> shared memory -> one bulk copy, and the SM waits only until the copy
    # has read shared memory (cp.async.bulk.wait_group.read 0 right after it), not for the global
    # writes. Triton 3.9 reuses the main loop's shared memory for it; 3.6 gives it a buffer of its
    # own (64 KB at 128x256: 208 KB in all, so 4 stages no longer fit; compile_kernels_sm90.py). At
    # K = 1024 the epilogue's 64 KB a tile (128x256 bf16) against 16 K steps is the likeliest part
    # of the gap to torch.mm (0.81x on an H200). A flattened loop that would overlap it with the
    # next tile's loads loses software pipelining to the chunk wait's loop. GEMM + RS stores into
    # peers' buffers: pointer stores there. Not in the defaults until a GPU run times it.
    tma_store: bool = False
    # Persistent programs per SM. With 2, two blocks share each SM, so one's epilogue (and its next
    # tile's pipeline fill) runs while the other's main loop keeps the tensor cores busy - CUTLASS's
    # "ping-pong" through occupancy instead of warp specialization. A block then gets half an SM:
    # scripts/compile_kernels_sm90.py checks that two fit (registers, shared memory) with room
    # for a flag kernel. Not in the defaults until a GPU run times it (bench_fused_gemm sweeps it).
    programs_per_sm: int = 1

    def __post_init__(self):
        if self.programs_per_sm not in (1, 2):
            raise ValueError(f"GemmConfig programs_per_sm={self.programs_per_sm!r}: expected 1 or 2")

    def __str__(self) -> str:  # how benchmarks and the compile report name it
        return (f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages}"
                + " tma" * self.tma + " tma-store" * self.tma_store
                + f" {self.programs_per_sm}/SM" * (self.programs_per_sm > 1))

    def tiles(self, rows: int, n: int) -> int:
        return triton.cdiv(rows, self.block_m) * triton.cdiv(n, self.block_n)

    def meta(self, k: int) -> dict:
        """The constexprs and launch options of one kernel call with reduction length ``k``."""
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, BLOCK_K=self.block_k, EVEN_K=k % self.block_k == 0,
                    num_warps=self.num_warps, num_stages=self.num_stages, **FP_FUSION)


# Multiply-adds contracted into FMAs, as every triton so far compiles by default: triton 3.9 warns that
# 3.10 turns the default off, which would change the kernels' speed and rounding under a new triton.
# Asked per launch (triton's global knob would change every other kernel in the process too).
FP_FUSION = dict(enable_fp_fusion=True)

# The interpreter runs tiles as numpy arrays: mid-sized tiles keep CPU tests quick.
INTERPRETER_GEMM = GemmConfig(64, 64, 32)
# GPUs, from compiling every config for sm_90 (scripts/compile_kernels_sm90.py reports shared
# memory, wgmma use, ptxas registers and spills) - not yet timed by this project:
# bench_fused_gemm.py sweeps them on a GPU. 16-bit: 128x256x64 with two warpgroups and three
# stages is Triton's usual best large-GEMM tile on Hopper (wgmma, 144 KB of shared memory, no
# spills; fits A100's 164 KB). It spills when K is ragged (the masked tail step), and wastes
# tensor-core work on chunks of few rows or columns: those take 64x128x64 (no spills for whole
# K blocks; a ragged K spills 4 bytes). fp32 (IEEE: FMA, no tensor cores): 128x64 with 8 warps
# keeps its accumulator in registers in every layout (<= 175 registers). 128x128 took all 255,
# spilled with a transposed weight (every linear layer) and, at 8 warps x 255 registers, filled
# an SM's whole register file: the flag kernels the GEMM waits on could then run only on the
# reserved SMs. The compile script checks that every config leaves them room.
CUDA_GEMM_16BIT = GemmConfig(128, 256, 64, num_warps=8, num_stages=3)
CUDA_GEMM_16BIT_SMALL = GemmConfig(64, 128, 64, num_warps=4, num_stages=4)
CUDA_GEMM_FP32 = GemmConfig(128, 64, 32, num_warps=8, num_stages=3)
# Parts with ~100 KB of shared memory per block (consumer and workstation GPUs): the big and the
# small/ragged/fp32 tile.
SMALL_SMEM_GEMM = GemmConfig(128, 128, 32, num_warps=4, num_stages=3)
SMALL_SMEM_GEMM_SMALL = GemmConfig(64, 64, 32, num_warps=4, num_stages=3)

_forced: GemmConfig | None = None


@contextlib.contextmanager
def forced_gemm_config(config: GemmConfig):
    """Every fused GEMM launched inside uses ``config`` (benchmark sweeps, tests of tile shapes).
    Process-wide, not per thread: the thread world's ranks must all see it."""
    global _forced
    previous, _forced = _forced, config
    try:
        yield config
    finally:
        _forced = previous


def shared_memory_per_block(device: torch.device) -> int:
    """Opt-in shared memory per block of a CUDA device, in bytes."""
    props = torch.cuda.get_device_properties(device)
    optin = getattr(props, "shared_memory_per_block_optin", None)  # not in every torch
    if optin is None:
        optin = {(9, 0): 227 << 10, (8, 0): 163 << 10}.get((props.major, props.minor), 99 << 10)
    return optin


def gemm_config(device: torch.device, dtype: torch.dtype, rows_per_chunk: int, n: int, k: int) -> GemmConfig:
    """The tile config for a chunk GEMM [rows_per_chunk, k] @ [k, n] on ``device``."""
    if _forced is not None:
        return _forced
    if device.type != "cuda":
        return INTERPRETER_GEMM
    big_smem = shared_memory_per_block(device) >= 160 * 1024
    if dtype == torch.float32:
        return CUDA_GEMM_FP32 if big_smem else SMALL_SMEM_GEMM_SMALL
    if rows_per_chunk <= 64 or n <= 128 or k % CUDA_GEMM_16BIT.block_k:
        return CUDA_GEMM_16BIT_SMALL if big_smem else SMALL_SMEM_GEMM_SMALL
    return CUDA_GEMM_16BIT if big_smem else SMALL_SMEM_GEMM


def tma_operands(a: torch.Tensor, b: torch.Tensor, config: GemmConfig) -> tuple:
    """``(TMA, a_desc, b_desc, B_K_MAJOR)`` for a fused GEMM's launch: descriptors of ``a`` [M, K] and
    ``b`` [K, N] when ``config.tma`` asks and they qualify - 16-bit, not empty, each 2-D with one
    unit stride, its base and other stride 16-byte aligned (what a tensor map needs) - on a GPU with
    TMA (sm_90+) or in the interpreter; else ``(False, None, None, False)``: the pointer loads. ``b``
    may be [K, N] row-major or the transpose of an [N, K] one, a linear layer's weight."""
    none = (False, None, None, False)
    if not config.tma or not _descriptors_possible(a, b) or not _tensor_map_fits(a):
        return none
    from triton.tools.tensor_descriptor import TensorDescriptor

    a_desc = TensorDescriptor.from_tensor(a, [config.block_m, config.block_k])
    if _tensor_map_fits(b):
        return True, a_desc, TensorDescriptor.from_tensor(b, [config.block_k, config.block_n]), False
    if _tensor_map_fits(b.t()):
        return True, a_desc, TensorDescriptor.from_tensor(b.t(), [config.block_n, config.block_k]), True
    return none


def tma_output(out: torch.Tensor, world_size: int, config: GemmConfig) -> tuple:
    """``(TMA_STORE, c_desc)`` for the all-gather GEMM's epilogue: when ``config.tma_store`` asks and
    ``out`` [W*m, N] qualifies (as tma_operands' operands do), a descriptor of it seen as [W, m, N]
    with [1, BLOCK_M, BLOCK_N] blocks. Per chunk, so the copy engine clips a tile's rows past its
    chunk's end: a [W*m, N] descriptor would write them into the next chunk's rows, which another
    tile owns (and may already have written). Else ``(False, None)``: pointer stores."""
    if not config.tma_store or not _descriptors_possible(out) or not _tensor_map_fits(out):
        return False, None
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, n, row = out.shape[0] // world_size, out.shape[1], out.stride(0)
    return True, TensorDescriptor(out, [world_size, m, n], [m * row, row, 1], [1, config.block_m, config.block_n])


def _descriptors_possible(*tensors: torch.Tensor) -> bool:
    """16-bit, not empty, on a GPU with TMA (sm_90+) or in the interpreter, with a triton that makes
    host-side descriptors."""
    if any(t.dtype not in (torch.float16, torch.bfloat16) or not t.numel() for t in tensors):
        return False
    if not interpreted(tensors[0].device) and torch.cuda.get_device_capability(tensors[0].device) < (9, 0):
        return False
    return importlib.util.find_spec("triton.tools.tensor_descriptor") is not None  # (older tritons have none)


def _tensor_map_fits(t: torch.Tensor) -> bool:
    """2-D with one unit stride, its base and row stride 16-byte aligned (what a tensor map needs),
    rows at least a row apart (a tensor map cannot describe expanded or overlapping rows)."""
    return t.dim() == 2 and t.stride(1) == 1 and t.stride(0) >= t.shape[1] and t.data_ptr() % 16 == 0 \
        and t.stride(0) * t.element_size() % 16 == 0


def launch_device(device: torch.device):
    """Context for launching on ``device``: Triton launches on torch's *current* device, so a rank
    whose tensors are on cuda:3 while cuda:0 is current would run its kernels on GPU 0."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def dot_precision(dtype: torch.dtype):
    """fp32 inputs: IEEE unless torch allows TF32 (so fp32 results match torch.mm); 16-bit: default."""
    if dtype == torch.float32:
        return "tf32" if matmul_allows_tf32() else "ieee"
    return None


def num_programs(device: torch.device, tiles: int, ranks_per_device: int = 1, programs_per_sm: int = 1) -> int:
    """Persistent grid: ``programs_per_sm`` programs per SM on a GPU, less a reserve of SMs, shared
    among the ranks on that GPU; two in the interpreter (enough to interleave).

    Why the reserve: the GEMM's tiles spin until the copy stream's flag kernels run; if the GEMM
    held every SM those kernels could never be scheduled (deadlock)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(tiles, (sms - reserved_sms()) * programs_per_sm // ranks_per_device))
    return max(1, min(tiles, 2))


def reserved_sms() -> int:
    """SMs the persistent GEMMs leave free: ``$OVERLAPKERNELS_RESERVED_SMS``, default 4 (the flag
    kernels need one). Raise it when NCCL collectives (FSDP, DP, CP) run beside ``fused``: their
    kernels take free SMs too, and the flag kernels would queue behind them. Read at every call;
    set it alike on every rank."""
    raw = os.environ.get(RESERVED_SMS_ENV)
    if raw is None:
        return RESERVED_SMS
    if not raw.strip().isdigit() or int(raw) < 1:
        raise ValueError(f"{RESERVED_SMS_ENV}={raw!r}: expected a whole number of SMs >= 1")
    return int(raw)


def check_gemm_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, world_size: int) -> None:
    """``a`` [W*m, K] and ``out`` [W*m, N] (or the [W, m, N] slots) in ``world_size`` chunks."""
    if a.dtype not in FUSED_DTYPES:
        raise ValueError(f"fused GEMM: dtype {a.dtype} not supported; expected float32, float16 or bfloat16")
    if bf16_miscomputed(a.dtype, a.device):
        raise ValueError(bf16_message("fused GEMM"))
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fused GEMM: expected a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
    m = a.shape[0] // world_size
    spans = {"a chunk": last_offset((m, a.shape[1]), a.stride()), "b": last_offset(b.shape, b.stride()),
             "output chunk": last_offset((m, out.shape[-1]), out.stride()[-2:])}
    if error := offsets_error(spans, f"a {tuple(a.shape)} in {world_size} chunks, b {tuple(b.shape)}"):
        raise ValueError(error)
