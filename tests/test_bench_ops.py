"""ag-matmul / matmul-rs benchmark: shape presets, validation, a smoke run on CPU (no timing asserts)."""
import math
import subprocess
import sys

import pytest

from overlapkernels.bench import tp_ops


def test_llama_presets_and_parsing():
    shapes = tp_ops.layer_shapes("llama3-8b")
    assert shapes == {"qkv": (8192, 4096, 6144), "fc1": (8192, 4096, 28672), "attn_out": (8192, 4096, 4096),
                      "fc2": (8192, 14336, 4096)}
    assert tp_ops.layer_shapes("llama3-8b", 8)["fc2"] == (1024, 1792, 512)
    assert tp_ops.parse_shapes("llama3-70b", "matmul-rs", 1) == [("llama3-70b/attn_out", (8192, 8192, 8192)),
                                                                  ("llama3-70b/fc2", (8192, 28672, 8192))]
    assert tp_ops.parse_shapes("64x32x16", "ag-matmul", 8) == [("64x32x16", (64, 32, 16))]
    with pytest.raises(ValueError, match="shape 'huge': expected a model"):
        tp_ops.parse_shapes("huge", "ag-matmul", 1)


def test_validation_names_the_problem():
    with pytest.raises(ValueError, match="M and N must be divisible by the world size 4"):
        tp_ops.TpOpsConfig(op="ag-matmul", shapes=(("s", (6, 8, 8)),)).validate(4)
    with pytest.raises(ValueError, match="M and K must be divisible"):
        tp_ops.TpOpsConfig(op="matmul-rs", shapes=(("s", (8, 6, 8)),)).validate(4)
    with pytest.raises(ValueError, match="methods=\\['cutlass'\\]"):
        tp_ops.TpOpsConfig(methods=("cutlass",)).validate()


@pytest.mark.parametrize("op", ["ag-matmul", "matmul-rs"])
def test_smoke_run_on_gloo_ranks(rank_pool, op):
    config = tp_ops.TpOpsConfig(op=op, shapes=(("tiny", (16, 8, 12)),), methods=("baseline", "decomposed", "auto"),
                                iters=2, warmup=1)
    rows = rank_pool(2).run(tp_ops.rank_main, tp_ops.config_dict(config))[0]
    assert [r["method"] for r in rows] == ["baseline", "decomposed", "auto"]
    for row in rows:
        assert row["time_us"] > 0 and row["gemm_us"] > 0 and row["tflops"] > 0 and row["world_size"] == 2
    base = rows[0]
    assert base["speedup"] == 1.0
    assert base["efficiency"] == 0.0 or math.isnan(base["efficiency"])  # NaN when the GEMM alone was not faster


def test_cli_rejects_bad_shape_before_spawning():
    out = subprocess.run([sys.executable, "-m", "overlapkernels", "bench", "ag-matmul", "--nproc", "3",
                          "--shapes", "16x8x12"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be divisible by the world size 3" in out.stderr


def test_ring_attention_bench_smoke(rank_pool):
    from overlapkernels.bench import ring_attention as rb

    cfg = rb.RingConfig(seq=16, heads=2, kv_heads=1, head_dim=4, iters=1, warmup=0, layouts=("zigzag",),
                        causal=(True,))
    rows = rank_pool(2).run(rb.rank_main, rb.config_dict(cfg))[0]
    assert len(rows) == 1 and rows[0]["layout"] == "zigzag" and rows[0]["world_size"] == 2
    assert all(rows[0][k] > 0 for k in ("fwd_allgather_us", "fwd_ring_us", "compute_us", "fwd_bwd_ring_us"))
    with pytest.raises(ValueError, match="seq=10 must be divisible by 2 x the world size 4"):
        rb.RingConfig(seq=10).validate(4)


def test_layers_bench_smoke(rank_pool):
    from overlapkernels.bench import layers as lb

    cfg = lb.LayersConfig(seq=8, hidden=16, heads=4, kv_heads=2, ffn_hidden=32, iters=1, warmup=0)
    rows = rank_pool(2).run(lb.rank_main, lb.config_dict(cfg))[0]
    assert [r["method"] for r in rows] == ["baseline", "decomposed", "auto"]
    assert rows[0]["ran"] == "all_gather_matmul: baseline x4, matmul_reduce_scatter: baseline x4"
    assert rows[1]["ran"] == "all_gather_matmul: decomposed x4, matmul_reduce_scatter: decomposed x4"
    assert all(r["time_us"] > 0 for r in rows)


def test_fsdp_bench_smoke_and_comm_volume(rank_pool):
    from overlapkernels.bench import fsdp as fb

    cfg = fb.FsdpConfig(layers=3, width=8, batch=4, prefetches=(0, 1), iters=1, warmup=0)
    rows = rank_pool(2).run(fb.rank_main, fb.config_dict(cfg))[0]
    assert [(r["stage"], r["prefetch"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (3, 1)]
    for row in rows:  # bytes per step are exactly ZeRO's 2 Psi / 3 Psi
        assert row["comm_psi"] == pytest.approx(row["theory_psi"])
        assert row["time_us"] > 0


def test_pipeline_bench_smoke(rank_pool):
    from overlapkernels.bench import pipeline as pb

    cfg = pb.PipelineBenchConfig(microbatches=2, width=4, layers_per_stage=2, batch=4, iters=1)
    rows = rank_pool(2).run(pb.rank_main, pb.config_dict(cfg))[0]
    assert [r["kind"] for r in rows] == ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
    assert all(r["step_us"] > 0 and r["sim_us"] > 0 for r in rows)


def test_demo_smoke(rank_pool):
    from overlapkernels import demo

    cfg = demo.DemoConfig(steps=2, reference_steps=2, batch=4, seq=8, vocab=16, hidden=16, layers=2)
    rows = rank_pool(4).run(demo.rank_main, demo.config_dict(cfg))[0]
    assert [r["step"] for r in rows] == [0, 1]
    for row in rows:  # the 4-D run and the single-process reference agree (fp32)
        assert row["loss"] == pytest.approx(row["reference"], rel=1e-5)
    assert "1-proc ref" in demo.format_rows(rows, cfg)


@pytest.mark.parametrize("kind", ["collectives", "ag-matmul", "matmul-rs", "ring-attention", "layers", "fsdp",
                                  "pipeline"])
def test_plots_for_every_kind(tmp_path, kind):
    pytest.importorskip("matplotlib")
    from overlapkernels.bench.plot import CHARTS, plot_rows

    keys = {k for _, charts in [CHARTS[kind]] for c in charts for k in c[1:4]}
    rows = [{k: (i + 1.0 if k not in ("layer", "method", "op", "layout", "kind") else f"v{i % 2}") for k in keys}
            | {"world_size": 2, "device": "cpu"} for i in range(4)]
    path = tmp_path / f"{kind}.png"
    assert plot_rows(kind, rows, str(path)) and path.stat().st_size > 1000


def test_bench_all_runs_every_kind(monkeypatch):
    from overlapkernels import cli

    calls = []
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(argv) or 0)
    args = cli.build_parser().parse_args(["bench", "all", "--nproc", "2", "--csv", "out.csv"])
    assert cli._bench_all(args) == 0
    assert [c[1] for c in calls] == list(cli.ALL_KINDS)
    assert all(c[:2] == ["bench", c[1]] and "--csv" in c and "--nproc" in c for c in calls)
