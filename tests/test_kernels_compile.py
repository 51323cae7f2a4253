"""Every Triton kernel compiles for sm_90 (H100/H200) down to a cubin - no GPU needed.

The CPU tests run the kernels in Triton's interpreter, which accepts code the compiler rejects
(loop-carried type changes, constexpr misuse, dot shapes); this runs the real compiler on one
configuration per kernel, in a process without TRITON_INTERPRET.
"""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))  # a fresh cache: really compile
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "compile_kernels_sm90.py"), "--quick"], env=env,
                         capture_output=True, text=True, timeout=600)
    if out.returncode == 3:
        pytest.skip(out.stdout.strip())
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " 0 FAIL, 0 over the shared-memory limit" in out.stdout


# The resource checks fail the configurations they were added for: the fp32 GEMM tile before it
# shrank (8 warps x 255 registers fill an SM: no room for a flag kernel), two programs per SM whose
# blocks cannot both be resident, and a flag kernel launched with more than one warp.
PLANTS = {
    "fp32 GEMM 128x128 w8": ("TG.CUDA_GEMM_FP32 = TG.GemmConfig(128, 128, 32, num_warps=8, num_stages=3)",
                             "_ag_gemm_kernel fp32 128x128x32 w8 s3 b K=", "no room for a flag kernel beside the block"),
    # two programs per SM: 2 x 128 KB of shared memory is more than an SM has (registers would fit)
    "two 128 KB blocks an SM": ("TG.CUDA_GEMM_16BIT = TG.GemmConfig(128, 128, 64, num_warps=4, num_stages=4, "
                                "programs_per_sm=2)", "_ag_gemm_kernel bf16 128x128x64 w4 s4 2/SM b K=",
                                "2 blocks of 131"),
    "two-warp flag kernel": ("SG.FLAG_KERNEL_LAUNCH['num_warps'] = 2", "_set_flag_kernel aligned",
                             "_set_flag_kernel aligned flag, generic ints: AssertionError: (2, "),
    # not a plant: a mistyped name filter compiled nothing and passed as "0 OK, 0 FAIL"
    "a filter matching nothing": ("pass", "_flash_fwd_kernal", "no kernel configuration matches the name filter "
                                                               "'_flash_fwd_kernal'"),
}


# One process imports torch and triton once, then forks a child per plant (each child patches its
# own copy of the modules and runs the script's --quick set filtered to that one config): three
# separate interpreters cost ~5 s of CI more.
PLANT_RUNNER = """
import json, os, runpy, sys
from overlapkernels.kernels.triton import tile_gemm as TG, signals as SG
plants, script, out_dir = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
codes = {}
for i, (name, (patch, name_filter, _)) in enumerate(plants.items()):
    path = os.path.join(out_dir, f"plant{i}.out")
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout.reconfigure(line_buffering=True)  # what it printed survives a crash
            exec(patch)
            sys.argv = ["compile_kernels_sm90.py", "--quick", name_filter]
            runpy.run_path(script, run_name="__main__")
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            import traceback
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    codes[name] = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), path]
print(json.dumps(codes))
"""


@pytest.fixture(scope="module")
def planted_runs(tmp_path_factory):
    """{plant: (exit code, the script's output)} for every plant, from one subprocess."""
    tmp = tmp_path_factory.mktemp("plants")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp / "cache"))  # a fresh cache: really compile
    # its own session: a timeout kills the forked children (and their compile workers) too
    runner = subprocess.Popen([sys.executable, "-c", PLANT_RUNNER, json.dumps(PLANTS),
                               str(ROOT / "scripts" / "compile_kernels_sm90.py"), str(tmp)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = runner.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(runner.pid, signal.SIGKILL)
        runner.communicate()
        raise
    assert runner.returncode == 0, stdout[-4000:] + stderr[-4000:]
    return {name: (code, Path(path).read_text()) for name, (code, path) in json.loads(stdout).items()}


@pytest.mark.parametrize("plant", list(PLANTS))
def test_compile_script_fails_a_config_without_room_for_flag_kernels(planted_runs, plant):
    code, output = planted_runs[plant]
    if code == 3:
        pytest.skip(output.strip())
    assert code == 1 and PLANTS[plant][2] in output, output[-4000:]
    if plant != "a filter matching nothing":
        assert "\n0 OK, 1 FAIL," in output, output[-4000:]
