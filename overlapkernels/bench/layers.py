"""One transformer block, forward + backward, under TP + SP: baseline vs decomposed vs auto (and
symm/fused where the group has peer memory), with the per-(op, method) counters of what actually ran."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..parallel import comm_device
from .metrics import summarize
from .progress import track
from .timing import (DTYPES, available_methods, check_counts, check_dtype, check_sizes, row_times, slowest_rank,
                     telemetry, time_calls)

COLUMNS = [("method", "method", ""), ("seq", "S", "d"), ("hidden", "hidden", "d"), ("time_us", "fwd+bwd(us)", ".0f"),
           ("speedup", "vs base", ".3f"), ("ran", "ran (op: method x calls)", "")]


@dataclass(frozen=True)
class LayersConfig:
    seq: int = 1024
    batch: int = 1
    hidden: int = 512
    heads: int = 8
    kv_heads: int = 4
    ffn_hidden: int = 1792
    dtype: str = "float32"
    methods: tuple = ("baseline", "decomposed", "auto")
    iters: int = 5
    warmup: int = 1

    def validate(self, world: int | None = None) -> None:
        check_counts(self.iters, self.warmup)
        check_dtype(self.dtype)
        check_sizes(seq=self.seq, batch=self.batch, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                    ffn_hidden=self.ffn_hidden)
        bad = [m for m in self.methods if m not in ("baseline", "decomposed", "symm", "fused", "auto")]
        if bad or not self.methods:
            raise ValueError(f"methods={list(self.methods)}: expected a non-empty subset of baseline, decomposed, "
                             "symm, fused, auto")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden={self.hidden}, heads={self.heads}, kv_heads={self.kv_heads}: expected hidden "
                             "divisible by heads and heads by kv_heads")
        if self.hidden // self.heads % 2:
            raise ValueError(f"hidden={self.hidden}, heads={self.heads}: the head dim {self.hidden // self.heads} must be "
                             "even (RoPE rotates pairs of dimensions)")
        if world and any(n % world for n in (self.seq, self.heads, self.kv_heads, self.ffn_hidden)):
            raise ValueError(f"seq={self.seq}, heads={self.heads}, kv_heads={self.kv_heads} and "
                             f"ffn_hidden={self.ffn_hidden} must be divisible by the world size {world}")


def run_layers(cfg: LayersConfig, group=None) -> list[dict]:
    import overlapkernels as ok
    from overlapkernels.layers import TransformerBlock, allreduce_sequence_parallel_grads

    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    cfg.validate(world)
    device = comm_device(group)
    dtype = DTYPES[cfg.dtype]
    rows, times = [], {}
    x = torch.randn(cfg.seq // world, cfg.batch, cfg.hidden, generator=torch.Generator().manual_seed(0))
    x = x.to(device, dtype).requires_grad_()
    methods = available_methods(dict.fromkeys(("baseline", *cfg.methods)), group, device, "layers", dtype)
    for method in track(methods, "layers", enabled=dist.get_rank(group) == 0):  # baseline first: the reference
        torch.manual_seed(0)
        block = TransformerBlock(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, group, sequence_parallel=True,
                                 method=method, dtype=dtype, device=device)

        def step():
            block(x).sum().backward()
            allreduce_sequence_parallel_grads(block, group)

        step()
        ok.reset_overlap_stats()
        with telemetry(device) as tel:
            stats = slowest_rank(summarize(time_calls(step, cfg.iters, cfg.warmup, device, group)), device, group)
        calls = cfg.iters + cfg.warmup
        ran = ", ".join(f"{op}: {m} x{n // calls}" for (op, m), n in sorted(ok.overlap_stats().items()))
        times[method] = stats["median_s"]
        if method in cfg.methods:
            rows.append({"method": method, "seq": cfg.seq, "batch": cfg.batch, "hidden": cfg.hidden,
                         "world_size": world, "backend": dist.get_backend(group), "dtype": cfg.dtype,
                         **row_times(stats), "speedup": times["baseline"] / times[method], "ran": ran,
                         **tel.summary()})
    return rows


def rank_main(config: dict) -> list[dict]:
    return run_layers(LayersConfig(**config))


def config_dict(cfg: LayersConfig) -> dict:
    return asdict(cfg)
