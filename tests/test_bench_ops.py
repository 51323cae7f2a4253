"""ag-matmul / matmul-rs benchmark: shape presets, validation, a smoke run on CPU (no timing asserts)."""
import math
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

from overlapkernels.bench import tp_ops
from overlapkernels.profiling.telemetry import COLUMNS as TELEMETRY


def _spread_and_telemetry(rows, time_key="time_us"):
    """Every row: median between min and max, and the NVML columns, empty on CPU."""
    for row in rows:
        assert 0 < row["min_us"] <= row[time_key] <= row["max_us"], row
        assert all(row[c] == "" for c in TELEMETRY), row


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
    _spread_and_telemetry(rows, "fwd_ring_us")
    with pytest.raises(ValueError, match="seq=10 must be divisible by 2 x the world size 4"):
        rb.RingConfig(seq=10).validate(4)


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
    assert [(r["stage"], r["prefetch"]) for r in rows] == [(1, 0), (2, 0), (3, 0), (3, 1)]
    for row in rows:  # bytes per step are exactly ZeRO's 2 Psi / 3 Psi
        assert row["comm_psi"] == pytest.approx(row["theory_psi"])
    _spread_and_telemetry(rows)


def test_pipeline_bench_smoke(rank_pool):
    from overlapkernels.bench import pipeline as pb

    cfg = pb.PipelineBenchConfig(microbatches=2, width=4, layers_per_stage=2, batch=4, iters=2, warmup=0)
    rows = rank_pool(2).run(pb.rank_main, pb.config_dict(cfg))[0]
    assert [r["kind"] for r in rows] == ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]
    assert all(r["sim_us"] > 0 for r in rows)
    # the published bubbles at p=2, m=2: (p-1)/(m+p-1), interleaved (p-1)/(vm+p-1), ZB-H1 (p-1)/(3m+p-1),
    # the last being what the simulator gives at t_F = t_B = t_W
    assert [r["bubble_theory"] for r in rows] == pytest.approx([1 / 3, 1 / 3, 1 / 5, 1 / 7])
    from overlapkernels.runtime import pipeline as pp
    zb = pp.simulate(pp.make_schedule("zb-h1", 2, 2), t_f=1, t_b=1, t_w=1)
    assert rows[3]["bubble_theory"] == pytest.approx(zb.bubble_fraction)
    _spread_and_telemetry(rows, "step_us")


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


def test_bench_all_runs_every_kind(monkeypatch, tmp_path):
    from overlapkernels import cli

    calls = []
    monkeypatch.setattr(cli, "main", lambda argv: calls.append(argv) or 0)
    args = cli.build_parser().parse_args(["bench", "all", "--nproc", "2", "--csv", "out.csv", "--profile",
                                          str(tmp_path / "prof")])
    assert cli._bench_all(args) == 0
    assert [c[1] for c in calls] == list(cli.ALL_KINDS)
    assert all(c[:2] == ["bench", c[1]] and "--csv" in c and "--nproc" in c for c in calls)
    # each kind's traces in a folder of their own: one shared folder kept only the last kind's
    assert [c[c.index("--profile") + 1] for c in calls] == [str(tmp_path / "prof" / k) for k in cli.ALL_KINDS]


def test_bench_all_runs_the_rest_after_a_failing_kind(monkeypatch, capsys):
    from overlapkernels import cli

    ran = []

    def fake_main(argv):
        ran.append(argv[1])
        if argv[1] == "layers":
            raise RuntimeError("rank 1 crashed")
        return 2 if argv[1] == "fsdp" else 0

    monkeypatch.setattr(cli, "main", fake_main)
    assert cli._bench_all(cli.build_parser().parse_args(["bench", "all", "--nproc", "2"])) == 1
    assert ran == list(cli.ALL_KINDS)
    err = capsys.readouterr().err
    assert "RuntimeError: rank 1 crashed" in err and "2 of 7 kinds failed: layers (exit 1), fsdp (exit 2)" in err


@pytest.mark.parametrize("stage, stop", [(None, False), ("before", False), ("skipped", False), ("done", False),
                                         ("voting", True), ("running", True)])
def test_bench_all_stops_only_where_ranks_may_wait_in_collectives(stage, stop):
    """None: spawned --nproc ranks (the pool isolates a kind); before: this rank's vote tells the others;
    skipped: every rank skipped it; done: its collectives completed; voting/running: peers may wait."""
    from overlapkernels import cli

    assert cli._must_stop(stage) is stop


class _FakeGate:
    """Rank 0's vote in a world of 2 whose other rank votes `peer[kind]` (default: to run)."""

    def __init__(self, peer):
        self.peer, self.votes, self.stage, self.kind = peer, [], "before", None

    def vote(self, run):
        everyone = run and self.peer.get(self.kind, True)
        self.votes.append((self.kind, run))
        self.stage = "running" if everyone else "skipped"
        return everyone


class _Exited(BaseException):
    pass


def _bench_all_under_torchrun(monkeypatch, behaviour, peer=None):
    """`bench all` as rank 0 under torchrun with fake kinds: behaviour[kind] is "ok", "bad sizes"
    (fails before its collectives), "crash" (fails in them) or "no rows" (rank 0's report fails after
    them) -> (status or ("exit", code), kinds run, the gate)."""
    import torch.distributed as dist

    from overlapkernels import cli, parallel

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(parallel, "init_default_process_group", lambda: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(parallel, "uses_nccl", lambda group=None: False)  # no group here: gloo, as on CPU ranks
    gate = _FakeGate(peer or {})
    monkeypatch.setattr(cli, "_KindGate", lambda: gate)
    monkeypatch.setattr(cli, "_exit_now", lambda code: (_ for _ in ()).throw(_Exited(code)))
    monkeypatch.setattr(cli, "ALL_KINDS", {kind: [] for kind in behaviour})
    ran = []

    def kind_main(kind):
        def run(args):
            ran.append(kind)
            gate.kind = kind
            if behaviour[kind] == "bad sizes":
                raise ValueError("sizes this world cannot take")

            def rank_main(config):
                if behaviour[kind] == "crash":
                    raise RuntimeError("CUDA error on this rank only")
                return [{}]

            cli._run_ranks(rank_main, {}, args)
            return 1 if behaviour[kind] == "no rows" else 0
        return run

    for kind, func in (("layers", "_bench_layers"), ("fsdp", "_bench_fsdp"), ("pipeline", "_bench_pipeline")):
        monkeypatch.setattr(cli, func, kind_main(kind))
    try:
        status = cli._bench_all(cli.build_parser().parse_args(["bench", "all"]))
    except _Exited as exc:
        status = ("exit", exc.args[0])
    return status, ran, gate


def test_bench_all_under_torchrun_exits_at_once_when_a_kind_fails_mid_run(monkeypatch, capsys):
    """A rank whose kind fails in its collectives must not go on to the next kind (the others are
    still in this one's collectives, and would hang until the NCCL watchdog): it exits non-zero."""
    status, ran, gate = _bench_all_under_torchrun(monkeypatch, {"layers": "ok", "fsdp": "crash", "pipeline": "ok"})
    assert status == ("exit", 1) and ran == ["layers", "fsdp"]
    assert gate.votes == [("layers", True), ("fsdp", True)]
    err = capsys.readouterr().err
    assert "RuntimeError: CUDA error on this rank only" in err and "fsdp failed on this rank while ranks" in err


def test_bench_all_under_torchrun_passes_over_kinds_every_rank_skips(monkeypatch, capsys):
    """Bad sizes here: this rank votes not to run it. Bad sizes on the peer: this rank is told and skips
    it too. A report that fails after the collectives: the ranks are in step, so the rest still run."""
    status, ran, gate = _bench_all_under_torchrun(monkeypatch, {"layers": "bad sizes", "fsdp": "ok",
                                                                "pipeline": "no rows"}, peer={"fsdp": False})
    assert status == 1 and ran == ["layers", "fsdp", "pipeline"]
    assert gate.votes == [("layers", False), ("fsdp", True), ("pipeline", True)]
    err = capsys.readouterr().err
    assert "sizes this world cannot take" in err and "fsdp: skipped: another rank cannot run it" in err
    assert "3 of 3 kinds failed: layers (exit 2), fsdp (skipped), pipeline (exit 1)" in err


def _bench_all_on_rank(fail_rank):
    """On a gloo rank (torchrun's environment): `bench all` over two kinds whose ranks all_reduce;
    on `fail_rank` the first fails before communicating."""
    import torch
    import torch.distributed as dist

    from overlapkernels import cli

    seen = []

    def kind_main(kind):
        def run(args):
            if kind == "fsdp" and dist.get_rank() == fail_rank:
                raise ValueError("an output path this node cannot write")

            def rank_main(config):
                t = torch.ones(1)
                dist.all_reduce(t)
                seen.append((kind, int(t.item())))
                return [{}]

            cli._run_ranks(rank_main, {}, args)
            return 0
        return run

    saved = cli.ALL_KINDS, cli._bench_fsdp, cli._bench_pipeline
    cli.ALL_KINDS, cli._bench_fsdp, cli._bench_pipeline = {"fsdp": [], "pipeline": []}, kind_main("fsdp"), \
        kind_main("pipeline")
    try:
        return cli._bench_all(cli.build_parser().parse_args(["bench", "all"])), seen
    finally:
        cli.ALL_KINDS, cli._bench_fsdp, cli._bench_pipeline = saved


def test_bench_all_ranks_agree_to_skip_a_kind_one_rank_cannot_run(rank_pool):
    """Real gloo ranks: rank 1 fails the first kind before communicating; rank 0, which could run it,
    skips it too instead of waiting in its all_reduce, and both run the next kind together."""
    assert rank_pool(2).run(_bench_all_on_rank, 1, timeout=60) == [(1, [("pipeline", 2)])] * 2


def _configs(monkeypatch, argv, env=None, cuda=False):
    """The config a `bench` command line builds, captured instead of running ranks."""
    from overlapkernels import cli

    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in (env or {}).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(cli, "_cuda_available", lambda: cuda)
    seen = []
    monkeypatch.setattr(cli, "_run_ranks", lambda rank_main, config, args: seen.append(config) or (None, "cpu"))
    assert cli.main(argv) == 0
    return seen[0]


def test_node_defaults_fit_the_world_size(monkeypatch):
    """Under torchrun on 8 GPUs every kind's defaults are valid (kv_heads=4 was not) and the TP
    kinds measure every method; CPU defaults are unchanged."""
    node = {"RANK": "0", "WORLD_SIZE": "8"}
    layers = _configs(monkeypatch, ["bench", "layers"], node, cuda=True)
    assert (layers["kv_heads"], layers["heads"], layers["hidden"], layers["seq"]) == (8, 8, 512, 1024)
    assert layers["methods"] == ("baseline", "decomposed", "symm", "fused", "auto")
    ag = _configs(monkeypatch, ["bench", "ag-matmul"], node, cuda=True)
    assert ag["methods"] == ("baseline", "decomposed", "symm", "fused", "auto")
    assert ag["shapes"][0] == ("llama3-8b/qkv", (8192, 4096, 6144))  # full size on GPUs
    assert _configs(monkeypatch, ["bench", "pipeline"], {"RANK": "0", "WORLD_SIZE": "16"})["microbatches"] == 16
    assert _configs(monkeypatch, ["bench", "ring-attention"], {"RANK": "0", "WORLD_SIZE": "3"})["seq"] == 2052
    cpu = _configs(monkeypatch, ["bench", "layers", "--nproc", "2"])
    assert (cpu["kv_heads"], cpu["heads"], cpu["methods"]) == (4, 8, ("baseline", "decomposed", "auto"))
    assert _configs(monkeypatch, ["bench", "matmul-rs", "--nproc", "2"])["methods"] == ("baseline", "decomposed")
    pipe = _configs(monkeypatch, ["bench", "pipeline", "--nproc", "2", "--warmup", "2"])
    assert (pipe["microbatches"], pipe["batch"], pipe["warmup"]) == (8, 64, 2)  # --warmup is honoured


@pytest.mark.parametrize("argv, message", [
    (["bench", "pipeline", "--microbatches", "0"], "microbatches=0: expected an integer >= 1"),
    (["bench", "pipeline", "--width", "0"], "width=0: expected an integer >= 1"),
    (["bench", "ring-attention", "--kv-heads", "0"], "kv_heads=0: expected an integer >= 1"),
    (["bench", "ring-attention", "--seq", "0"], "seq=0: expected an integer >= 1"),
    (["bench", "layers", "--seq", "0"], "seq=0: expected an integer >= 1"),
    (["bench", "layers", "--kv-heads", "3", "--heads", "8"], "heads=8, kv_heads=3: expected hidden divisible by heads "
     "and heads by kv_heads"),
    (["bench", "ag-matmul", "--shapes", "0x8x8", "--nproc", "2"], "shape '0x8x8' = 0x8x8: expected M, K and N >= 1"),
    (["bench", "fsdp", "--width", "0"], "width=0"),
    (["bench", "layers", "--nproc", "0"], "--nproc 0: expected >= 1"),
    (["bench", "ring-attention", "--layouts", "foo"], "layouts=['foo']: expected a non-empty subset of contiguous, "
     "zigzag"),
    (["bench", "ring-attention", "--layouts", "zigzag,"], "layouts=['zigzag', '']: expected a non-empty subset"),
    (["bench", "ag-matmul", "--methods", ""], "methods=['']: expected a non-empty subset of baseline, decomposed"),
    (["bench", "layers", "--methods", ""], "methods=['']: expected a non-empty subset of baseline, decomposed"),
    (["bench", "collectives", "--timeout", "0"], "--timeout 0.0: expected a finite number of seconds > 0"),
    (["bench", "collectives", "--timeout", "inf"], "--timeout inf: expected a finite number of seconds > 0"),
    (["demo", "--timeout", "-1"], "--timeout -1.0: expected a finite number of seconds > 0"),
    (["demo", "--nproc", "3", "--tp", "1", "--pp", "1", "--dp", "-1"],  # dp=-1 is checked as the 3 it becomes
     "batch=8 must be divisible by dp x microbatches = 3 x 2"),
    (["demo", "--nproc", "2", "--tp", "2", "--pp", "1", "--steps", "-1"], "steps=-1 must be >= 1"),
    (["demo", "--nproc", "0"], "--nproc 0: expected >= 1"),
])
def test_bad_sizes_fail_before_any_rank_starts(monkeypatch, capsys, argv, message):
    from overlapkernels import cli

    monkeypatch.setattr(cli, "_run_ranks", lambda *a: pytest.fail("ranks started"))
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_fails_before_running(monkeypatch, capsys, tmp_path):
    import sys

    from overlapkernels import cli

    monkeypatch.setattr(cli, "_run_ranks", lambda *a: pytest.fail("ranks started"))
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["bench", "fsdp", "--plot", str(tmp_path / "plots")]) == 2
    assert "needs matplotlib, which is not installed (pip install 'overlapkernels[bench]')" in capsys.readouterr().err


def test_unusable_output_paths_fail_before_running(monkeypatch, capsys, tmp_path):
    from overlapkernels import cli

    monkeypatch.setattr(cli, "_run_ranks", lambda *a: pytest.fail("ranks started"))
    a_file = tmp_path / "f.txt"
    a_file.write_text("")
    not_rows = tmp_path / "rows.json"  # JSON Lines, or any other text, under a .json name
    not_rows.write_text('{"op": "x"}\n{"op": "y"}\n')
    for flag, value, message in (("--csv", tmp_path, "is a directory; expected a file"),
                                 ("--json", tmp_path, "is a directory; expected a file"),
                                 ("--profile", a_file, "is a file; expected a directory"),
                                 ("--plot", a_file, "is a file; expected a directory"),
                                 ("--csv", a_file / "rows.csv", "f.txt is a file, so"),
                                 ("--json", not_rows, "holds no JSON array of rows")):
        for kind in ("fsdp", "all"):
            assert cli.main(["bench", kind, flag, str(value)]) == 2
            err = capsys.readouterr().err
            assert f"{flag} {value}: " in err and message in err, err


def test_bare_profile_and_plot_take_default_folders():
    from overlapkernels import cli

    args = cli.build_parser().parse_args(["bench", "fsdp", "--profile", "--plot", "--nproc", "2"])
    assert (args.profile, args.plot, args.nproc) == ("traces", "plots", 2)
    args = cli.build_parser().parse_args(["bench", "all", "--plot", "p", "--profile"])
    assert (args.profile, args.plot) == ("traces", "p")
    args = cli.build_parser().parse_args(["bench", "fsdp"])
    assert (args.profile, args.plot) == (None, None)


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
