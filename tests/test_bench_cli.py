"""The `bench` command line: `bench all` runs every kind, goes on after a failing one, and under
torchrun stops only where ranks may wait in collectives, skipping together a kind one rank cannot run
(real gloo ranks included); each kind's defaults fit the world size; bad sizes, a missing matplotlib
and unusable output paths fail before any rank starts; bare --profile / --plot take default folders.
The benchmarks themselves: test_bench_ops.py, test_bench_collectives.py."""
import subprocess
import sys

import pytest


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


@pytest.mark.parametrize("nproc", [3, 5, 6, 8])
def test_bench_all_sizes_fit_any_number_of_cpu_ranks(monkeypatch, capsys, nproc):
    """Every kind's small sizes divide the ranks (ring's zigzag: 2 chunks a rank), so each kind gets
    past its validation with 3, 5 or 6 ranks too, where 4 of the 7 failed (validation only: no rank
    is started)."""
    from overlapkernels import cli

    started = []
    monkeypatch.setattr(cli, "_run_ranks", lambda fn, cfg, args: started.append(args.kind) or (None, "cpu"))
    assert cli.main(["bench", "all", "--nproc", str(nproc)]) == 0, capsys.readouterr().err
    assert started == list(cli.ALL_KINDS)


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
    # 3 (or 6) ranks: 12 heads, and hidden rounded to 2 x 12 keeps the head dim even (516 gave 43: RoPE refused
    # it inside every rank, so `bench all --nproc 3` failed)
    three = _configs(monkeypatch, ["bench", "layers", "--nproc", "3"])
    assert (three["kv_heads"], three["heads"], three["hidden"]) == (6, 12, 528)
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
    (["bench", "layers", "--hidden", "516", "--heads", "12", "--kv-heads", "6"], "hidden=516, heads=12: the head dim 43 "
     "must be even"),
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
    (["bench", "all", "--nproc", "0"], "--nproc 0: expected >= 1"),  # once: before, once per kind, then exit 1
])
def test_bad_sizes_fail_before_any_rank_starts(monkeypatch, capsys, argv, message):
    from overlapkernels import cli

    monkeypatch.setattr(cli, "_run_ranks", lambda *a: pytest.fail("ranks started"))
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_bad_shape_before_spawning():
    out = subprocess.run([sys.executable, "-m", "overlapkernels", "bench", "ag-matmul", "--nproc", "3",
                          "--shapes", "16x8x12"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must be divisible by the world size 3" in out.stderr


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


def test_nproc_against_a_launched_world_is_refused_not_ignored(monkeypatch, capsys):
    """RANK and WORLD_SIZE=1 left set (a scheduler, a notebook) made `--nproc 4` run one rank, silently;
    without --nproc the launched world decides, as before."""
    from overlapkernels import cli

    monkeypatch.setattr(cli, "_run_ranks", lambda *a: pytest.fail("ranks started"))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert cli.main(["bench", "layers", "--nproc", "4"]) == 2
    assert ("--nproc 4: this process was launched into a world of 1 ranks (RANK and WORLD_SIZE are set), which "
            "decides; drop --nproc") in capsys.readouterr().err
    args = cli.build_parser().parse_args(["bench", "layers"])
    assert cli._world(args) == 1 and args.nproc == 1
    monkeypatch.delenv("RANK")
    args = cli.build_parser().parse_args(["bench", "layers"])
    assert cli._world(args) == cli.DEFAULT_NPROC == 4
