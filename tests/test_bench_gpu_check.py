"""`make gpu-check` stays within 8 minutes: a deadline fixed when make starts bounds the CUDA probe and
cuts every step of scripts/gpu_check.sh (the one csrc build included) to the time left; each step's
full output goes to a log, pytest's results to junit XML, and a summary table ends the output; a
benchmark killed by its limit keeps the rows it measured (orchestration only: a stand-in python,
no GPU)."""
import csv
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
JUNIT = ('<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" failures="2" '
         'skipped="3" tests="10" time="1.0"></testsuite></testsuites>')
# A benchmark that measures two rows, then hangs until its step's time limit stops it.
HANGING_BENCH = """
import sys, time
from overlapkernels.bench.report import RowLog, exit_on_sigterm
rows = RowLog(sys.argv[sys.argv.index("--csv") + 1], {"device": "stand-in"})
exit_on_sigterm()
try:
    for i in range(2):
        rows.add({"i": i, "time_us": 1.5})
    print("measured", flush=True)
    time.sleep(120)
    rows.add({"i": 99})
finally:
    print(f"table of {len(rows)} rows", flush=True)
"""


def _fake_python(tmp_path, cases=""):
    """A stand-in python that echoes its arguments; writes a junit XML where pytest would; `cases`:
    extra `case "$*"` branches, tried first."""
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\nfor a; do case $a in --junitxml=*) '
                    f"echo '{JUNIT}' > \"${{a#--junitxml=}}\";; esac; done\n"
                    f'case "$*" in\n{cases}  *) echo "ran: $*";;\nesac\n')
    fake.chmod(0o755)
    return fake


def _run(tmp_path, deadline, cases=""):
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PY": str(_fake_python(tmp_path, cases)), "OUT": str(tmp_path),
                               "GPU_CHECK_DEADLINE": str(deadline)})


def _step_log(tmp_path, step):
    """One step's part of the combined log: after its "##### step" line, up to the next."""
    parts = (tmp_path / "gpu-check.log").read_text().split("##### step ")
    return next(part.split("\n", 1)[1] for part in parts if part.split("\n", 1)[0] == step)


def _summary(stdout):
    """The summary table's rows: {step: the rest of its line}."""
    table = stdout.split("=== summary\n", 1)[1].splitlines()[1:]
    return {line.split()[0]: line.split(None, 1)[1] for line in table if not line.startswith("===")}


def test_steps_are_cut_to_the_time_left(tmp_path):
    out = _run(tmp_path, int(time.time()) + 40)
    limits = [int(v) for v in re.findall(r"^=== .* \(limit (\d+) s\)$", out.stdout, re.M)]
    assert len(limits) == 11 and all(limit <= 28 for limit in limits), out.stdout  # 40 s - 12 s of margin
    assert out.returncode == 0 and "all steps passed" in out.stdout


def test_no_time_left_skips_every_step_and_fails(tmp_path):
    out = _run(tmp_path, int(time.time()) - 1)
    assert out.returncode == 1, out.stdout + out.stderr
    assert [line for line in out.stdout.splitlines() if line.startswith("ran: ")] == []  # not even the probe
    skipped = re.findall(r"^=== FAILED: (.*) \(skipped: no time left\)$", out.stdout, re.M)
    assert skipped[:3] == ["csrc_build", "info", "compile_sm90"] and len(skipped) == 11, out.stdout
    assert all(row.startswith("SKIPPED (no time)") for row in _summary(out.stdout).values())


def test_the_cuda_probe_is_cut_to_the_deadline(tmp_path):
    """A probe that never answers (a wedged driver) gets the time left, not its own 60 s."""
    out = _run(tmp_path, int(time.time()) + 18, cases='  *"-c import torch"*) sleep 60;;\n')
    assert out.returncode == 2, out.stdout + out.stderr
    limit = re.search(r"CUDA probe did not answer within its limit \((\d+) s\)", out.stderr)
    assert limit and int(limit.group(1)) <= 18, out.stderr  # the time left, not the probe's own 60 s


def test_each_step_logs_in_full_and_a_summary_table_ends_the_output(tmp_path):
    out = _run(tmp_path, int(time.time()) + 400, cases='  *bench_reduce*) echo "reduce output"; exit 3;;\n')
    assert out.returncode == 1, out.stdout + out.stderr
    assert "ran: csrc/build.py" in _step_log(tmp_path, "csrc_build")
    assert "reduce output" in _step_log(tmp_path, "bench_reduce") and "reduce" not in _step_log(tmp_path, "info")
    # the device tool brings back at most 8 files from $OUT: the script leaves 3 here (no rows: the
    # stand-in benchmarks write no CSV), beside the stand-in python itself
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-check.log", "gpu_compile.xml", "gpu_tests.xml",
                                                          "gpu_tests_one_gpu.xml", "python"]
    pytest_runs = [line for line in out.stdout.splitlines() if line.startswith("ran: -m pytest")]
    assert len(pytest_runs) == 3 and all(" -q -rfE " in line for line in pytest_runs), pytest_runs  # concise
    assert pytest_runs[0].endswith(f"--junitxml={tmp_path}/gpu_tests.xml")
    assert (tmp_path / "gpu_tests_one_gpu.xml").exists()
    summary = _summary(out.stdout)
    assert list(summary) == ["csrc_build", "info", "compile_sm90", "gpu_tests", "bench_fused_gemm", "gpu_tests_one_gpu",
                             "bench_reduce", "bench_chunked_gemm", "bench_flash_attn", "bench_one_gpu_ag_matmul",
                             "gpu_compile"]
    # this triton's sm_90 compile, outside the interpreter
    assert "ran: scripts/compile_kernels_sm90.py --quick" in _step_log(tmp_path, "compile_sm90")
    assert re.fullmatch(r"ok +\d+  4 passed, 2 failed, 1 errors, 3 skipped", summary["gpu_tests"])
    assert summary["bench_reduce"].startswith("FAILED (exit 3)") and summary["info"].startswith("ok")
    tail = out.stdout.rstrip().splitlines()
    assert tail[-1] == "=== gpu-check: 1 step(s) failed" and tail[-2].startswith("gpu_compile ")


def test_no_nvcc_skips_the_csrc_build_without_failing(tmp_path):
    out = _run(tmp_path, int(time.time()) + 400, cases="  *--find-nvcc*) exit 1;;\n")
    assert out.returncode == 0 and "=== csrc_build: skipped, nvcc not found" in out.stdout, out.stdout
    assert "ran: csrc/build.py" not in out.stdout
    assert _summary(out.stdout)["csrc_build"].split() == ["skipped", "(no", "nvcc)", "0"]


def test_a_benchmark_stopped_by_its_limit_keeps_its_rows(tmp_path):
    """The first benchmark hangs after two rows: its step's limit stops it, the rows are in the CSV
    and its (partial) table in the log, and the summary says it timed out."""
    bench = tmp_path / "hanging_bench.py"
    bench.write_text(HANGING_BENCH)
    out = _run(tmp_path, int(time.time()) + 20, cases=f'  *bench_fused_gemm*) exec {sys.executable} {bench} "$@";;\n')
    assert out.returncode == 1, out.stdout + out.stderr
    rows = list(csv.DictReader((tmp_path / "gpu-check.csv").open()))
    assert [(r["i"], r["device"]) for r in rows] == [("0", "stand-in"), ("1", "stand-in")]
    assert "table of 2 rows" in _step_log(tmp_path, "bench_fused_gemm")
    assert _summary(out.stdout)["bench_fused_gemm"].startswith("TIMEOUT")


def test_make_gpu_check_sets_a_deadline_under_8_minutes_builds_csrc_once_and_bounds_pip():
    start = time.time()
    out = subprocess.run(["make", "-n", "gpu-check", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    deadline = int(re.search(r"GPU_CHECK_DEADLINE=(\d+) bash scripts/gpu_check.sh", out.stdout).group(1))
    assert start - 1 <= deadline - 465 <= time.time() + 1  # fixed when make read the Makefile: 465 s < 8 min
    # csrc is built by scripts/gpu_check.sh only (within the deadline), not by make's setup as well
    assert "csrc/build.py" not in out.stdout and "step 150 csrc_build" in SCRIPT.read_text()
    pips = [line for line in out.stdout.splitlines() if "pip install" in line]
    assert pips and all(f"timeout $(( {deadline} - $(date +%s)" in line for line in pips), pips
    # pip runs only when an import fails: everything gpu-check needs is imported by that check, and
    # nothing in it needs matplotlib (the GPU image has none)
    deps = re.search(r'-c "(import [^"]*)"', next(line for line in out.stdout.splitlines() if "pytest_timeout" in line))
    assert set(deps.group(1)[len("import "):].split(", ")) == {"torch", "overlapkernels", "pytest", "pytest_timeout",
                                                                "triton", "pynvml"}


def test_pip_runs_with_the_time_left_and_never_unbounded(tmp_path):
    """`timeout 0` means no limit: past the deadline pip still gets 1 s, not forever."""
    out = subprocess.run(["make", "-n", "gpu-check", f"PYTHON={sys.executable}", "GPU_CHECK_DEADLINE=100"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    line = next(line for line in out.stdout.splitlines() if "pip install" in line)
    limit = re.search(r"timeout (\$\(\(.*?\)\)) ", line).group(1)
    assert subprocess.run(["bash", "-c", f"echo {limit}"], capture_output=True, text=True).stdout.strip() == "1"


def test_rowlog_appends_each_row_as_it_is_measured(tmp_path):
    from overlapkernels.bench.report import RowLog

    path = tmp_path / "rows.csv"
    rows = RowLog(path, {"gpu_name": "H200"})
    rows.add({"kernel": "torch.mm", "time_us": 1.0})
    assert [r["kernel"] for r in csv.DictReader(path.open())] == ["torch.mm"]
    rows.add({"kernel": "ag_gemm", "time_us": float("nan"), "error": "OutOfResources"})  # a new column
    got = list(csv.DictReader(path.open()))
    assert [(r["kernel"], r["error"], r["gpu_name"]) for r in got] == [("torch.mm", "", "H200"),
                                                                       ("ag_gemm", "OutOfResources", "H200")]
    assert len(rows) == 2 and rows[0] == {"kernel": "torch.mm", "time_us": 1.0, "gpu_name": "H200"}  # for the table
    RowLog(None).add({"kernel": "x"})  # no --csv: rows for the table only


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_benchmark_leaves_its_earlier_rows(tmp_path, sig):
    bench = tmp_path / "bench.py"
    bench.write_text(HANGING_BENCH)
    proc = subprocess.Popen([sys.executable, str(bench), "--csv", str(tmp_path / "rows.csv")], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "measured"
        proc.send_signal(sig)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert [r["i"] for r in csv.DictReader((tmp_path / "rows.csv").open())] == ["0", "1"]
    if sig == signal.SIGTERM:  # SystemExit: the finally still prints the rows so far
        assert proc.returncode == 128 + signal.SIGTERM and "table of 2 rows" in rest


def test_every_gpu_bench_script_writes_rows_as_measured():
    """Each script that writes its own CSV (not a `overlapkernels bench` wrapper) goes through RowLog,
    never a single append of all rows at the end."""
    scripts = [p for p in sorted((ROOT / "benchmarks").glob("bench_*.py")) if 'add_argument("--csv"' in p.read_text()]
    assert len(scripts) == 5, scripts
    for path in scripts:
        text = path.read_text()
        assert "RowLog(args.csv" in text and "exit_on_sigterm()" in text and "append_csv" not in text, path.name


def test_pytest_stopped_by_sigterm_still_writes_its_summary_and_xml(tmp_path):
    """conftest.py turns a time limit's SIGTERM into KeyboardInterrupt: the step's log still ends with
    pytest's summary and its XML counts the tests that ran (a plain SIGTERM left neither)."""
    (tmp_path / "test_stand_in.py").write_text("import time\n\ndef test_passes():\n    pass\n\n"
                                               "def test_sleeps():\n    print('sleeping', flush=True)\n"
                                               "    time.sleep(120)\n")
    xml = tmp_path / "step.xml"
    # -p conftest: this suite's conftest.py as a plugin, for a test file outside tests/
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-p", "conftest",
                             f"--junitxml={xml}", str(tmp_path / "test_stand_in.py")], cwd=tmp_path,
                            stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": f"{ROOT / 'tests'}{os.pathsep}{ROOT}"})
    try:
        for line in proc.stdout:
            if "sleeping" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=60)[0]
    finally:
        proc.kill()
    assert proc.returncode == 2 and "KeyboardInterrupt" in rest and "1 passed" in rest, rest  # 2: interrupted
    assert re.search(r'<testsuite [^>]*tests="1"', xml.read_text())
