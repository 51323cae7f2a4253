"""`overlapkernels demo`: train the small GPT in a 4-D composition (tp=2 x pp=2 by default).

Prints per-step loss beside a single-process reference for the first steps (same weights, same
global batch: the two columns must agree), tokens/s, and the pipeline bubble the simulator
predicts (from the measured per-op times) beside the measured one. The task is synthetic and
learnable (target = (3 * token + 1) mod vocab), so the loss visibly falls.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist


DTYPES = ("float32", "bfloat16", "float16")
HEADS, KV_HEADS = 4, 2  # the demo GPT's attention heads


@dataclass(frozen=True)
class DemoConfig:
    tp: int = 2
    pp: int = 2
    cp: int = 1
    dp: int = 1
    steps: int = 20
    reference_steps: int = 3
    batch: int = 8
    seq: int = 32
    schedule: str = "1f1b"
    vocab: int = 64
    hidden: int = 64
    layers: int = 4
    zero_stage: int = 1
    max_grad_norm: float | None = None  # clip by the whole model's norm (the reference clips too)
    activation_checkpointing: bool = False  # the 4-D run recomputes its blocks (the reference stores)
    reduce_per_microbatch: bool = True  # ZeRO-2/3: False reduces (and ZeRO-3 gathers) once per step
    dtype: str = "float32"  # the weights'; 16-bit: fp32 masters and reductions (float16: loss scaling too)
    cp_attention: str = "ring"  # context-parallel attention: "ring" or "ulysses" (all-to-all)
    compile: str = ""  # a torch.compile backend for the 4-D run's blocks (GPTConfig.compile); "": eager

    def resolved(self, world: int) -> "DemoConfig":
        """This configuration on ``world`` ranks, dp=-1 replaced by the ranks left, once every
        constraint of the composition holds (checked with that dp, not with -1) - before any rank
        starts."""
        from .parallel import resolve_sizes

        cfg = replace(self, dp=resolve_sizes(world, tp=self.tp, cp=self.cp, pp=self.pp, dp=self.dp)["dp"])
        cfg._check_composition()
        return cfg

    @property
    def num_virtual(self) -> int:
        """Model chunks per pipeline rank: two under the interleaved schedule (one would be 1F1B) and
        under zb-v (its V)."""
        return 2 if self.schedule in ("interleaved-1f1b", "zb-v") else 1

    def _check_composition(self) -> None:
        from .models.train import check_compile, check_options
        from .runtime.pipeline import make_schedule

        schedule = make_schedule(self.schedule, self.pp, 2 * self.pp, num_virtual=self.num_virtual)
        problems = []
        try:  # the Trainer's own checks, here before any rank starts
            check_options(self.zero_stage, max_grad_norm=self.max_grad_norm, num_virtual=self.num_virtual,
                          reduce_per_microbatch=self.reduce_per_microbatch)
        except (TypeError, ValueError) as exc:
            problems.append(str(exc))
        try:
            from .layers.attention import check_cp_attention
            from .ops.ulysses_attention import check_heads

            check_cp_attention(self.cp_attention, "cp_attention")
            if self.cp_attention == "ulysses" and self.cp > 1 and KV_HEADS % self.tp == 0:  # (a bad tp: below)
                check_heads(HEADS // self.tp, KV_HEADS // self.tp, self.cp, f"each TP rank ({HEADS} heads / TP {self.tp})")
        except ValueError as exc:
            problems.append(str(exc))
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r}: expected one of {', '.join(DTYPES)}")
        if not isinstance(self.compile, str):
            problems.append(f"compile={self.compile!r}: expected a torch.compile backend name, or '' (eager)")
        else:
            try:
                check_compile(self.compile, schedule, self.schedule)
            except ValueError as exc:
                problems.append(str(exc))
        if not isinstance(self.activation_checkpointing, bool):
            problems.append(f"activation_checkpointing={self.activation_checkpointing!r}: expected a bool")
        if self.steps < 1 or self.reference_steps < 0:
            problems.append(f"steps={self.steps} must be >= 1 (reference_steps={self.reference_steps} >= 0)")
        if KV_HEADS % self.tp:
            problems.append(f"tp={self.tp} must divide the {KV_HEADS} KV heads (so tp is 1 or 2)")
        if self.layers % (self.pp * self.num_virtual):
            chunks = f" x {self.num_virtual} chunks per rank" if self.num_virtual > 1 else ""
            problems.append(f"layers={self.layers} must be divisible by pp={self.pp}{chunks}")
        if self.batch % (self.dp * 2 * self.pp):
            problems.append(f"batch={self.batch} must be divisible by dp x microbatches = {self.dp} x {2 * self.pp}")
        if self.cp > 1 and self.seq % (2 * self.cp):
            problems.append(f"seq={self.seq} must be divisible by 2 x cp = {2 * self.cp} (zigzag)")
        if (self.seq // self.cp) % self.tp:
            problems.append(f"seq / cp = {self.seq // self.cp} must be divisible by tp={self.tp} (sequence parallel)")
        if problems:
            raise ValueError("demo: " + "; ".join(problems))


def add_arguments(parser, default_nproc: int):
    """The `overlapkernels demo` options (each a DemoConfig field, but for the launch's own); returns
    ``parser``."""
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size")
    parser.add_argument("--pp", type=int, default=2, help="pipeline stages")
    parser.add_argument("--cp", type=int, default=1, help="context-parallel size")
    # -1: the ranks left, as init_parallel's dp=-1 (``--tp 1 --pp 2`` on the default 4 ranks runs dp=2)
    parser.add_argument("--dp", type=int, default=-1, help="data-parallel size (tp*pp*cp*dp ranks in all; default: "
                                                           "the ranks left over)")
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--schedule", default="1f1b", help="gpipe | 1f1b | zb-h1 | interleaved-1f1b | zb-v (the last "
                                                         "two: 2 chunks per rank)")
    parser.add_argument("--zero-stage", type=int, default=1, help="ZeRO stage over DP: 1, 2 or 3")
    parser.add_argument("--max-grad-norm", type=float, help="clip by the whole model's gradient norm (the "
                                                             "single-process reference clips too)")
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="recompute each block's forward in backward (the reference does not: they agree)")
    parser.add_argument("--reduce-per-step", action="store_true",
                        help="ZeRO-2/3: accumulate gradients over the microbatches and reduce once per step (ZeRO-3: "
                             "gather once per step) instead of in every microbatch's backward")
    parser.add_argument("--dtype", default="float32", choices=DTYPES,
                        help="the weights' dtype; 16-bit ones keep fp32 masters and reduce in fp32 (float16 also "
                             "scales the loss: fsdp.GradScaler); the reference stays fp32")
    parser.add_argument("--cp-attention", default="ring", choices=("ring", "ulysses"),
                        help="context-parallel attention: ring (K/V blocks around the ring) or ulysses (all-to-alls "
                             "trading the sequence split for a head split)")
    parser.add_argument("--compile", nargs="?", const="inductor", default="", metavar="BACKEND",
                        help="torch.compile each block of the 4-D run (fullgraph; default backend inductor, "
                             "aot_eager skips the C++ build); the reference stays eager")
    parser.add_argument("--nproc", type=int, help=f"CPU ranks to spawn when not under torchrun (default {default_nproc})")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before spawned ranks are killed")
    return parser


def config_from_args(args) -> DemoConfig:
    return DemoConfig(tp=args.tp, pp=args.pp, cp=args.cp, dp=args.dp, steps=args.steps, schedule=args.schedule,
                      zero_stage=args.zero_stage, max_grad_norm=args.max_grad_norm,
                      activation_checkpointing=args.activation_checkpointing,
                      reduce_per_microbatch=not args.reduce_per_step, dtype=args.dtype,
                      cp_attention=args.cp_attention, compile=args.compile)


def _batch(cfg: DemoConfig, step: int):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=g)
    return tokens, (3 * tokens + 1) % cfg.vocab


def rank_main(config: dict) -> list[dict]:
    import overlapkernels as ok
    from overlapkernels.models import GPT, GPTConfig
    from overlapkernels.models.train import Trainer
    from overlapkernels.runtime import fsdp
    from overlapkernels.runtime import pipeline as pp

    cfg = DemoConfig(**config)
    gpt = GPTConfig(vocab_size=cfg.vocab, hidden=cfg.hidden, num_layers=cfg.layers, num_heads=HEADS, num_kv_heads=KV_HEADS,
                    ffn_hidden=2 * cfg.hidden, max_seq_len=cfg.seq, cp_attention=cfg.cp_attention)
    torch.manual_seed(0)
    dense = GPT(gpt, ok.init_parallel())  # every rank: the reference, and the weights everyone starts from
    start = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in dense.state_dict().items()}
    reference, reference_norms = [], []
    if dist.get_rank() == 0:
        opt = torch.optim.AdamW(dense.parameters(), lr=1e-2)
        for step in range(cfg.reference_steps):
            opt.zero_grad()
            loss = dense.loss(*_batch(cfg, step))
            loss.backward()
            if cfg.max_grad_norm is not None:
                reference_norms.append(float(torch.nn.utils.clip_grad_norm_(dense.parameters(), cfg.max_grad_norm)))
            opt.step()
            reference.append(float(loss.detach()))
    dims = ok.init_parallel(tp=cfg.tp, cp=cfg.cp, pp=cfg.pp, dp=cfg.dp)
    dtype = getattr(torch, cfg.dtype)
    low = dtype.itemsize < 4  # 16-bit weights: fp32 reductions, as mixed-precision FSDP2 setups use
    trainer = Trainer(replace(gpt, activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile or False),
                      dims, schedule=cfg.schedule,
                      dense_state_dict=start, zero_stage=cfg.zero_stage, max_grad_norm=cfg.max_grad_norm,
                      num_virtual=cfg.num_virtual, reduce_per_microbatch=cfg.reduce_per_microbatch, dtype=dtype,
                      reduce_dtype=torch.float32 if low else None,
                      grad_scaler=fsdp.GradScaler() if dtype == torch.float16 else None)
    rows = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        loss = trainer.step(*_batch(cfg, step))
        elapsed = time.perf_counter() - t0
        run = trainer.runner
        # per action (a microbatch through one of the rank's chunks): F, B (BW, or zero-bubble's B
        # alone) and W, whose placement zb-h1 is about; the simulator costs each action so
        m = trainer.schedule.num_microbatches * trainer.schedule.num_virtual
        per_op = [run.compute_s["F"], run.compute_s["BW"] + run.compute_s["B"], run.compute_s["W"]]
        measured = torch.tensor([1.0 - sum(run.compute_s.values()) / run.step_s] + [t / m for t in per_op],
                                dtype=torch.float64, device=trainer.device)
        dist.all_reduce(measured, group=dims.pp_group)
        measured /= dims.pp_size
        bubble, t_f, t_b, t_w = measured.tolist()
        sim = pp.simulate(trainer.schedule, t_f=t_f, t_b=t_b, t_w=t_w)
        rows.append({"step": step, "loss": loss, "reference": reference[step] if step < len(reference) else None,
                     "grad_norm": trainer.last_grad_norm,
                     "reference_grad_norm": reference_norms[step] if step < len(reference_norms) else None,
                     "tokens_per_s": cfg.batch * cfg.seq / elapsed, "bubble_measured": bubble,
                     "bubble_simulated": sim.bubble_fraction, "t_f": t_f, "t_b": t_b, "t_w": t_w,
                     "skipped": trainer.last_step_skipped, "device": trainer.device.type})
    return rows if dist.get_rank() == 0 else None


def format_rows(rows: list[dict], cfg: DemoConfig) -> str:
    clip = cfg.max_grad_norm is not None
    lines = [f"# small GPT, {cfg.layers} layers, hidden {cfg.hidden}, batch {cfg.batch} x {cfg.seq} tokens; "
             f"tp={cfg.tp} pp={cfg.pp} cp={cfg.cp}{' (ulysses)' if cfg.cp > 1 and cfg.cp_attention == 'ulysses' else ''} "
             f"dp={cfg.dp}, {cfg.schedule}"
             + (f" ({cfg.num_virtual} chunks per rank)" if cfg.num_virtual > 1 else "") + f", ZeRO-{cfg.zero_stage}"
             + (" reduced once per step" if not cfg.reduce_per_microbatch and cfg.zero_stage > 1 else "")
             + (f", clipped at {cfg.max_grad_norm:g}" if clip else "")
             + (", activation checkpointing" if cfg.activation_checkpointing else "")
             + (f", blocks compiled ({cfg.compile})" if cfg.compile else "")
             + {"float32": "", "bfloat16": ", bfloat16 (fp32 masters and reductions)",
                "float16": ", float16 (fp32 masters and reductions, loss scaling)"}[cfg.dtype]
             + ("; GPU ranks (NCCL)" if rows and rows[0].get("device") == "cuda" else "; CPU ranks (gloo)")
             + ("; the reference is fp32: 16-bit losses agree to that precision" if cfg.dtype != "float32" else ""),
             f"{'step':>4}  {'loss':>8}  {'1-proc ref':>10}  "
             + (f"{'grad norm':>9}  {'1-proc ref':>10}  " if clip else "")
             + f"{'tokens/s':>9}  {'bubble meas.':>12}  {'bubble sim.':>11}"]
    for r in rows:
        ref = f"{r['reference']:.4f}" if r["reference"] is not None else ""
        norms = ""
        if clip:
            ref_norm = f"{r['reference_grad_norm']:.4f}" if r["reference_grad_norm"] is not None else ""
            norms = f"{r['grad_norm']:>9.4f}  {ref_norm:>10}  "
        lines.append(f"{r['step']:>4}  {r['loss']:>8.4f}  {ref:>10}  {norms}{r['tokens_per_s']:>9.0f}  "
                     f"{r['bubble_measured']:>12.1%}  {r['bubble_simulated']:>11.1%}"
                     + ("  skipped: inf/NaN gradients, loss scale halved" if r.get("skipped") else ""))
    return "\n".join(lines)


def config_dict(cfg: DemoConfig) -> dict:
    return asdict(cfg)
