"""fsdp.shard benchmark: step time per ZeRO stage and prefetch depth, and the bytes communicated
per step against ZeRO's theory (2 Psi for stages 1-2, 3 Psi for stage 3; Psi = parameter bytes);
beside it the peers on the same model and group: torch's FSDP2 (``fully_shard``, resharding after
forward as ZeRO-3 or not as ZeRO-2) and DDP (ZeRO-0). Their bytes are not counted (nan)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..parallel import comm_device
from ..profiling.ranges import span
from .metrics import summarize
from .progress import track
from .timing import check_counts, row_times, slowest_rank, telemetry, time_calls

COLUMNS = [("impl", "impl", ""), ("stage", "stage", "d"), ("prefetch", "prefetch", "d"), ("time_us", "step(us)", ".0f"),
           ("comm_psi", "comm / Psi", ".2f"), ("theory_psi", "theory", ".0f"),
           ("param_mb", "params kept(MB)", ".2f"), ("peak_param_mb", "peak gathered(MB)", ".2f")]


@dataclass(frozen=True)
class FsdpConfig:
    layers: int = 8
    width: int = 512
    batch: int = 64
    stages: tuple = (1, 2, 3)
    prefetches: tuple = (0, 1, 2)
    iters: int = 3
    warmup: int = 1
    peers: bool = True  # torch FSDP2 (ZeRO-3 and ZeRO-2 resharding) and DDP on the same model

    def validate(self) -> None:
        check_counts(self.iters, self.warmup)
        bad = [s for s in self.stages if s not in (1, 2, 3)] + [p for p in self.prefetches if p < 0]
        if bad or min(self.layers, self.width, self.batch) < 1:
            raise ValueError(f"stages={self.stages}, prefetches={self.prefetches}, layers={self.layers}, "
                             f"width={self.width}, batch={self.batch}: expected stages in 1-3, prefetch >= 0, "
                             "sizes >= 1")


def _model(cfg: FsdpConfig, device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(cfg.width, cfg.width), nn.GELU()) for _ in range(cfg.layers)]
                         ).to(device)


def run_fsdp(cfg: FsdpConfig, group=None) -> list[dict]:
    cfg.validate()
    group = group or dist.group.WORLD
    device = comm_device(group)
    x = torch.randn(cfg.batch, cfg.width, device=device)
    sweep = [(stage, prefetch) for stage in cfg.stages
             for prefetch in (cfg.prefetches if stage == 3 else (0,))]  # prefetch only acts on stage 3
    # one configuration per call: its model is freed before the next is built
    rows = [_our_row(cfg, group, device, x, stage, prefetch)
            for stage, prefetch in track(sweep, "fsdp", enabled=dist.get_rank(group) == 0)]
    return rows + ([_peer_row(cfg, group, device, x, *peer) for peer in _peers(cfg, group, device)] if cfg.peers else [])


def _our_row(cfg: FsdpConfig, group, device, x, stage: int, prefetch: int) -> dict:
    from ..runtime import fsdp

    sharded = fsdp.shard(_model(cfg, device), group, stage=stage, prefetch=prefetch)

    def step():
        loss = sharded(x).square().mean()
        # fsdp opens the forward's op range; this one shows the reduce-scatters behind backward
        with span(f"ok/fsdp[zero{stage}]/backward"):
            loss.backward()
        sharded.step()

    step()
    sharded.comm_stats(reset=True)
    with telemetry(device) as tel:
        stats = slowest_rank(summarize(time_calls(step, cfg.iters, cfg.warmup, device, group)), device, group)
    comm = sharded.comm_stats()
    psi = sum(u.flat_bytes for u in sharded.all_units)
    mem = sharded.memory_stats()
    return {"impl": "overlapkernels", "variant": f"ours, prefetch {prefetch}", "stage": stage, "prefetch": prefetch,
            "world_size": dist.get_world_size(group), "backend": dist.get_backend(group), **row_times(stats),
            "comm_psi": (comm["gathered_bytes"] + comm["reduced_bytes"]) / psi / (cfg.iters + cfg.warmup),
            "theory_psi": 3 if stage == 3 else 2, "param_mb": mem["param_bytes"] / 2**20,
            "peak_param_mb": mem["peak_gathered_param_bytes"] / 2**20, **tel.summary()}


def _peers(cfg: FsdpConfig, group, device) -> list:
    """(impl, ZeRO stage whose traffic it matches, a builder of its model) of the peers this torch has."""
    from torch.nn.parallel import DistributedDataParallel

    found = []
    try:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # (torch < 2.6: no public fully_shard; DDP only)
        fully_shard = None

    def fsdp2(reshard: bool):
        model = _model(cfg, device)
        mesh = DeviceMesh.from_group(group, device.type)
        for layer in model:  # per layer, then the root: FSDP2's recipe (and our default units)
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        return fully_shard(model, mesh=mesh, reshard_after_forward=reshard)

    if fully_shard is not None:  # resharding after forward or not: ZeRO-3's or ZeRO-2's traffic (a shard kept at rest)
        found += [("torch FSDP2", 3, lambda: fsdp2(True)), ("torch FSDP2", 2, lambda: fsdp2(False))]
    found.append(("torch DDP", 0, lambda: DistributedDataParallel(_model(cfg, device), process_group=group)))
    return found


def _peer_row(cfg: FsdpConfig, group, device, x, impl: str, stage: int, build) -> dict:
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # fsdp.shard's default optimizer

    def step():
        with span(f"ok/fsdp[{impl.replace(' ', '-').lower()}-zero{stage}]"):  # (an op window: profile report)
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()

    step()
    with telemetry(device) as tel:
        stats = slowest_rank(summarize(time_calls(step, cfg.iters, cfg.warmup, device, group)), device, group)
    local = sum(_local(p).numel() * p.element_size() for p in model.parameters())
    return {"impl": impl, "variant": impl, "stage": stage, "prefetch": None,  # (no such setting)
            "world_size": dist.get_world_size(group), "backend": dist.get_backend(group), **row_times(stats),
            "comm_psi": float("nan"), "theory_psi": 3 if stage == 3 else 2, "param_mb": local / 2**20,
            "peak_param_mb": float("nan"), **tel.summary()}


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's memory on this rank: FSDP2's are DTensors sharded over the group."""
    return p.to_local() if hasattr(p, "to_local") else p


def rank_main(config: dict) -> list[dict]:
    return run_fsdp(FsdpConfig(**config))


def config_dict(cfg: FsdpConfig) -> dict:
    return asdict(cfg)
