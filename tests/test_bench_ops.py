"""ag-matmul / matmul-rs benchmark: shape presets, validation, a smoke run on CPU (no timing asserts);
the other kinds' smoke runs (ring attention, layers, fsdp, pipeline), plots for every kind, TFLOP/s
and the GPU median. The `bench` command line (`bench all`, defaults, bad arguments): test_bench_cli.py."""
import math

import pytest
import torch
import torch.distributed as dist

from overlapkernels.bench import tp_ops
from overlapkernels.bench.timing import time_calls
from overlapkernels.profiling.telemetry import COLUMNS as TELEMETRY


def _spread_and_telemetry(rows, time_key="time_us"):
    """Every row: median between min and max, and the NVML columns, None on CPU (JSON null, an empty
    CSV cell; they were "", a string where GPU rows have numbers)."""
    for row in rows:
        assert 0 < row["min_us"] <= row[time_key] <= row["max_us"], row
        assert all(row[c] is None for c in TELEMETRY), row


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
    _spread_and_telemetry(rows)
    base = rows[0]
    assert base["speedup"] == 1.0
    assert base["efficiency"] == 0.0 or math.isnan(base["efficiency"])  # NaN when the GEMM alone was not faster


def test_methods_without_peer_memory_are_skipped_not_fatal(rank_pool):
    """symm/fused need peer memory (CUDA, one node): on gloo CPU ranks they are skipped with the
    reason, and the other methods still run."""
    config = tp_ops.TpOpsConfig(op="ag-matmul", shapes=(("tiny", (8, 4, 4)),), methods=("symm", "decomposed", "fused"),
                                iters=1, warmup=0)
    rows = rank_pool(2).run(tp_ops.rank_main, tp_ops.config_dict(config))[0]
    assert [r["method"] for r in rows] == ["decomposed"]


def _float64_with_peer_memory_on_rank():
    from overlapkernels.comm import process_world as pw

    own = pw.peer_memory_unavailable_reason
    pw.peer_memory_unavailable_reason = lambda device: None  # as on an NVLink node: symm/fused could run
    try:
        config = tp_ops.TpOpsConfig(op="ag-matmul", shapes=(("tiny", (8, 4, 4)),), methods=("decomposed", "fused"),
                                    dtype="float64", iters=1, warmup=0)
        return [r["method"] for r in tp_ops.rank_main(tp_ops.config_dict(config))]
    finally:
        pw.peer_memory_unavailable_reason = own


def test_fused_is_skipped_for_a_dtype_its_gemm_does_not_take(rank_pool):
    """--dtype float64 where peer memory exists: fused (16/32-bit Triton GEMM) is skipped with the
    reason; before, it was kept, and every rank raised after the other methods were timed."""
    assert rank_pool(2).run(_float64_with_peer_memory_on_rank) == [["decomposed"]] * 2


def _peer_methods_on_cuda_ranks_without_peer_memory(locally_able_rank, bad_setting=False):
    """As on a CUDA group spanning two hosts: each rank's own checks pass (on rank ``locally_able_rank``
    only, else all), the ranks' agreement says no peer memory; asked once on every rank alike."""
    import io
    from contextlib import redirect_stdout

    from overlapkernels.bench import timing
    from overlapkernels.comm import process_world as pw
    from overlapkernels.ops import _methods

    asked = []
    own, agreed = _methods.unavailable_reason, pw.group_has_peer_memory
    ok_here = locally_able_rank is None or dist.get_rank() == locally_able_rank
    _methods.unavailable_reason = lambda method, group, device, dtype=None: (
        None if ok_here or method not in ("symm", "fused") else "no IPC library here")
    def agreement(group, device):
        asked.append(device)
        if bad_setting:
            raise ValueError("rank 1: OVERLAPKERNELS_RESERVED_SMS='lots': expected a whole number of SMs >= 1")
        return False

    pw.group_has_peer_memory = agreement
    try:
        with redirect_stdout(io.StringIO()) as out:
            kept = timing.available_methods(["baseline", "symm", "decomposed", "fused"], dist.group.WORLD,
                                            torch.device("cuda", 0), "ag-matmul")
    finally:
        _methods.unavailable_reason, pw.group_has_peer_memory = own, agreed
    return kept, len(asked), out.getvalue()


@pytest.mark.parametrize("locally_able_rank, bad_setting", [(None, False), (1, False), (None, True)])
def test_peer_methods_are_skipped_where_the_ranks_have_no_peer_memory_together(rank_pool, locally_able_rank,
                                                                               bad_setting):
    """Each rank's own checks cannot see that the group spans hosts: symm/fused then failed inside the
    kind (ending `bench all`). Now the ranks' agreement skips them, asked exactly once on every rank
    (a collective), whatever each rank's own answer was; a bad setting it reports is a skip too."""
    results = rank_pool(2).run(_peer_methods_on_cuda_ranks_without_peer_memory, locally_able_rank, bad_setting)
    for kept, asked, _ in results:
        assert kept == ["baseline", "decomposed"] and asked == 1
    said = results[0][2]
    why = ("no IPC library here" if locally_able_rank is not None else
           "rank 1: OVERLAPKERNELS_RESERVED_SMS='lots'" if bad_setting else "the group has no peer memory")
    assert f"# ag-matmul: skipped method='symm': {why}" in said and "skipped method='fused'" in said


def test_ring_attention_bench_smoke(rank_pool):
    from overlapkernels.bench import ring_attention as rb

    cfg = rb.RingConfig(seq=16, heads=2, kv_heads=1, head_dim=4, iters=1, warmup=0, layouts=("zigzag",),
                        causal=(True,))
    rows = rank_pool(2).run(rb.rank_main, rb.config_dict(cfg))[0]
    assert len(rows) == 1 and rows[0]["layout"] == "zigzag" and rows[0]["world_size"] == 2
    assert rows[0]["kernels"] == "torch"  # ok.ring_attention's default backend here (CPU)
    assert all(rows[0][k] > 0 for k in ("fwd_allgather_us", "fwd_ring_us", "compute_us", "fwd_bwd_ring_us",
                                        "fwd_ulysses_us", "fwd_bwd_ulysses_us"))
    _spread_and_telemetry(rows, "fwd_ring_us")
    with pytest.raises(ValueError, match="seq=10 must be divisible by 2 x the world size 4"):
        rb.RingConfig(seq=10).validate(4)
    # packed documents: every timed call masks by segment ids; flops count attention within documents
    docs = rb.RingConfig(seq=16, heads=2, kv_heads=1, head_dim=4, iters=1, warmup=0, layouts=("zigzag",),
                         causal=(False,), documents=3)
    rows = rank_pool(2).run(rb.rank_main, rb.config_dict(docs))[0]
    assert rows[0]["documents"] == 3 and rows[0]["fwd_ring_us"] > 0 and rows[0]["fwd_ulysses_us"] > 0
    # 3 heads do not split over 2 ranks: no ulysses timing, on every rank alike (NaN, not a hang)
    odd = rb.RingConfig(seq=8, heads=3, kv_heads=1, head_dim=4, iters=1, warmup=0, layouts=("contiguous",),
                        causal=(False,))
    rows = rank_pool(2).run(rb.rank_main, rb.config_dict(odd))[0]
    assert math.isnan(rows[0]["fwd_ulysses_us"]) and math.isnan(rows[0]["fwd_bwd_ulysses_us"])
    assert rb._document_ids(docs)[0].tolist() == [0] * 6 + [1] * 5 + [2] * 5  # lengths 6, 5, 5
    assert rb._flops(docs, 2, False) == 4 * 2 * 4 * (36 + 25 + 25) / 2
    for bad in (-1, 17, 1.5, True):
        with pytest.raises(ValueError, match=f"documents={bad!r}: expected a whole number from 0 to seq=16"):
            rb.RingConfig(seq=16, documents=bad).validate(2)
    # the compute-only timing attends with each rank's ids in turn: shard_sequence's parts
    assert rank_pool(2).run(_rank_ids_are_shards_on_rank) == [True, True]


def _rank_ids_are_shards_on_rank():
    import overlapkernels as ok
    from overlapkernels.bench import ring_attention as rb

    ids = rb._document_ids(rb.RingConfig(seq=16, documents=5))
    return all(torch.equal(rb._rank_ids(ids, layout, 2, r), ok.shard_sequence(ids, dim=1, layout=layout))
               for layout in ("zigzag", "contiguous") for r in [dist.get_rank()])


def test_layers_bench_smoke(rank_pool):
    from overlapkernels.bench import layers as lb

    cfg = lb.LayersConfig(seq=8, hidden=16, heads=4, kv_heads=2, ffn_hidden=32, iters=1, warmup=0)
    rows = rank_pool(2).run(lb.rank_main, lb.config_dict(cfg))[0]
    assert [r["method"] for r in rows] == ["baseline", "decomposed", "auto"]
    assert rows[0]["ran"] == "all_gather_matmul: baseline x4, matmul_reduce_scatter: baseline x4"
    assert rows[1]["ran"] == "all_gather_matmul: decomposed x4, matmul_reduce_scatter: decomposed x4"
    _spread_and_telemetry(rows)


def test_fsdp_bench_smoke_and_comm_volume(rank_pool):
    from overlapkernels.bench import fsdp as fb

    cfg = fb.FsdpConfig(layers=3, width=8, batch=4, prefetches=(0, 1), iters=1, warmup=0)
    rows = rank_pool(2).run(fb.rank_main, fb.config_dict(cfg))[0]
    ours, peers = rows[:4], rows[4:]
    assert [(r["impl"], r["stage"], r["prefetch"]) for r in ours] == [("overlapkernels", 1, 0), ("overlapkernels", 2, 0),
                                                                     ("overlapkernels", 3, 0), ("overlapkernels", 3, 1)]
    for row in ours:  # bytes per step are exactly ZeRO's 2 Psi / 3 Psi
        assert row["comm_psi"] == pytest.approx(row["theory_psi"])
    # the peers on the same model and group: FSDP2 as ZeRO-3 and ZeRO-2, DDP; sharded over 2 ranks,
    # FSDP2 keeps half of DDP's parameter bytes (8 x 8 weights + 8 biases per layer: even halves)
    assert [(r["impl"], r["stage"]) for r in peers] == [("torch FSDP2", 3), ("torch FSDP2", 2), ("torch DDP", 0)]
    assert peers[0]["param_mb"] == peers[1]["param_mb"] == peers[2]["param_mb"] / 2 and peers[0]["time_us"] > 0
    _spread_and_telemetry(rows)


def test_pipeline_bench_smoke(rank_pool):
    from overlapkernels.bench import pipeline as pb

    cfg = pb.PipelineBenchConfig(microbatches=2, width=4, layers_per_stage=2, batch=4, iters=2, warmup=0)
    rows = rank_pool(2).run(pb.rank_main, pb.config_dict(cfg))[0]
    assert [r["kind"] for r in rows] == ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v"]
    assert all(r["sim_us"] > 0 for r in rows)
    # the published bubbles at p=2, m=2: (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB-H1 (p-1)/(3m+p-1),
    # that being what the simulator gives at t_F = t_B = t_W; ZB-V below its 2p - 1 microbatches:
    # the simulator's at equal chunk costs, 12 of 14 busy (at m = 3 it would be (p-1)/(6m+p-1))
    assert [r["bubble_theory"] for r in rows] == pytest.approx([1 / 3, 1 / 3, 1 / 5, 1 / 7, 2 / 14])
    from overlapkernels.runtime import pipeline as pp
    zb = pp.simulate(pp.make_schedule("zb-h1", 2, 2), t_f=1, t_b=1, t_w=1)
    assert rows[3]["bubble_theory"] == pytest.approx(zb.bubble_fraction)
    _spread_and_telemetry(rows, "step_us")


def _bubble_of_uneven_steps_on_rank():
    class Runner:  # steps of 1 s: 0.5 s of compute, the last timed one 0.9 s
        def __init__(self, stages, group, schedule, loss_fn):
            self.calls = 0

        def step(self, x, y):
            self.calls += 1
            self.step_s, late = 1.0, self.calls == 4
            self.compute_s = {"F": 0.5 if late else 0.3, "B": 0.0, "W": 0.0, "BW": 0.4 if late else 0.2}

    return _pipeline_row_with(Runner, kinds=("gpipe",), iters=3, warmup=1)


def _pipeline_row_with(runner, **config):
    """(bubble_measured, sim_us) of the pipeline bench's one row, its PipelineRunner replaced by ``runner``."""
    from overlapkernels.bench import pipeline as pb
    from overlapkernels.runtime import pipeline as pp

    own, pp.PipelineRunner = pp.PipelineRunner, runner
    try:
        row = pb.run_pipeline(pb.PipelineBenchConfig(microbatches=2, width=4, batch=4, **config))[0]
        return row["bubble_measured"], row["sim_us"]
    finally:
        pp.PipelineRunner = own


def test_pipeline_bench_bubble_is_over_every_timed_step(rank_pool):
    """1 - (0.5 + 0.5 + 0.9) / 3, where the last step's alone (0.1) was reported. The simulated GPipe
    step of 2 microbatches: 2 (t_F + t_BW), with t_F 1.1 / 6 and t_BW 0.8 / 6 s per microbatch."""
    assert rank_pool(1).run(_bubble_of_uneven_steps_on_rank) == [pytest.approx((1 - 1.9 / 3, 2 * 1.9 / 6 * 1e6))]


def _speedup_and_efficiency_of_fake_times_on_rank(kind):
    """ring-attention's timings in order: all-gather 3 s, ring 2 s, compute alone 1 s, fwd+bwd 5 s;
    layers': baseline 2 s, decomposed 1 s (a fake timer, alike on every rank)."""
    from overlapkernels.bench import layers as lb
    from overlapkernels.bench import ring_attention as rb

    module = rb if kind == "ring" else lb
    fake = iter([3.0, 2.0, 1.0, 5.0, 6.0, 7.0] if kind == "ring" else [2.0, 1.0])
    own, module.time_calls = module.time_calls, lambda fn, iters, *a, **k: [next(fake)] * iters
    try:
        if kind == "ring":
            cfg = rb.RingConfig(seq=8, heads=2, kv_heads=1, head_dim=4, iters=1, warmup=0, layouts=("zigzag",),
                                causal=(False,))
            return [(r["speedup"], r["efficiency"]) for r in rb.run_ring(cfg)]
        cfg = lb.LayersConfig(seq=8, hidden=16, heads=4, kv_heads=2, ffn_hidden=32, iters=1, warmup=0,
                              methods=("baseline", "decomposed"))
        return [r["speedup"] for r in lb.run_layers(cfg)]
    finally:
        module.time_calls = own


def test_speedup_and_efficiency_of_ring_attention_and_layers_rows(rank_pool):
    """Speedup = T_reference / T (> 1: faster); ring's E = 1 - (T_ring - T_compute) / (T_allgather - T_compute)."""
    assert rank_pool(2).run(_speedup_and_efficiency_of_fake_times_on_rank, "ring")[0] == [(1.5, 0.5)]
    assert rank_pool(2).run(_speedup_and_efficiency_of_fake_times_on_rank, "layers")[0] == [1.0, 2.0]


def _zb_row_of_fake_steps_on_rank():
    r = dist.get_rank()

    class Runner:  # steps of 1 s; rank 0 computes 0.5 s of each, rank 1 0.9 s
        def __init__(self, stages, group, schedule, loss_fn):
            pass

        def step(self, x, y):
            self.step_s = 1.0
            self.compute_s = {"F": 0.2 + 0.2 * r, "B": 0.2, "W": 0.1 + 0.2 * r, "BW": 0.0}

    return _pipeline_row_with(Runner, kinds=("zb-h1",), iters=2, warmup=0)


def test_pipeline_bench_averages_the_ranks_and_simulates_their_measured_w(rank_pool):
    """Per microbatch, averaged over the 2 ranks: t_F 0.15 s, t_B 0.1 s, t_W 0.1 s; bubbles 0.5 and 0.1 -> 0.3.
    The simulated step is ZB-H1's with those times, W included."""
    from overlapkernels.runtime import pipeline as pp

    sim = pp.simulate(pp.make_schedule("zb-h1", 2, 2), t_f=0.15, t_b=0.1, t_w=0.1)
    assert rank_pool(2).run(_zb_row_of_fake_steps_on_rank) == [pytest.approx((0.3, sim.makespan * 1e6))] * 2


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


@pytest.mark.parametrize("op, gemm", [("ag-matmul", (16, 8, 6)), ("matmul-rs", (16, 4, 12))])
def test_tflops_counts_two_flops_per_multiply_add(rank_pool, op, gemm):
    """The GEMM of shape (16, 8, 12) on 2 ranks: AG+GEMM per rank is [16, 8] @ [8, 6] (N split),
    GEMM+RS [16, 4] @ [4, 12] (K split); TFLOP/s = 2 M K N / time."""
    config = tp_ops.TpOpsConfig(op=op, shapes=(("tiny", (16, 8, 12)),), iters=2, warmup=1)
    m, k, n = gemm
    for row in rank_pool(2).run(tp_ops.rank_main, tp_ops.config_dict(config))[0]:
        assert row["tflops"] == pytest.approx(2 * m * k * n / (row["time_us"] * 1e-6) / 1e12, rel=1e-9)


def test_gpu_median_asks_do_bench_for_the_median(monkeypatch):
    """do_bench's default is the mean; the GPU benchmark scripts report medians through this."""
    import triton.testing

    from overlapkernels.bench.timing import gpu_median_s

    seen = {}
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: seen.update(kwargs) or 2.0)
    assert gpu_median_s(lambda: None, rep=5) == 2e-3 and seen == {"return_mode": "median", "rep": 5}


def _timing_with_a_pending_timeout_on_rank():
    """A symm/fused call of the timed ones timed out on rank 1 (its error record pending): every
    rank's timing raises, naming what was timed, instead of reporting a garbage call's speed."""
    from overlapkernels.comm import process_world
    from overlapkernels.kernels.errors import SignalTimeoutError

    def pending():
        raise SignalTimeoutError("all_gather_matmul[fused]: rank 1 timed out waiting for chunk 0 (planted)")

    real = process_world.check_pending_errors
    if dist.get_rank() == 1:
        process_world.check_pending_errors = pending
    try:
        time_calls(lambda: None, 2, 1, torch.device("cpu"), None, "bench ag-matmul tiny [fused]")
    except Exception as exc:  # noqa: BLE001
        return f"{type(exc).__name__}: {exc}"
    finally:  # (the pool's ranks live on into later tests)
        process_world.check_pending_errors = real
    return "timed"


def test_timings_stop_on_a_timeout_pending_on_any_rank(rank_pool):
    said = rank_pool(2).run(_timing_with_a_pending_timeout_on_rank)
    assert said[1].startswith("SignalTimeoutError: all_gather_matmul[fused]: rank 1 timed out"), said
    assert said[0].startswith("PeerFailedError") and "bench ag-matmul tiny [fused]" in said[0], said
