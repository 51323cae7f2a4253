"""benchmarks/bench_chunked_gemm.py on CPU: the chunked runners compute the one GEMM's result (a
chunk written to the wrong rows would time the wrong work), and a tiny run writes its rows."""
import csv
import importlib.util
import math
from pathlib import Path

import pytest
import torch

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_chunked_gemm.py"
_spec = importlib.util.spec_from_file_location("bench_chunked_gemm", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_chunk_gemms_fill_the_same_output_as_one_gemm():
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(12, 5, generator=gen, dtype=torch.float64), torch.randn(5, 7, generator=gen, dtype=torch.float64)
    out, one, chunked, two_streams = bench.chunked_runners(a, b, world=3)
    assert two_streams is None  # CPU: one stream only
    for runner in (one, chunked):
        out.fill_(float("nan"))
        runner()
        torch.testing.assert_close(out, a @ b, rtol=1e-12, atol=1e-12)


def test_a_tiny_cpu_run_writes_one_row_per_world_and_size(tmp_path, capsys):
    path = tmp_path / "chunked.csv"
    assert bench.main(["--device", "cpu", "--dtype", "float32", "--worlds", "2,3", "--rows", "4",
                       "--shapes", "8B qkv", "--iters", "1", "--csv", str(path)]) == 0
    rows = list(csv.DictReader(path.open()))
    assert [(r["world"], r["rows_per_rank"]) for r in rows] == [("2", "4"), ("3", "4")]
    assert all(float(r["chunk_cost"]) > 0 and math.isnan(float(r["chunk_cost_2streams"])) for r in rows)
    assert "chunk_cost 1.0 = chunking is free" in capsys.readouterr().out


def test_counts_below_one_are_usage_errors(capsys):
    """--iters 0 asked statistics of no calls (a StatisticsError traceback after the setup); the GPU
    scripts' sizes and counts go through the same argparse type."""
    from overlapkernels.bench.report import positive_int

    with pytest.raises(SystemExit) as exited:
        bench.main(["--device", "cpu", "--iters", "0"])
    assert exited.value.code == 2 and "--iters: '0': expected an integer >= 1" in capsys.readouterr().err
    assert positive_int("3") == 3
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(Exception, match=f"{bad!r}: expected an integer >= 1"):
            positive_int(bad)
