"""benchmarks/bench_flash_attn.py's packed-documents rows on CPU (the kernels in the interpreter, one
call per timing): the code a GPU lease runs last in its flash step, checked before a lease spends
time on it. Its result is checked against the kernels on each document apart, then each row pairs
our time with SDPA's (each document apart; the row with the dense mask)."""
import importlib.util
from pathlib import Path

import torch

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_flash_attn.py"
_spec = importlib.util.spec_from_file_location("bench_flash_attn", _PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


class _Rows(list):
    def add(self, row):
        self.append(row)


def test_packed_documents_rows(monkeypatch):
    calls = []

    def one_call(fn):  # the k-th timing "takes" k ms: each row must pair the right two
        calls.append(fn())
        return len(calls) * 1e-3

    monkeypatch.setattr(bench, "gpu_median_s", one_call)
    rows = _Rows()
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, 64, 16, generator=g) for _ in range(4))
    bench.packed_documents(rows, q, k, v, do, 0.25, 4)
    assert len(calls) == 6  # SDPA apart and masked, forward and backward; ours forward and backward
    assert [(r["pass"], r["config"]) for r in rows] == [
        ("forward", "4 documents of 16 (segment ids; SDPA: each apart)"),
        ("backward", "4 documents of 16 (segment ids; SDPA: each apart)"),
        ("forward", "4 documents of 16 (segment ids; SDPA: dense mask)"),
        ("backward", "4 documents of 16 (segment ids; SDPA: dense mask)")]
    # timed in order: SDPA apart forward, backward; SDPA masked forward, backward; ours forward, backward
    assert [(r["ours_us"], r["sdpa_us"]) for r in rows] == [(5000, 1000), (6000, 2000), (5000, 3000), (6000, 4000)]
    flops = 4 * 2 * 16 * 16 * 16 / 2 * 4  # attention within the documents only
    assert rows[0]["ours_tflops"] == flops / 5e-3 / 1e12 and rows[1]["ours_tflops"] == 2.5 * flops / 6e-3 / 1e12
    assert rows[2]["vs_sdpa"] == 3 / 5
    # a sequence the documents do not divide: no rows, nothing run
    rows.clear()
    bench.packed_documents(rows, q[:, :, :63], k[:, :, :63], v[:, :, :63], do[:, :, :63], 0.25, 4)
    assert rows == []
