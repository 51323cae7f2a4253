"""The fused GEMMs and flash kernels follow torch's TF32 setting for fp32 inputs, whichever API the
user set it with and whenever. Since torch 2.9 the way is ``fp32_precision`` (per backend or global);
once it was used, reading the legacy ``allow_tf32`` raises, which every symm/fused call on a GPU did
(its kernel-warmup key) and every fp32 fused GEMM or flash kernel (its dot precision). One fresh
process (the settings are process-wide) goes through the settings in turn, the legacy API first, as a
user who never touched the new one, and reads the dot precision after each: it is read at every call,
never cached."""
import subprocess
import sys
import textwrap

import torch

_SCRIPT = textwrap.dedent("""
    import torch
    from overlapkernels.kernels.triton.tile_gemm import dot_precision

    def setting(statement):
        exec(statement, {"torch": torch})
        print(repr(statement), dot_precision(torch.float32), dot_precision(torch.bfloat16))

    setting("")  # torch's default: no TF32 in fp32 matmuls
    setting("torch.backends.cuda.matmul.allow_tf32 = True")  # the legacy API
    setting("torch.backends.cuda.matmul.allow_tf32 = False")
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):  # torch >= 2.9
        setting("torch.backends.cuda.matmul.fp32_precision = 'tf32'")
        setting("torch.backends.cuda.matmul.fp32_precision = 'ieee'")
        setting("torch.backends.cuda.matmul.fp32_precision = 'none'; torch.backends.fp32_precision = 'tf32'")
        setting("torch.backends.cuda.matmul.fp32_precision = 'ieee'")  # the backend's own wins over the global
        setting("torch.backends.fp32_precision = 'none'; torch.backends.cuda.matmul.fp32_precision = 'none'")
        setting("torch.set_float32_matmul_precision('high')")
""")

NEW_API = [("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),
           ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", "ieee"),
           ("torch.backends.cuda.matmul.fp32_precision = 'none'; torch.backends.fp32_precision = 'tf32'", "tf32"),
           ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", "ieee"),
           ("torch.backends.fp32_precision = 'none'; torch.backends.cuda.matmul.fp32_precision = 'none'", "ieee"),
           ("torch.set_float32_matmul_precision('high')", "tf32")]


def test_fp32_dot_precision_follows_torch_whichever_api_set_it_and_when():
    out = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    want = [("", "ieee"), ("torch.backends.cuda.matmul.allow_tf32 = True", "tf32"),
            ("torch.backends.cuda.matmul.allow_tf32 = False", "ieee")]
    if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        want += NEW_API
    assert out.stdout.splitlines() == [f"{statement!r} {precision} None" for statement, precision in want], out.stdout
