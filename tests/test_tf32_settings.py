"""The fused GEMMs and flash kernels follow torch's TF32 setting for fp32 inputs, whichever API the
user set it with. Since torch 2.9 the way is ``fp32_precision`` (per backend or global); once it
was used, reading the legacy ``allow_tf32`` raises, which every symm/fused call on a GPU did (its
kernel-warmup key) and every fp32 fused GEMM or flash kernel (its dot precision). Each setting runs
in a fresh process: the settings are process-wide and mixing the APIs poisons later reads."""
import subprocess
import sys

import pytest
import torch

SETTINGS = [  # (how the user set it, the dot precision our fp32 kernels must then use)
    ("", "ieee"),  # torch's default: no TF32 in fp32 matmuls
    ("torch.backends.cuda.matmul.allow_tf32 = True", "tf32"),  # the legacy API
    ("torch.backends.cuda.matmul.fp32_precision = 'tf32'", "tf32"),
    ("torch.backends.cuda.matmul.fp32_precision = 'ieee'", "ieee"),
    ("torch.backends.fp32_precision = 'tf32'", "tf32"),  # global; the matmul backend inherits it
    ("torch.backends.fp32_precision = 'tf32'; torch.backends.cuda.matmul.fp32_precision = 'ieee'", "ieee"),
    ("torch.set_float32_matmul_precision('high')", "tf32"),
]


@pytest.mark.parametrize("setting, want", SETTINGS)
def test_fp32_dot_precision_follows_torch_whichever_api_set_it(setting, want):
    if "fp32_precision" in setting and not hasattr(torch.backends.cuda.matmul, "fp32_precision"):
        pytest.skip(f"torch {torch.__version__} has no fp32_precision API")
    script = ("import torch\n" + setting + "\n"
              "from overlapkernels.kernels.triton.tile_gemm import dot_precision\n"
              "print(dot_precision(torch.float32), dot_precision(torch.bfloat16))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [want, "None"], out.stdout


def test_a_setting_changed_between_calls_is_seen():
    """Read at every call, not once: a training script may switch TF32 on after a first fp32 call."""
    script = ("import torch\n"
              "from overlapkernels.kernels.triton.tile_gemm import dot_precision\n"
              "print(dot_precision(torch.float32))\n"
              "torch.backends.cuda.matmul.allow_tf32 = True\n"
              "print(dot_precision(torch.float32))\n"
              "torch.backends.cuda.matmul.allow_tf32 = False\n"
              "print(dot_precision(torch.float32))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ieee", "tf32", "ieee"], out.stdout
