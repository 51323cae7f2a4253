"""Pipeline benchmark: per schedule kind, the measured step time against the simulator's makespan
(fed with the measured per-op times), and measured vs simulated bubble. The step time is the
slowest rank's median (min_us / max_us: the largest over ranks of each one's fastest and slowest
step) after ``warmup`` untimed steps; per-op times (the simulator's inputs) and the measured bubble
(1 - compute / step time, both summed over the timed steps) are averaged over ranks."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from ..parallel import comm_device
from .metrics import summarize
from .progress import track
from .timing import check_counts, check_sizes, slowest_rank, telemetry

COLUMNS = [("kind", "kind", ""), ("microbatches", "m", "d"), ("step_us", "step(us)", ".0f"),
           ("sim_us", "simulated(us)", ".0f"), ("ratio", "meas/sim", ".2f"), ("bubble_measured", "bubble meas.", ".1%"),
           ("bubble_simulated", "bubble sim.", ".1%"), ("bubble_theory", "theory", ".1%")]


@dataclass(frozen=True)
class PipelineBenchConfig:
    kinds: tuple = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-v")
    microbatches: int = 8
    width: int = 256
    layers_per_stage: int = 4
    batch: int = 64
    iters: int = 3
    warmup: int = 1  # untimed steps first (the first one also exchanges activation shapes)

    def validate(self, world: int | None = None) -> None:
        from ..runtime.pipeline import KINDS

        check_counts(self.iters, self.warmup)
        check_sizes(microbatches=self.microbatches, width=self.width, layers_per_stage=self.layers_per_stage,
                    batch=self.batch)
        bad = [k for k in self.kinds if k not in KINDS]
        if bad or not self.kinds:
            raise ValueError(f"kinds={list(self.kinds)}: expected a non-empty subset of {list(KINDS)}")
        if self.batch % self.microbatches or self.layers_per_stage % 2:
            raise ValueError(f"batch={self.batch} must be divisible by microbatches={self.microbatches}, and "
                             f"layers_per_stage={self.layers_per_stage} even (interleaving and zb-v halve it)")
        if world and "interleaved-1f1b" in self.kinds and self.microbatches % world:
            raise ValueError(f"microbatches={self.microbatches} must be a multiple of the world size {world} "
                             "for interleaved-1f1b")


def run_pipeline(cfg: PipelineBenchConfig, group=None) -> list[dict]:
    from ..runtime import pipeline as pp

    group = group or dist.group.WORLD
    p, rank = dist.get_world_size(group), dist.get_rank(group)
    cfg.validate(p)
    device = comm_device(group)
    rows = []
    for kind in track(cfg.kinds, "pipeline", enabled=rank == 0):
        sched = pp.make_schedule(kind, p, cfg.microbatches, num_virtual=2 if kind == "interleaved-1f1b" else 1)
        v = sched.num_virtual  # (zb-v: 2)
        torch.manual_seed(0)
        layers = cfg.layers_per_stage // v
        stages = [nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(cfg.width, cfg.width), nn.GELU())]
                                ).to(device) for _ in range(v)]
        if any(a.op == "W" for acts in sched.actions for a in acts):
            for s in stages:
                pp.enable_zero_bubble(s)
        runner = pp.PipelineRunner(stages if v > 1 else stages[0], group, schedule=sched, loss_fn=F.mse_loss)
        x = torch.randn(cfg.batch, cfg.width, device=device)
        last = sched.rank_of(sched.num_stages - 1) == rank
        times, ops = [], {"F": 0.0, "B": 0.0, "W": 0.0, "BW": 0.0}
        with telemetry(device) as tel:
            for i in range(cfg.warmup + cfg.iters):
                dist.barrier(group=group)
                runner.step(x if rank == 0 else None, x if last else None)
                if i >= cfg.warmup:
                    times.append(runner.step_s)
                    for k in ops:
                        ops[k] += runner.compute_s[k]  # (step() resets both: summed over the timed steps)
        step = slowest_rank(summarize(times), device, group)
        n = cfg.iters * cfg.microbatches * v
        per = torch.tensor([ops["F"] / n, (ops["B"] + ops["BW"]) / n, ops["W"] / n,
                            1 - sum(ops.values()) / sum(times)], dtype=torch.float64, device=device)
        dist.all_reduce(per, group=group)
        per /= p
        t_f, t_b, t_w, bubble = per.tolist()
        step_s = step["median_s"]
        sim = pp.simulate(sched, t_f=t_f, t_b=t_b, t_w=t_w)
        # the published bubbles: GPipe/1F1B (p-1)/(m+p-1) at t_F = t_B, interleaved v chunks (p-1)/(vm+p-1);
        # ZB-H1 a third of 1F1B's bubble time at t_F = t_B = t_W, i.e. (p-1)/(3m+p-1) of the step; ZB-V
        # at equal chunk costs (p-1)/(6m+p-1) from m = 2p-1 on (each rank idles p-1 forwards in all: r
        # before its first action, p-1-r after its last), and what those costs give with fewer microbatches
        if kind == "zb-v":
            theory = pp.simulate(sched, t_f=1.0, t_b=1.0, t_w=1.0).bubble_fraction
        else:
            theory = (p - 1) / ((3 if kind == "zb-h1" else v) * cfg.microbatches + p - 1)
        rows.append({"kind": kind, "microbatches": cfg.microbatches, "world_size": p, "backend": dist.get_backend(group),
                     "step_us": step_s * 1e6, "min_us": step["min_s"] * 1e6, "max_us": step["max_s"] * 1e6,
                     "sim_us": sim.makespan * 1e6, "ratio": step_s / sim.makespan,
                     "bubble_measured": bubble, "bubble_simulated": sim.bubble_fraction,
                     "bubble_theory": theory, **tel.summary()})
    return rows


def rank_main(config: dict) -> list[dict]:
    return run_pipeline(PipelineBenchConfig(**config))


def config_dict(cfg: PipelineBenchConfig) -> dict:
    return asdict(cfg)
