"""`overlapkernels {info,demo,bench,profile}` (== `python -m overlapkernels ...`)."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback

from .bench.kind_gate import KindGate as _KindGate, KindSkipped as _KindSkipped, exit_now as _exit_now, \
    must_stop as _must_stop
from .bench.report import publish_rows


def _info(args) -> int:
    from .profiling.inventory import format_inventory, inventory

    from .parallel import local_rank

    if _launched() and local_rank() != 0:
        return 0  # under a launcher: one report per node (the inventory is the node's), not one per rank
    info = inventory()
    print(json.dumps(info, indent=2, default=str) if args.json else format_inventory(info))
    return 0


_depth = 0  # main() calls in progress: `bench all` runs each kind through a nested main()


def _end_process_group(made_here: bool, code: int) -> None:
    """After a command under a launcher ran to its end on every rank (exit code 0), destroy the
    default group if this command made it: NCCL warns when a process exits with it alive, and
    exiting with live communicators can leave a peer waiting. Not after a failure (a peer may be in
    a collective: `exit_now` ends such a rank), nor for a group the caller made (a test's rank pool,
    a script calling main()), nor inside `bench all`'s kinds (the next kind needs it)."""
    import torch.distributed as dist

    if made_here and code == 0 and dist.is_initialized():
        dist.destroy_process_group()


DEFAULT_NPROC = 4


def _resolve_nproc(args) -> None:
    """Under a launcher the world it made decides: a different --nproc is refused, not ignored (RANK
    and WORLD_SIZE left set by a scheduler or a notebook made ``--nproc 4`` run one rank, silently)."""
    if not hasattr(args, "nproc"):
        return
    if _launched():
        world = int(os.environ["WORLD_SIZE"])
        if args.nproc is not None and args.nproc != world:
            raise ValueError(f"--nproc {args.nproc}: this process was launched into a world of {world} ranks (RANK "
                             "and WORLD_SIZE are set), which decides; drop --nproc, or unset RANK and WORLD_SIZE to "
                             "spawn CPU ranks")
        args.nproc = world
    elif args.nproc is None:
        args.nproc = DEFAULT_NPROC


def _launched() -> bool:
    """True under torchrun (or any launcher that sets the env:// variables)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _run_ranks(rank_main, config: dict, args) -> tuple[list[dict] | None, str]:
    """Run ``rank_main(config)`` on the launched ranks (torchrun) or on ``--nproc`` spawned CPU
    ranks -> (rank 0's rows, or None on other ranks; device type). With ``--profile DIR`` every
    rank writes a torch.profiler chrome trace there."""
    _resolve_nproc(args)
    trace_dir = getattr(args, "profile", None)
    if trace_dir:
        from functools import partial

        from .profiling.trace import profiled

        rank_main = partial(profiled, rank_main, trace_dir=trace_dir)
    if _launched():
        import torch.distributed as dist

        from .parallel import init_default_process_group, uses_nccl

        init_default_process_group()
        gate = _kind_gate
        if gate is not None and not gate.vote(True):
            raise _KindSkipped("another rank cannot run it (its output says why)")
        rows = rank_main(config)
        if gate is not None:
            gate.stage = "done"
        return (rows if dist.get_rank() == 0 else None), ("cuda" if uses_nccl() else "cpu")
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: expected >= 1")
    from .comm.rank_pool import RankPool

    threads = max(1, (os.cpu_count() or 1) // args.nproc)
    with RankPool(args.nproc, timeout=args.timeout, threads_per_rank=threads) as pool:
        return pool.run(rank_main, config)[0], "cpu"


def _bench_collectives(args) -> int:
    from .bench.collectives import COLUMNS, CollectivesConfig, config_dict, rank_main
    from .bench.metrics import parse_size_range

    config = CollectivesConfig(ops=tuple(o.strip() for o in args.ops.split(",")) if args.ops != "all" else
                               CollectivesConfig.ops, sizes=tuple(parse_size_range(args.sizes)),
                               dtype=args.dtype, iters=args.iters, warmup=args.warmup)
    config.validate()  # before any rank is started or communicates
    rows, device = _run_ranks(rank_main, config_dict(config), args)
    return 0 if rows is None else publish_rows(rows, device, COLUMNS, "collectives (busbw as nccl-tests)", args)


def _bench_tp_op(args) -> int:
    from .bench import tp_ops

    scale = 1 if _on_gpus() else tp_ops.CPU_SCALE
    methods = _default(args.methods, "baseline,decomposed,symm,fused,auto" if _on_gpus() else "baseline,decomposed")
    config = tp_ops.TpOpsConfig(op=args.kind, shapes=tuple(tp_ops.parse_shapes(args.shapes, args.kind, scale)),
                                methods=tuple(m.strip() for m in methods.split(",")), dtype=args.dtype,
                                iters=args.iters, warmup=args.warmup)
    config.validate(_world(args))
    rows, device = _run_ranks(tp_ops.rank_main, tp_ops.config_dict(config), args)
    title = f"{args.kind} (E = 1 - (T - T_gemm)/(T_baseline - T_gemm))"
    return 0 if rows is None else publish_rows(rows, device, tp_ops.COLUMNS, title, args)


def _bench_ring(args) -> int:
    from .bench import ring_attention as rb

    seq = _default(args.seq, _round_up(2048, 2 * _world(args)))  # zigzag: 2 halves per rank
    cfg = rb.RingConfig(batch=args.batch, seq=seq, heads=args.heads, kv_heads=args.kv_heads,
                        head_dim=args.head_dim, dtype=args.dtype, iters=args.iters, warmup=args.warmup,
                        layouts=tuple(x.strip() for x in args.layouts.split(",")), causal=(True, False) if args.causal == "both" else
                        (args.causal == "true",), documents=args.documents)
    cfg.validate(_world(args))  # before any rank starts
    rows, device = _run_ranks(rb.rank_main, rb.config_dict(cfg), args)
    title = "ring attention (E = 1 - (T_ring - T_compute)/(T_allgather - T_compute), forward)"
    return 0 if rows is None else publish_rows(rows, device, rb.COLUMNS, title, args)


def _bench_layers(args) -> int:
    from .bench import layers as lb

    # defaults that every world size divides (kv_heads=4 would not split over 8 ranks), with an even head dim
    # (RoPE rotates pairs: 3 ranks give 12 heads, and 516 / 12 = 43 would not do); given values are checked
    world = _world(args)
    kv_heads = _default(args.kv_heads, _round_up(4, world))
    heads = _default(args.heads, _round_up(8, kv_heads))
    methods = _default(args.methods, "baseline,decomposed,symm,fused,auto" if _on_gpus() else "baseline,decomposed,auto")
    cfg = lb.LayersConfig(seq=_default(args.seq, _round_up(1024, world)), batch=args.batch,
                          hidden=_default(args.hidden, _round_up(512, 2 * heads)), heads=heads, kv_heads=kv_heads,
                          ffn_hidden=_default(args.ffn_hidden, _round_up(1792, world)), dtype=args.dtype,
                          methods=tuple(m.strip() for m in methods.split(",")), iters=args.iters, warmup=args.warmup)
    cfg.validate(world)
    rows, device = _run_ranks(lb.rank_main, lb.config_dict(cfg), args)
    return 0 if rows is None else publish_rows(rows, device, lb.COLUMNS, "transformer block fwd+bwd, TP + SP", args)


def _bench_fsdp(args) -> int:
    from .bench import fsdp as fb

    cfg = fb.FsdpConfig(layers=args.layers, width=args.width, batch=args.batch, iters=args.iters, warmup=args.warmup,
                        peers=not args.no_peers)
    cfg.validate()
    rows, device = _run_ranks(fb.rank_main, fb.config_dict(cfg), args)
    return 0 if rows is None else publish_rows(rows, device, fb.COLUMNS, "fsdp step per ZeRO stage (comm in Psi)", args)


def _bench_pipeline(args) -> int:
    from .bench import pipeline as pb

    microbatches = _default(args.microbatches, _round_up(8, _world(args)))  # interleaving needs a multiple of P
    cfg = pb.PipelineBenchConfig(microbatches=microbatches, width=args.width,
                                 batch=_default(args.batch, _round_up(64, microbatches)), iters=args.iters,
                                 warmup=args.warmup)
    cfg.validate(_world(args))
    rows, device = _run_ranks(pb.rank_main, pb.config_dict(cfg), args)
    return 0 if rows is None else publish_rows(rows, device, pb.COLUMNS, "pipeline: measured vs simulated", args)


# every bench kind, with sizes small enough for CPU ranks when not under torchrun
ALL_KINDS = {"collectives": ["--sizes", "1K:1M", "--iters", "5", "--warmup", "1"],
             "ag-matmul": ["--iters", "3"], "matmul-rs": ["--iters", "3"], "ring-attention": ["--seq", "1024"],
             "layers": ["--seq", "512", "--iters", "3"], "fsdp": [], "pipeline": []}


def _all_kinds_small(kind: str, nproc: int) -> list:
    """ALL_KINDS' sizes made to divide ``nproc`` ranks (zigzag: 2 per rank); the Llama-3 presets
    of the TP kinds fit 1, 2, 4 or 8 ranks only, so other counts get a shape of their own."""
    small = list(ALL_KINDS[kind])
    if "--seq" in small:
        i = small.index("--seq") + 1
        small[i] = str(_round_up(int(small[i]), (2 if kind == "ring-attention" else 1) * nproc))
    if kind in ("ag-matmul", "matmul-rs") and nproc not in (1, 2, 4, 8):
        small += ["--shapes", f"{_round_up(1024, nproc)}x{_round_up(512, nproc)}x{_round_up(1024, nproc)}"]
    return small


_kind_gate: _KindGate | None = None  # set while `bench all` runs under torchrun: _run_ranks votes through it


def _bench_all(args) -> int:
    """Every kind in turn; one that fails (bad sizes for this world, a crash) is reported and the
    rest still run, and the exit status says something failed. Under torchrun only a kind that
    fails before it communicates is passed over (by every rank: _KindGate); a rank on which a kind
    fails mid-run prints why and exits non-zero at once (_must_stop), and torchrun stops the rest."""
    global _kind_gate
    _world(args)  # a bad --nproc: one usage error, not the same one from every kind
    gate = _KindGate() if _launched() else None
    failed = []
    for kind in ALL_KINDS:
        small = _all_kinds_small(kind, args.nproc)
        common = ["--nproc", str(args.nproc)]
        for flag, value in (("--csv", args.csv), ("--json", args.json_out), ("--plot", args.plot),
                            ("--profile", args.profile and os.path.join(args.profile, kind))):  # a trace dir per kind
            common += [flag, value] if value else []
        print(f"\n## bench {kind}", flush=True)
        if gate is not None:
            gate.stage = "before"
        _kind_gate = gate
        try:
            status = main(["bench", kind, *common, *([] if _launched() else small)])
        except _KindSkipped as exc:
            print(f"## bench {kind}: skipped: {exc}", file=sys.stderr)
            status = "skipped"
        except Exception:  # noqa: BLE001 - one kind's crash must not cost the others their rows
            traceback.print_exc()
            status = 1
        finally:
            _kind_gate = None
        if status and _must_stop(gate and gate.stage):
            print(f"\n## bench all: {kind} failed on this rank while ranks communicate (exit {status}); stopping "
                  "here, the other ranks cannot finish it", file=sys.stderr)
            _exit_now(1)
        if gate is not None and gate.stage == "before":  # it never reached its collectives here: say so
            try:
                gate.vote(False)
            except Exception:  # noqa: BLE001 - a peer that cannot vote is dead or stuck
                traceback.print_exc()
                _exit_now(1)
        if status:
            failed.append(f"{kind} ({status if status == 'skipped' else f'exit {status}'})")
    if failed:
        print(f"\n## bench all: {len(failed)} of {len(ALL_KINDS)} kinds failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def _demo(args) -> int:
    from . import demo

    # before any rank starts; dp=-1 becomes the ranks left, so its checks and the table use that
    cfg = demo.config_from_args(args).resolved(int(os.environ["WORLD_SIZE"]) if _launched() else _world(args))
    rows, _ = _run_ranks(demo.rank_main, demo.config_dict(cfg), args)
    if rows is not None:
        print(demo.format_rows(rows, cfg))
    return 0


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def _on_gpus() -> bool:
    """Launched ranks with CUDA (NCCL): spawned --nproc ranks are always CPU (gloo) ones."""
    return _launched() and _cuda_available()


def _world(args) -> int:
    """The number of ranks the run will have: torchrun's, or the --nproc ranks to spawn."""
    _resolve_nproc(args)
    if _launched():
        return int(os.environ["WORLD_SIZE"])
    if args.nproc < 1:
        raise ValueError(f"--nproc {args.nproc}: expected >= 1")
    return args.nproc


def _round_up(n: int, multiple: int) -> int:
    return -(-n // max(1, multiple)) * max(1, multiple)


def _default(value, derived):
    return derived if value is None else value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="overlapkernels", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="versions, backends, GPUs, NVLink and topology")
    info.add_argument("--json", action="store_true", help="print JSON instead of text")
    info.set_defaults(func=_info)

    prof = sub.add_parser("profile", help="read traces")
    prof_kinds = prof.add_subparsers(dest="kind", required=True)
    rep = prof_kinds.add_parser("report", help="per op: comm and compute busy time, their overlap, comm hidden")
    rep.add_argument("trace", help="a chrome trace (torch.profiler export_chrome_trace, or bench --profile)")
    rep.add_argument("--json", action="store_true")
    rep.set_defaults(func=_profile_report)

    from . import demo

    demo.add_arguments(sub.add_parser("demo", help="train the small GPT in a 4-D composition on CPU ranks (or under "
                                      "torchrun)", formatter_class=argparse.ArgumentDefaultsHelpFormatter),
                       DEFAULT_NPROC).set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="microbenchmarks")
    kinds = bench.add_subparsers(dest="kind", required=True)
    coll = kinds.add_parser("collectives", help="all_gather / reduce_scatter / all_reduce / all_to_all bandwidth")
    coll.add_argument("--ops", default="all", help="comma-separated subset of "
                      "all_gather,reduce_scatter,all_reduce,all_to_all (default: all)")
    coll.add_argument("--sizes", default="1K:64M", help="MIN:MAX bytes, doubling (default 1K:64M)")
    coll.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 | float64")
    _rank_args(coll, iters=20, warmup=5)
    coll.set_defaults(func=_bench_collectives)
    for kind, what in (("ag-matmul", "all_gather_matmul"), ("matmul-rs", "matmul_reduce_scatter")):
        tp = kinds.add_parser(kind, help=f"{what}: every method on Llama-3 TP layer shapes")
        tp.add_argument("--shapes", default="llama3-8b", help="llama3-8b, llama3-70b or MxKxN, comma-separated "
                        "(unsharded layer dims; presets scaled 8x down on CPU)")
        tp.add_argument("--methods", help="comma-separated: baseline, decomposed, symm, fused, auto (default: all "
                        "of them under torchrun on GPUs, symm/fused skipped with the reason where the group has no "
                        "peer memory; baseline,decomposed on CPU ranks)")
        tp.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 | float64")
        _rank_args(tp, iters=10, warmup=2)
        tp.set_defaults(func=_bench_tp_op)
    ring = kinds.add_parser("ring-attention", help="ring attention vs all-gather-K/V, zigzag vs contiguous, and Ulysses")
    ring.add_argument("--seq", type=int, help="whole sequence length, split over the ranks (default: 2048, rounded "
                      "up to a multiple of 2 x ranks)")
    ring.add_argument("--batch", type=int, default=1)
    ring.add_argument("--heads", type=int, default=8)
    ring.add_argument("--kv-heads", type=int, default=2)
    ring.add_argument("--head-dim", type=int, default=64)
    ring.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 | float64")
    ring.add_argument("--layouts", default="contiguous,zigzag")
    ring.add_argument("--causal", default="both", choices=["both", "true", "false"])
    ring.add_argument("--documents", type=int, default=0,
                      help="pack this many documents into the sequence (segment ids); default 0: one sequence")
    _rank_args(ring, iters=5, warmup=1)
    ring.set_defaults(func=_bench_ring)
    lay = kinds.add_parser("layers", help="one transformer block fwd+bwd: baseline vs decomposed vs auto")
    # defaults (None) are derived from the world size so that it divides them
    lay.add_argument("--seq", type=int, help="default: 1024 (rounded up to a multiple of the ranks)")
    lay.add_argument("--batch", type=int, default=1)
    lay.add_argument("--hidden", type=int, help="default: 512 (rounded up to a multiple of 2 x --heads: an even head dim)")
    lay.add_argument("--heads", type=int, help="default: 8 (rounded up to a multiple of --kv-heads)")
    lay.add_argument("--kv-heads", type=int, help="default: 4 rounded up to a multiple of the number of ranks")
    lay.add_argument("--ffn-hidden", type=int, help="default: 1792 (rounded up to a multiple of the ranks)")
    lay.add_argument("--dtype", default="float32")
    lay.add_argument("--methods", help="default: baseline,decomposed,auto on CPU ranks; + symm,fused on GPUs")
    _rank_args(lay, iters=5, warmup=1)
    lay.set_defaults(func=_bench_layers)
    fs = kinds.add_parser("fsdp", help="ZeRO 1/2/3 step time, prefetch depth, bytes vs 2/3 Psi; torch FSDP2 and DDP "
                                       "on the same model")
    fs.add_argument("--no-peers", action="store_true", help="leave out torch FSDP2's and DDP's rows")
    fs.add_argument("--layers", type=int, default=8)
    fs.add_argument("--width", type=int, default=512)
    fs.add_argument("--batch", type=int, default=64)
    _rank_args(fs, iters=3, warmup=1)
    fs.set_defaults(func=_bench_fsdp)
    pl = kinds.add_parser("pipeline", help="each schedule: measured step vs simulated makespan, bubbles")
    pl.add_argument("--microbatches", type=int, help="default: 8 (rounded up to a multiple of the ranks)")
    pl.add_argument("--width", type=int, default=256)
    pl.add_argument("--batch", type=int, help="default: 64 (rounded up to a multiple of --microbatches)")
    _rank_args(pl, iters=3, warmup=1)
    pl.set_defaults(func=_bench_pipeline)
    every = kinds.add_parser("all", help="every bench kind in turn (small sizes on CPU ranks)")
    every.add_argument("--nproc", type=int, help=f"CPU ranks to spawn when not under torchrun (default {DEFAULT_NPROC})")
    every.add_argument("--csv", metavar="FILE")
    every.add_argument("--json", metavar="FILE", dest="json_out")
    _output_dir_args(every)
    every.set_defaults(func=_bench_all)
    return parser


def _profile_report(args) -> int:
    from .bench.report import format_table
    from .profiling.overlap_report import overlap_report, summarize

    rows = summarize(overlap_report(args.trace))
    if args.json:  # standard JSON: an op with no comm has no hidden fraction (null, not NaN)
        rows = [{k: None if isinstance(v, float) and math.isnan(v) else v for k, v in r.items()} for r in rows]
        print(json.dumps(rows, indent=2, allow_nan=False))
    elif not rows:
        print(f"no op ranges (ok/<op>[<method>]) in {args.trace}: only the fused ops, ring attention, fsdp, "
              "the pipeline runner and the collectives benchmark open them, so the trace holds none of their calls")
    else:  # an op with no comm hides nothing and has no fraction: "-", as JSON's null
        shown = [r | {"hidden": "-" if math.isnan(r["hidden"]) else format(r["hidden"], ".1%")} for r in rows]
        print(format_table(shown, [("op", "op", ""), ("calls", "calls", "d"), ("dur_us", "time(us)", ".0f"),
                                   ("comm_us", "comm busy(us)", ".0f"), ("compute_us", "compute busy(us)", ".0f"),
                                   ("both_us", "overlap(us)", ".0f"), ("hidden", "comm hidden", "")]))
    return 0


def _rank_args(parser, *, iters: int, warmup: int) -> None:
    parser.add_argument("--nproc", type=int, help=f"CPU ranks to spawn when not under torchrun (default {DEFAULT_NPROC})")
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--warmup", type=int, default=warmup)
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds before spawned ranks are killed")
    parser.add_argument("--csv", help="append result rows (with hardware, versions, commit, date) to this CSV")
    parser.add_argument("--json", dest="json_out", metavar="FILE",
                        help="add result rows to this JSON array (JSON Lines when FILE ends in .jsonl)")
    _output_dir_args(parser)


def _output_dir_args(parser) -> None:
    """--profile and --plot: a directory, or the default one when given bare."""
    parser.add_argument("--profile", metavar="DIR", nargs="?", const="traces",
                        help="write a torch.profiler chrome trace per rank into DIR (default: traces)")
    parser.add_argument("--plot", metavar="DIR", nargs="?", const="plots",
                        help="write DIR/<kind>.png (needs matplotlib; default DIR: plots)")


def main(argv=None) -> int:
    global _depth
    args = build_parser().parse_args(argv)
    try:
        _resolve_nproc(args)
        if args.command == "bench":
            from .bench.report import check_output_paths

            check_output_paths(**{name: getattr(args, name, None) for name in ("csv", "json_out", "plot", "profile")})
        if getattr(args, "timeout", None) is not None and not (math.isfinite(args.timeout) and args.timeout > 0):
            raise ValueError(f"--timeout {args.timeout}: expected a finite number of seconds > 0")
        import torch.distributed as dist

        made_here = _depth == 0 and _launched() and not dist.is_initialized()
        _depth += 1
        try:
            code = args.func(args)
        finally:
            _depth -= 1
        _end_process_group(made_here, code)
        return code
    except ValueError as exc:  # bad input: a one-line message, not a traceback
        print(f"overlapkernels: error: {exc}", file=sys.stderr)
        return 2
