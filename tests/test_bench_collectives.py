"""Collectives benchmark: the busbw formulas, size parsing, CSV rows, a smoke run (no timing asserts)."""
import csv
import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from overlapkernels.bench import metrics, timing
from overlapkernels.bench.collectives import CollectivesConfig, config_dict, rank_main
from overlapkernels.bench.report import append_csv, format_table


@pytest.mark.parametrize("op, n, factor", [
    ("all_gather", 2, 0.5), ("all_gather", 8, 0.875), ("reduce_scatter", 4, 0.75), ("all_to_all", 8, 0.875),
    ("all_reduce", 2, 1.0), ("all_reduce", 4, 1.5), ("all_reduce", 8, 1.75), ("all_gather", 1, 0.0),
])
def test_busbw_is_nccl_tests_definition(op, n, factor):
    # 4 GB in 2 s: algbw 2 GB/s (10^9 bytes), busbw = algbw * factor
    assert metrics.algbw_gbps(4_000_000_000, 2.0) == 2.0
    assert metrics.busbw_gbps(op, 4_000_000_000, 2.0, n) == pytest.approx(2.0 * factor, rel=1e-15)


def test_busbw_rejects_unknown_op_and_world():
    with pytest.raises(ValueError, match="op='broadcast'"):
        metrics.busbw_gbps("broadcast", 1, 1.0, 2)
    with pytest.raises(ValueError, match="world_size=0"):
        metrics.busbw_gbps("all_gather", 1, 1.0, 0)


def test_sizes():
    assert metrics.parse_size("64M") == 64 << 20 and metrics.parse_size("1k") == 1024
    assert metrics.parse_size("512") == 512 and metrics.parse_size("2GB") == 2 << 30
    assert metrics.parse_size_range("1K:8K") == [1024, 2048, 4096, 8192]
    assert metrics.parse_size_range("1K:5K") == [1024, 2048, 4096]
    assert metrics.parse_size_range("4M") == [4 << 20]
    for bad in ("1X", "", "-4", "8K:1K"):
        with pytest.raises(ValueError, match="size"):
            metrics.parse_size_range(bad)


def test_overlap_efficiency_is_flux_definition():
    assert metrics.overlap_efficiency(t_method=1.0, t_baseline=1.5, t_gemm=1.0) == 1.0  # comm fully hidden
    assert metrics.overlap_efficiency(t_method=1.5, t_baseline=1.5, t_gemm=1.0) == 0.0  # no overlap
    assert metrics.overlap_efficiency(t_method=1.25, t_baseline=1.5, t_gemm=1.0) == 0.5
    assert metrics.overlap_efficiency(t_method=2.0, t_baseline=1.5, t_gemm=1.0) == -1.0  # slower than baseline
    # a baseline faster than the GEMM alone (noise, a cold GEMM): no exposed comm to hide, no figure
    assert math.isnan(metrics.overlap_efficiency(t_method=1.0, t_baseline=0.8, t_gemm=1.0))


def test_summary_is_median_min_max():
    assert metrics.summarize([1.0, 2.0, 10.0]) == {"median_s": 2.0, "min_s": 1.0, "max_s": 10.0}  # not the mean
    # an even count (--iters 4): the mean of the middle two, of the sorted times, not either one alone
    assert metrics.summarize([4.0, 1.0, 3.0, 2.0]) == {"median_s": 2.5, "min_s": 1.0, "max_s": 4.0}


def test_table_and_csv(tmp_path):
    rows = [{"op": "all_gather", "bytes": 1024, "t": 1.23456}, {"op": "all_reduce", "bytes": 2048, "t": 10.5}]
    table = format_table(rows, [("op", "op", ""), ("bytes", "size(B)", "d"), ("t", "time(us)", ".1f")])
    assert table.splitlines() == ["        op  size(B)  time(us)", "all_gather     1024       1.2",
                                  "all_reduce     2048      10.5"]
    path = tmp_path / "out.csv"
    append_csv(path, rows[:1])
    append_csv(path, rows[1:])
    with path.open() as f:
        read = list(csv.DictReader(f))
    assert [r["op"] for r in read] == ["all_gather", "all_reduce"] and read[1]["bytes"] == "2048"


def test_run_collectives_on_gloo_ranks(rank_pool):
    config = CollectivesConfig(sizes=(1000, 4096), iters=2, warmup=1)
    per_rank = rank_pool(4).run(rank_main, config_dict(config))
    rows = per_rank[0]
    assert [(r["op"], r["bytes"]) for r in rows] == [(op, b) for op in config.ops for b in (992, 4096)]
    for row in rows:
        assert row["count"] % 4 == 0 and row["world_size"] == 4 and row["backend"] == "gloo"
        assert 0 < row["min_us"] <= row["time_us"] <= row["max_us"]
        assert row["busbw_gbps"] == pytest.approx(metrics.busbw_gbps(row["op"], row["bytes"], row["time_us"] / 1e6, 4))
        assert row["algbw_gbps"] == pytest.approx(metrics.algbw_gbps(row["bytes"], row["time_us"] / 1e6))
    # every rank reports the slowest rank's figures
    assert all([r["time_us"] for r in rows] == [r["time_us"] for r in other] for other in per_rank)


def test_bad_config_is_rejected_before_spawning():
    with pytest.raises(ValueError, match=r"ops=\['all_gather', 'scatter'\]"):
        CollectivesConfig(ops=("all_gather", "scatter")).validate()
    out = subprocess.run([sys.executable, "-m", "overlapkernels", "bench", "collectives", "--ops", "bcast"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "overlapkernels: error: ops=['bcast']" in out.stderr


def test_cli_spawns_ranks_and_appends_csv(tmp_path):
    """And the same rows to --json, and a plot to --plot (where matplotlib is installed)."""
    path, json_path, plots = tmp_path / "rows.csv", tmp_path / "rows.json", tmp_path / "plots"
    out = subprocess.run([sys.executable, "-m", "overlapkernels", "bench", "collectives", "--nproc", "2",
                          "--sizes", "1K:2K", "--iters", "1", "--warmup", "0", "--ops", "all_gather,all_reduce",
                          "--csv", str(path), "--json", str(json_path), "--plot", str(plots)],
                         capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr
    assert f"# appended 4 rows to {json_path}" in out.stdout
    assert [(r["op"], r["bytes"]) for r in json.loads(json_path.read_text())] == [
        ("all_gather", 1024), ("all_gather", 2048), ("all_reduce", 1024), ("all_reduce", 2048)]
    if importlib.util.find_spec("matplotlib"):
        assert f"# plot: {plots / 'collectives.png'}" in out.stdout and (plots / "collectives.png").stat().st_size
    else:
        assert "# plot: matplotlib not installed" in out.stdout
    assert "busbw(GB/s)" in out.stdout and "2 ranks, backend gloo, cpu" in out.stdout
    with path.open() as f:
        rows = list(csv.DictReader(f))
    assert [(r["op"], r["bytes"]) for r in rows] == [("all_gather", "1024"), ("all_gather", "2048"),
                                                      ("all_reduce", "1024"), ("all_reduce", "2048")]
    assert all(r["device"].startswith("cpu") and r["gpu_name"] == "" and r["torch"] and r["commit"] for r in rows)
    assert all(r["bench"] == "collectives" and float(r["min_us"]) <= float(r["time_us"]) <= float(r["max_us"])
               for r in rows)
    assert all(r["sm_clock_mhz"] == r["power_w"] == r["nvlink_tx_gbps"] == "" for r in rows)  # no NVML: empty cells


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def test_commit_only_from_a_repository_that_tracks_the_package(tmp_path, monkeypatch):
    """An installed copy inside some other repository must not report that repository's commit;
    local edits show as -dirty."""
    from overlapkernels.bench.report import git_commit

    monkeypatch.delenv("OVERLAPKERNELS_COMMIT", raising=False)
    pkg = tmp_path / "repo" / "overlapkernels"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    assert git_commit(pkg) == "unknown"  # no repository at all
    monkeypatch.setenv("OVERLAPKERNELS_COMMIT", "abc123def456")  # a copy without .git, told its commit
    assert git_commit(pkg) == "abc123def456"
    monkeypatch.delenv("OVERLAPKERNELS_COMMIT")
    _git(tmp_path / "repo", "init", "-q")
    (tmp_path / "repo" / "other.txt").write_text("x")
    _git(tmp_path / "repo", "add", "other.txt")
    _git(tmp_path / "repo", "commit", "-q", "-m", "other")
    assert git_commit(pkg) == "unknown"  # a repository, but the package is not in it
    _git(tmp_path / "repo", "add", "overlapkernels/__init__.py")
    _git(tmp_path / "repo", "commit", "-q", "-m", "package")
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=pkg, capture_output=True, text=True)
    assert git_commit(pkg) == head.stdout.strip()
    (pkg / "__init__.py").write_text("x = 1\n")
    assert git_commit(pkg) == head.stdout.strip() + "-dirty"


def test_row_times_are_the_summary_in_microseconds():
    stats = metrics.summarize([0.002, 0.001, 0.003])
    assert timing.row_times(stats) == pytest.approx({"time_us": 2000.0, "min_us": 1000.0, "max_us": 3000.0})


def test_sizes_must_be_positive_integers():
    from overlapkernels.bench.timing import check_sizes

    check_sizes(seq=1, heads=8)
    for bad in (0, -2, 1.5, True, "8"):
        with pytest.raises(ValueError, match=rf"^seq={bad!r}: expected an integer >= 1$"):
            check_sizes(seq=bad)


def test_jsonl_rows_and_env_schema(tmp_path):
    import json as _json
    import math

    from overlapkernels.bench.report import append_jsonl, environment

    env = environment("cpu")
    assert set(env) == {"device", "gpu_name", "driver", "nvlink", "torch", "triton", "version", "commit", "date",
                        "settings"}
    assert env["device"].startswith("cpu") and env["gpu_name"] == env["nvlink"] == ""  # CPU rows say CPU
    path = tmp_path / "rows.jsonl"
    append_jsonl(path, [{"op": "x", "efficiency": math.nan}, {"op": "y", "efficiency": 0.5}])
    rows = [_json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"op": "x", "efficiency": None}, {"op": "y", "efficiency": 0.5}]


def test_json_rows_are_one_array_that_later_runs_extend(tmp_path):
    """--json FILE: json.load reads every run's rows (NaN and infinities as null); a .jsonl name gets JSON Lines."""
    import json as _json
    import math

    from overlapkernels.bench.report import append_json

    path = tmp_path / "out" / "rows.json"
    append_json(path, [{"op": "x", "efficiency": math.nan, "speedup": math.inf}])
    append_json(path, [{"op": "y", "efficiency": 0.5}, {"op": "z", "efficiency": 1.0}])
    assert _json.loads(path.read_text()) == [{"op": "x", "efficiency": None, "speedup": None},
                                             {"op": "y", "efficiency": 0.5},
                                             {"op": "z", "efficiency": 1.0}]
    assert sorted(p.name for p in path.parent.iterdir()) == ["rows.json"]  # no partial file left
    lines = tmp_path / "rows.jsonl"
    append_json(lines, [{"op": "x"}])
    append_json(lines, [{"op": "y"}])
    assert [_json.loads(line) for line in lines.read_text().splitlines()] == [{"op": "x"}, {"op": "y"}]
    path.write_text("[1, 2")  # a torn file: refused by name, not overwritten
    with pytest.raises(ValueError, match=r"rows.json: holds no JSON array of rows"):
        append_json(path, [{"op": "w"}])


def test_csv_shared_by_benchmarks_with_other_columns(tmp_path):
    """`bench all` and `make gpu-check` append several benchmarks' rows to one file: a row with new
    columns rewrites the file under the union, and every value stays under its own header."""
    path = tmp_path / "all.csv"
    append_csv(path, [{"kind": "gemm", "time_us": 5.0, "gpu": "H200"}])
    append_csv(path, [{"kind": "reduce", "gbps": 3000.0, "gpu": "H200"}])
    append_csv(path, [{"gpu": "H200", "kind": "flash"}])  # a subset of the columns: appended as is
    with path.open() as f:
        reader = csv.DictReader(f)
        read = list(reader)
    assert reader.fieldnames == ["kind", "time_us", "gpu", "gbps"]
    assert read == [{"kind": "gemm", "time_us": "5.0", "gpu": "H200", "gbps": ""},
                    {"kind": "reduce", "time_us": "", "gpu": "H200", "gbps": "3000.0"},
                    {"kind": "flash", "time_us": "", "gpu": "H200", "gbps": ""}]


def test_csv_with_cells_past_its_header_is_still_extended(tmp_path):
    """A file an older version wrote with rows longer than the header: extending it must not crash
    (the stray cells are dropped) and no temporary file is left behind."""
    path = tmp_path / "old.csv"
    path.write_text("kind,time_us\ngemm,5.0,extra\n")
    append_csv(path, [{"kind": "reduce", "gbps": 1.0}])
    with path.open() as f:
        read = list(csv.DictReader(f))
    assert read == [{"kind": "gemm", "time_us": "5.0", "gbps": ""}, {"kind": "reduce", "time_us": "", "gbps": "1.0"}]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.csv"]


def _slowest_on_rank():
    from overlapkernels.bench.timing import slowest_rank

    r = dist.get_rank()
    return slowest_rank({"median_s": 1.0 + r, "min_s": 3.0 - r, "max_s": 2.0 + 2 * r}, torch.device("cpu"))


def test_a_row_reports_the_slowest_rank_per_statistic(rank_pool):
    """A collective is done when its last rank is: each statistic is the maximum over ranks."""
    assert rank_pool(2).run(_slowest_on_rank) == [{"median_s": 2.0, "min_s": 3.0, "max_s": 4.0}] * 2


def test_under_a_launcher_the_cli_ends_the_group_it_made(tmp_path):
    """Under torchrun the CLI makes the default group: it destroys it when the command has run (NCCL
    warns when a process exits with it alive, and live communicators can leave a peer waiting); a
    group the caller made is left alone."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = ("import torch.distributed as dist\n"
              "from overlapkernels import cli\n"
              "argv = ['bench', 'collectives', '--sizes', '1K', '--iters', '1', '--warmup', '0', '--ops', 'all_reduce']\n"
              "print(cli.main(argv), dist.is_initialized())\n"
              # `bench all` runs its kinds through nested main() calls: the group lives until the end
              "kinds = []\n"
              "def all_kinds(args):\n"
              "    for _ in range(2):\n"
              "        kinds.append((cli.main(argv), dist.is_initialized()))\n"
              "    return 0\n"
              "cli._bench_all = all_kinds\n"
              "print(cli.main(['bench', 'all']), dist.is_initialized(), kinds)\n"
              "dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)\n"
              "print(cli.main(argv), dist.is_initialized())\n")
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port)}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    assert [line for line in out.stdout.splitlines() if line.startswith("0 ")] == [
        "0 False", "0 False [(0, True), (0, True)]", "0 True"], out.stdout
