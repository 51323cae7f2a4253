"""The fused GEMMs' offset limit, in plain Python (no Triton import): the ops check sizes against it
before choosing or running ``fused``, and the kernels' launcher checks the operands themselves."""
from __future__ import annotations

import torch

INT32_OFFSETS = 1 << 31
FUSED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what the fused GEMMs' tiles compute in


def fused_dtype_error(dtype: torch.dtype) -> str | None:
    """Why the fused GEMMs cannot take operands of ``dtype`` (float64: no Triton dot for it), or None."""
    if dtype in FUSED_DTYPES:
        return None
    return (f"method='fused' computes float32, float16 or bfloat16 operands, got {dtype}; use method='symm' "
            "(torch's matmul per chunk) or 'decomposed'")


def last_offset(shape, strides) -> int:
    """The element offset of the last element of a tensor of ``shape`` and ``strides``."""
    return sum((size - 1) * stride for size, stride in zip(shape, strides) if size > 0)


def offsets_error(last_offsets: dict, operands: str) -> str | None:
    """The fused kernels address each chunk from a 64-bit base with 32-bit offsets (fewer address
    registers in the main loop): why an operand whose last element lies at offset 2^31 or beyond
    cannot run, or None. ``last_offsets``: {"a chunk" / "b" / "output chunk": offset}."""
    too_far = [f"the {name} spans {last + 1} elements" for name, last in last_offsets.items() if last >= INT32_OFFSETS]
    if not too_far:
        return None
    return (f"fused GEMM: {', '.join(too_far)} ({operands}); the kernel's offsets within a chunk are 32-bit "
            "(< 2^31 elements): use method='symm' (cuBLAS per chunk) or 'decomposed'")


def fused_sizes_error(rows_per_chunk: int, k: int, n: int) -> str | None:
    """``offsets_error`` for dense operands: a chunk [rows_per_chunk, k], b [k, n], an output chunk
    [rows_per_chunk, n]."""
    spans = {"a chunk": rows_per_chunk * k - 1, "b": k * n - 1, "output chunk": rows_per_chunk * n - 1}
    return offsets_error(spans, f"{rows_per_chunk} rows per chunk, K={k}, N={n}")
