"""The per-kind row builders' arithmetic against fake timers and counts (no timing asserts): which
timing each column comes from, call counts with warm-up calls, units (MB = 2**20 bytes), TFLOP/s;
the methods every rank skips together; the plots' axes; the progress bar off on other ranks."""
import csv
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist


def _ring_row_of_fake_times_on_rank():
    """ring-attention's timings in order: all-gather 3 s; ring 1, 2 and 4 s (median 2); compute 1 s;
    fwd+bwd 5 s; ulysses fwd 6 s, fwd+bwd 7 s."""
    from overlapkernels.bench import ring_attention as rb

    fake = iter([[3.0] * 3, [1.0, 4.0, 2.0], [1.0] * 3, [5.0] * 3, [6.0] * 3, [7.0] * 3])
    own, rb.time_calls = rb.time_calls, lambda fn, iters, *a, **k: next(fake)
    try:
        cfg = rb.RingConfig(seq=8, heads=2, kv_heads=1, head_dim=4, iters=3, warmup=0, layouts=("zigzag",),
                            causal=(True,))
        return rb.run_ring(cfg)[0], rb._flops(cfg, 2, True)
    finally:
        rb.time_calls = own


def test_ring_attention_row_takes_its_spread_and_tflops_from_the_ring_forward(rank_pool):
    """min_us / max_us and TFLOP/s are the ring forward's; causal attention does half the flops:
    4 B H S_local S D / 2 = 4 x 1 x 2 x 4 x 8 x 8 / 2 / 2 = 512 per rank."""
    row, flops = rank_pool(2).run(_ring_row_of_fake_times_on_rank)[0]
    assert flops == 512
    assert (row["fwd_allgather_us"], row["fwd_ring_us"], row["min_us"], row["max_us"]) == (3e6, 2e6, 1e6, 4e6)
    assert (row["compute_us"], row["fwd_bwd_ring_us"]) == (1e6, 5e6)
    assert (row["fwd_ulysses_us"], row["fwd_bwd_ulysses_us"]) == (6e6, 7e6)
    assert row["tflops_fwd"] == 512 / 2.0 / 1e12


def _layers_ran_with_warmup_on_rank():
    from overlapkernels.bench import layers as lb

    cfg = lb.LayersConfig(seq=8, hidden=16, heads=4, kv_heads=2, ffn_hidden=32, iters=1, warmup=2,
                          methods=("baseline",))
    return [r["ran"] for r in lb.run_layers(cfg)]


def test_layers_ran_counts_calls_per_step_with_warmup_steps(rank_pool):
    """The counters see warm-up and timed steps alike: per step, 2 all-gather GEMMs and 2 GEMM
    reduce-scatters forward, as many backward, whatever --warmup is."""
    assert rank_pool(2).run(_layers_ran_with_warmup_on_rank)[0] == [
        "all_gather_matmul: baseline x4, matmul_reduce_scatter: baseline x4"]


def test_fsdp_comm_volume_with_warmup_steps_and_params_in_mib(rank_pool):
    """comm / Psi is per step over warm-up and timed steps (both counted); the kept parameter bytes
    are in MB of 2**20: 3 layers of 8 x 8 weights and 8 biases, float32, 864 bytes (whole at stage 1
    and in DDP)."""
    from overlapkernels.bench import fsdp as fb

    cfg = fb.FsdpConfig(layers=3, width=8, batch=4, stages=(1, 3), prefetches=(0,), iters=1, warmup=2)
    rows = rank_pool(2).run(fb.rank_main, fb.config_dict(cfg))[0]
    ours = [r for r in rows if r["impl"] == "overlapkernels"]
    assert [(r["stage"], r["comm_psi"]) for r in ours] == [(1, pytest.approx(2.0)), (3, pytest.approx(3.0))]
    assert ours[0]["param_mb"] == 864 / 2**20
    ddp = [r for r in rows if r["impl"] == "torch DDP"]
    assert [r["param_mb"] for r in ddp] == [864 / 2**20]


def _interleaved_row_of_fake_steps_on_rank():
    class Runner:  # steps of 1 s: 0.4 s forward, 0.4 s backward (weights' included)
        def __init__(self, stages, group, schedule, loss_fn):
            pass

        def step(self, x, y):
            self.step_s = 1.0
            self.compute_s = {"F": 0.4, "B": 0.0, "W": 0.0, "BW": 0.4}

    from overlapkernels.bench import pipeline as pb
    from overlapkernels.runtime import pipeline as pp

    own, pp.PipelineRunner = pp.PipelineRunner, Runner
    try:
        row = pb.run_pipeline(pb.PipelineBenchConfig(kinds=("interleaved-1f1b",), microbatches=2, width=4, batch=4,
                                                     iters=1, warmup=0))[0]
    finally:
        pp.PipelineRunner = own
    return row["sim_us"]


def test_interleaved_pipeline_op_times_are_per_virtual_stage(rank_pool):
    """Each rank holds 2 virtual stages: 2 microbatches x 2 stages = 4 forwards per step, t_F = t_B = 0.1 s."""
    from overlapkernels.runtime import pipeline as pp

    sim = pp.simulate(pp.make_schedule("interleaved-1f1b", 2, 2, num_virtual=2), t_f=0.1, t_b=0.1, t_w=0.0)
    assert rank_pool(2).run(_interleaved_row_of_fake_steps_on_rank) == [pytest.approx(sim.makespan * 1e6)] * 2


def _methods_one_rank_cannot_run_on_rank():
    import io
    from contextlib import redirect_stdout

    from overlapkernels.bench import timing
    from overlapkernels.ops import _methods

    own = _methods.unavailable_reason
    _methods.unavailable_reason = lambda method, group, device, dtype=None: (
        "not on this rank" if dist.get_rank() == 1 and method == "decomposed" else None)
    try:
        with redirect_stdout(io.StringIO()) as out:
            kept = timing.available_methods(["baseline", "decomposed", "auto"], dist.group.WORLD,
                                            torch.device("cpu"), "layers")
    finally:
        _methods.unavailable_reason = own
    return kept, out.getvalue()


def test_a_method_one_rank_cannot_run_is_skipped_by_every_rank(rank_pool):
    """Rank 1 alone cannot run it: rank 0 skips it too (else it would wait in a collective rank 1
    never joins) and says it is unavailable on another rank."""
    (kept0, said0), (kept1, said1) = rank_pool(2).run(_methods_one_rank_cannot_run_on_rank)
    assert kept0 == kept1 == ["baseline", "auto"]
    assert said0 == "# layers: skipped method='decomposed': unavailable on another rank\n" and said1 == ""


def _plotted(monkeypatch, kind, rows, tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")
    from overlapkernels.bench.plot import plot_rows

    figs = []
    own_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    assert plot_rows(kind, rows, str(tmp_path / f"{kind}.png"))
    own_close(figs[0])
    return figs[0].axes


def test_collectives_plot_time_and_busbw_against_size_on_log_axes(monkeypatch, tmp_path):
    rows = [{"op": op, "bytes": b, "time_us": t, "busbw_gbps": bw, "algbw_gbps": -1.0, "world_size": 2}
            for op, b, t, bw in (("all_gather", 1024, 10.0, 1.0), ("all_gather", 4096, 20.0, 2.0),
                                 ("all_reduce", 1024, 30.0, 3.0), ("all_reduce", 4096, 40.0, 4.0))]
    time_ax, bw_ax = _plotted(monkeypatch, "collectives", rows, tmp_path)
    assert (time_ax.get_xscale(), time_ax.get_yscale(), time_ax.get_ylabel()) == ("log", "log", "time (us)")
    assert (bw_ax.get_xscale(), bw_ax.get_yscale(), bw_ax.get_ylabel()) == ("log", "linear", "busbw (GB/s)")
    assert [list(line.get_xdata()) for line in bw_ax.get_lines()] == [[1024.0, 4096.0]] * 2
    assert [list(line.get_ydata()) for line in bw_ax.get_lines()] == [[1.0, 2.0], [3.0, 4.0]]
    assert [list(line.get_ydata()) for line in time_ax.get_lines()] == [[10.0, 20.0], [30.0, 40.0]]


def test_the_progress_bar_is_drawn_only_where_enabled(monkeypatch):
    """Only rank 0 draws it: the others' bars would interleave on one terminal."""
    import sys

    from overlapkernels.bench import progress

    rich_progress = pytest.importorskip("rich.progress")
    monkeypatch.setattr(rich_progress, "track", lambda *a, **k: pytest.fail("a bar on a disabled rank"))
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert progress.track((x for x in [1, 2, 3]), "sweep", enabled=False) == [1, 2, 3]


_CHUNKED = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_chunked_gemm.py"


def test_chunked_gemm_tflops_counts_every_rank_chunk(monkeypatch, tmp_path):
    """The one GEMM is [P m, K] @ [K, N]: 2 P m K N flops; a fake timer, 2 ms per figure."""
    spec = importlib.util.spec_from_file_location("bench_chunked_gemm_rows", _CHUNKED)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "_median_s", lambda fn, device, iters: 2e-3)
    path = tmp_path / "chunked.csv"
    assert bench.main(["--device", "cpu", "--dtype", "float32", "--worlds", "3", "--rows", "2", "--shapes",
                       "8B qkv", "--iters", "1", "--csv", str(path)]) == 0
    (row,) = csv.DictReader(path.open())
    assert (float(row["gemm_us"]), float(row["chunk_cost"])) == (2000.0, 1.0)
    assert float(row["tflops"]) == pytest.approx(2 * 3 * 2 * 4096 * 768 / 2e-3 / 1e12, rel=1e-12)


def test_a_vote_that_fails_leaves_the_kind_voting(monkeypatch):
    """A peer that never votes ends the vote in an error: the stage must say "voting" (the others
    may be waiting for this rank), so `bench all` stops rather than go on to the next kind."""
    from overlapkernels.bench import kind_gate

    gate = object.__new__(kind_gate.KindGate)  # (no process group: the vote's collective is faked)
    gate._group, gate.stage = None, "before"

    def timed_out(*args, **kwargs):
        raise RuntimeError("gloo: timed out waiting for rank 1")

    monkeypatch.setattr(dist, "all_reduce", timed_out)
    with pytest.raises(RuntimeError, match="timed out"):
        gate.vote(True)
    assert gate.stage == "voting" and kind_gate.must_stop(gate.stage)


def _collective_inputs_on_rank():
    from overlapkernels.bench import collectives as cb

    seen, own = [], {op: getattr(cb.C, op) for op in cb.OPS}
    for op in cb.OPS:
        setattr(cb.C, op, lambda x, group, op=op: seen.append((op, x.numel())))
    try:
        rows = cb.run_collectives(cb.CollectivesConfig(sizes=(64,), iters=1, warmup=0))
    finally:
        for op, fn in own.items():
            setattr(cb.C, op, fn)
    return seen, [(r["op"], r["bytes"], r["count"]) for r in rows]


def test_collectives_are_sized_as_nccl_tests_size_them(rank_pool):
    """64 bytes of float32 on 2 ranks: 16 elements gathered from 8 per rank, scattered from 16,
    reduced and exchanged as 16."""
    seen, rows = rank_pool(2).run(_collective_inputs_on_rank)[0]
    assert seen == [("all_gather", 8), ("reduce_scatter", 16), ("all_reduce", 16), ("all_to_all", 16)]
    assert rows == [(op, 64, 16) for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")]


def test_cpu_presets_are_the_models_scaled_down():
    """On CPU `bench ag-matmul --shapes llama3-8b` runs the layers 8x smaller in every dim."""
    from overlapkernels.bench import tp_ops

    assert tp_ops.parse_shapes("llama3-8b", "ag-matmul", tp_ops.CPU_SCALE) == [
        ("llama3-8b/qkv", (1024, 512, 768)), ("llama3-8b/fc1", (1024, 512, 3584))]


def test_a_cpu_run_never_asks_nvml(monkeypatch):
    """NVML would describe a GPU the CPU run did not use (GPU 0 of this machine): no sampling."""
    import sys
    import types

    from overlapkernels.bench.timing import telemetry
    from overlapkernels.profiling.telemetry import COLUMNS

    asked = []
    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(nvmlInit=lambda: asked.append("init"),
                                                                     nvmlShutdown=lambda: None))
    with telemetry(torch.device("cpu")) as tel:
        pass
    assert asked == [] and tel.summary() == dict.fromkeys(COLUMNS)
