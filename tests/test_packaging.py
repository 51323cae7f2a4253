"""What `pip install .` / `pip wheel .` ship: every module of the package, and a wheel tag that says
whether it carries the CUDA library (a native .so for this machine's architecture, loaded through
ctypes, so any Python 3 will do)."""
import os
import runpy
import shutil
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


@pytest.mark.parametrize("skip_cuda", [False, True])
def test_the_wheel_is_tagged_for_the_platform_only_when_it_carries_the_cuda_library(monkeypatch, skip_cuda):
    kwargs = _setup_kwargs(monkeypatch)
    import importlib.util

    if not any(importlib.util.find_spec(m) for m in ("setuptools.command.bdist_wheel", "wheel")):
        pytest.skip("neither setuptools >= 70.1 nor the wheel package: no wheels to tag")
    nvcc = runpy.run_path(str(ROOT / "csrc" / "build.py"))["nvcc_path"]()
    if skip_cuda:
        monkeypatch.setenv("OVERLAPKERNELS_SKIP_CUDA", "1")
    else:
        monkeypatch.delenv("OVERLAPKERNELS_SKIP_CUDA", raising=False)
    dist = kwargs["distclass"]({"name": "overlapkernels", "version": "0"})
    command = kwargs["cmdclass"]["bdist_wheel"](dist)
    command.ensure_finalized()
    python, abi, plat = command.get_tag()
    if nvcc is None or skip_cuda:
        assert (command.root_is_pure, plat) == (True, "any"), (python, abi, plat)
    else:
        assert not command.root_is_pure and (python, abi) == ("py3", "none") and plat != "any", (python, abi, plat)
    # megatron-core needs torch>=2.6: never in the test extra, where pip would replace an older torch
    assert not any("megatron" in req for req in kwargs["extras_require"]["test"] + kwargs["install_requires"])


def test_a_pure_wheel_holds_every_module_of_the_package(tmp_path):
    pytest.importorskip("setuptools", reason="building the package needs setuptools")
    pytest.importorskip("pip", reason="building the wheel uses pip")
    source = tmp_path / "src"  # a copy: the checkout may be read-only, and its build/ may hold an old build
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                                                "__pycache__", "_lib", "benchmarks", "tests"))
    env = {**os.environ, "OVERLAPKERNELS_SKIP_CUDA": "1"}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(source)], env=env, cwd=tmp_path, timeout=240,
                           capture_output=True, text=True)
    if built.returncode and "invalid command 'bdist_wheel'" in built.stdout + built.stderr:
        pytest.skip("setuptools < 70.1 without the wheel package cannot build wheels")
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    assert wheel.name.endswith("-py3-none-any.whl"), wheel.name
    package = Path(overlapkernels.__file__).parent
    want = {str(p.relative_to(package.parent)) for p in package.rglob("*.py")}
    with zipfile.ZipFile(wheel) as z:
        got = {n for n in z.namelist() if n.endswith(".py")}
        assert not any("/_lib/" in n for n in z.namelist())
    assert want <= got, sorted(want - got)
