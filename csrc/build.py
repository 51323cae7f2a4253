"""Build csrc/*.cu into overlapkernels/_lib/liboverlapkernels_cuda.so with nvcc.

Plain Python with no torch import, so setup.py and the Makefile share it. Targets sm_80 and
sm_90 with PTX for newer GPUs; the CUDA runtime is linked statically, so loading the library
needs only the driver (and loading it, unlike calling it, needs no GPU at all).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = sorted((ROOT / "csrc").glob("*.cu"))
HEADERS = sorted((ROOT / "csrc").glob("*.h"))
LIB_NAME = "liboverlapkernels_cuda.so"
ARCH_FLAGS = ["-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
              "-gencode=arch=compute_90,code=compute_90"]


def nvcc_path() -> str | None:
    """$CUDA_HOME/$CUDA_PATH, then PATH, then the toolkit's usual home (images often leave it off PATH)."""
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home and (Path(cuda_home) / "bin" / "nvcc").exists():
        return str(Path(cuda_home) / "bin" / "nvcc")
    found = shutil.which("nvcc")
    if found is None and Path("/usr/local/cuda/bin/nvcc").exists():
        found = "/usr/local/cuda/bin/nvcc"
    return found


def up_to_date(out: Path) -> bool:
    return out.exists() and all(out.stat().st_mtime >= src.stat().st_mtime for src in SOURCES + HEADERS)


def build(out_dir: Path | None = None, *, force: bool = False, verbose: bool = True) -> Path:
    """Compile the library; returns its path. Raises RuntimeError when nvcc is missing or fails."""
    out_dir = Path(out_dir or ROOT / "overlapkernels" / "_lib")
    out = out_dir / LIB_NAME
    if not force and up_to_date(out):
        return out
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH) - cannot build csrc/")
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".so.tmp")
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC,-fvisibility=hidden", "-cudart", "static",
           *ARCH_FLAGS, f"-I{ROOT / 'csrc'}", *map(str, SOURCES), "-o", str(tmp)]
    if verbose:
        print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"nvcc failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")
    os.replace(tmp, out)  # atomic: a half-written library is never picked up
    return out


if __name__ == "__main__":
    if "--find-nvcc" in sys.argv:  # scripts/gpu_check.sh: is there an nvcc to build with (where build() looks)?
        found = nvcc_path()
        print(found or "nvcc not found")
        sys.exit(0 if found else 1)
    try:
        print(build(force="--force" in sys.argv))
    except RuntimeError as exc:
        sys.exit(str(exc))
