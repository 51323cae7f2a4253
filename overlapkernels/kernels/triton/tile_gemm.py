"""The GEMM core shared by the fused kernels: one [BLOCK_M, BLOCK_N] output tile in fp32."""
import torch
import triton
import triton.language as tl


RESERVED_SMS = 4  # left free for the copy stream's wait/signal kernels


@triton.jit
def tile_dot(a_ptr, b_ptr, rows, row_mask, cols, col_mask, K, stride_am, stride_ak, stride_bk, stride_bn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """``a[rows, :] @ b[:, cols]`` accumulated in fp32 (masked rows/cols/K read as 0)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak,
                    mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn,
                    mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return acc


def dot_precision(dtype: torch.dtype):
    """fp32 inputs: IEEE unless torch allows TF32 (so fp32 results match torch.mm); 16-bit: default."""
    if dtype == torch.float32:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    return None


def num_programs(device: torch.device, tiles: int, ranks_per_device: int = 1) -> int:
    """Persistent grid: one program per SM on a GPU, less a reserve, shared among the ranks on that
    GPU; two in the interpreter (enough to interleave).

    Why the reserve: the GEMM's tiles spin until the copy stream's flag kernels run; if the GEMM
    held every SM those kernels could never be scheduled (deadlock)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(tiles, (sms - RESERVED_SMS) // ranks_per_device))
    return max(1, min(tiles, 2))


def check_gemm_operands(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if a.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"fused GEMM: dtype {a.dtype} not supported; expected float32, float16 or bfloat16")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"fused GEMM: expected a [M, K] and b [K, N], got {tuple(a.shape)} and {tuple(b.shape)}")
