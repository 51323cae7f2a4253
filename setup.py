"""overlapkernels: communication/computation overlap kernels for TP, SP and CP training.

``pip install .`` also builds the CUDA library from csrc/ when nvcc is found (never probing
GPUs): ``OVERLAPKERNELS_SKIP_CUDA=1`` skips it; a failed build is fatal only with
``OVERLAPKERNELS_BUILD_CUDA=1``, otherwise the package installs without it (pure-torch and Triton
paths still work, and CUDA-library features say how to build it).
"""
import functools
import importlib.util
import os
import shutil
from pathlib import Path

from setuptools import Distribution, find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=None)  # has_ext_modules and build_py both ask: load csrc/build.py once
def _csrc_builder():
    spec = importlib.util.spec_from_file_location("_ok_csrc_build", ROOT / "csrc" / "build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithCuda(build_py):
    def run(self):
        super().run()
        editable = getattr(self, "editable_mode", False)
        if not editable:  # a library an earlier build left in build/ must not ship in this one
            shutil.rmtree(Path(self.build_lib) / "overlapkernels" / "_lib", ignore_errors=True)
        if os.environ.get("OVERLAPKERNELS_SKIP_CUDA") == "1":
            return
        required = os.environ.get("OVERLAPKERNELS_BUILD_CUDA") == "1"
        builder = _csrc_builder()
        if builder.nvcc_path() is None:
            if required:
                raise RuntimeError("OVERLAPKERNELS_BUILD_CUDA=1 but nvcc was not found")
            print("overlapkernels: nvcc not found, installing without the CUDA library")
            return
        # editable installs load the package from the source tree, so the library goes there
        pkg_root = ROOT if editable else Path(self.build_lib)
        try:
            builder.build(pkg_root / "overlapkernels" / "_lib", force=not getattr(self, "editable_mode", False))
        except RuntimeError as exc:
            if required:
                raise
            print(f"overlapkernels: CUDA library build failed, installing without it:\n{exc}")


def _builds_cuda_library() -> bool:
    return os.environ.get("OVERLAPKERNELS_SKIP_CUDA") != "1" and _csrc_builder().nvcc_path() is not None


class CudaLibraryDistribution(Distribution):
    """A wheel that carries the CUDA library (a native .so, built for this machine's architecture) is
    tagged for this platform, not ``py3-none-any``, so pip will not install it on another (an x86_64
    library on an aarch64 Grace node)."""

    def has_ext_modules(self):
        return _builds_cuda_library()


try:  # setuptools >= 70.1 has it; before, the wheel package did
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:
    try:
        from wheel.bdist_wheel import bdist_wheel as _bdist_wheel
    except ImportError:
        _bdist_wheel = None

if _bdist_wheel is not None:
    class BdistWheelAnyPython(_bdist_wheel):
        """The library is loaded through ctypes, not as a Python extension: a platform wheel holds for
        any Python 3 (py3-none-<platform>), not only the one that built it."""

        def get_tag(self):
            python, abi, plat = super().get_tag()
            return (python, abi, plat) if self.root_is_pure else ("py3", "none", plat)


setup(
    name="overlapkernels",
    version="0.1.0",
    description="Matmuls fused with all-gather / reduce-scatter, ring attention and parallel layers "
                "that hide communication behind computation on NVLink GPU nodes",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["overlapkernels", "overlapkernels.*"]),
    install_requires=["torch>=2.7", "triton", "nvidia-ml-py"],
    # megatron-core (interchange tests only) is an extra of its own: it needs torch>=2.6, and pip would
    # replace an older torch to satisfy it; `make test` installs it only over a torch that satisfies it
    extras_require={"test": ["pytest>=7", "pytest-timeout"], "bench": ["matplotlib", "rich"],
                    "megatron": ["megatron-core==0.16.1"]},
    entry_points={"console_scripts": ["overlapkernels=overlapkernels.cli:main"]},
    cmdclass={"build_py": BuildPyWithCuda, **({"bdist_wheel": BdistWheelAnyPython} if _bdist_wheel else {})},
    distclass=CudaLibraryDistribution,
)
