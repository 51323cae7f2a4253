"""What `pip install .` / `pip wheel .` ship: every module of the package, and a wheel tag that says
whether it carries the CUDA library (a native .so for this machine's architecture)."""
import os
import runpy
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import overlapkernels

ROOT = Path(__file__).resolve().parent.parent


def _setup_kwargs(monkeypatch) -> dict:
    setuptools = pytest.importorskip("setuptools", reason="building the package needs setuptools")
    captured = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: captured.update(kwargs))
    runpy.run_path(str(ROOT / "setup.py"))
    return captured


def test_the_wheel_is_tagged_for_the_platform_only_when_it_carries_the_cuda_library(monkeypatch):
    kwargs = _setup_kwargs(monkeypatch)
    nvcc = runpy.run_path(str(ROOT / "csrc" / "build.py"))["nvcc_path"]()
    monkeypatch.delenv("OVERLAPKERNELS_SKIP_CUDA", raising=False)
    assert kwargs["distclass"]().has_ext_modules() is (nvcc is not None)
    monkeypatch.setenv("OVERLAPKERNELS_SKIP_CUDA", "1")
    assert kwargs["distclass"]().has_ext_modules() is False
    # megatron-core needs torch>=2.6: never in the test extra, where pip would replace an older torch
    assert not any("megatron" in req for req in kwargs["extras_require"]["test"] + kwargs["install_requires"])


def test_a_pure_wheel_holds_every_module_of_the_package(tmp_path):
    pytest.importorskip("setuptools", reason="building the package needs setuptools")
    env = {**os.environ, "OVERLAPKERNELS_SKIP_CUDA": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(ROOT)], check=True, env=env, cwd=tmp_path, timeout=240,
                   capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    package = Path(overlapkernels.__file__).parent
    want = {str(p.relative_to(package.parent)) for p in package.rglob("*.py")}
    with zipfile.ZipFile(wheel) as z:
        got = {n for n in z.namelist() if n.endswith(".py")}
        assert not any("/_lib/" in n for n in z.namelist())
    assert want <= got, sorted(want - got)
