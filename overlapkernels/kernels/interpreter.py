"""Where Triton kernels run in Triton's interpreter, and what that interpreter gets wrong (no
triton import: the dispatch rules ask too).

The interpreter runs every kernel on CPU tensors (and on any tensor under ``TRITON_INTERPRET=1``).
It loads and stores bfloat16 exactly but computes with it wrongly - ``tl.dot`` and elementwise
arithmetic on bf16 values come out ~1e10 off or worse, silently (triton 3.6 and 3.9; fp16 and fp32
are exact) - so kernels that compute in bf16 refuse it there rather than return garbage.
"""
from __future__ import annotations

import os

import torch


def interpreted(device: torch.device) -> bool:
    """Do Triton kernels on ``device``'s tensors run in the interpreter?"""
    return os.environ.get("TRITON_INTERPRET") == "1" or device.type == "cpu"


def bf16_miscomputed(dtype: torch.dtype, device: torch.device) -> bool:
    return dtype == torch.bfloat16 and interpreted(device)


def bf16_message(what: str) -> str:
    return (f"{what} with bfloat16 runs in Triton's interpreter here (CPU), which computes bfloat16 wrongly "
            "(silently); use float16 or float32 on CPU")
