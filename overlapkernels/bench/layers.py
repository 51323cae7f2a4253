"""One transformer block, forward + backward, under TP + SP: baseline vs decomposed vs auto, with
the per-(op, method) counters of what actually ran."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .metrics import summarize
from .timing import DTYPES, check_counts, check_dtype, slowest_rank, time_calls

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
        if world and (self.seq % world or self.kv_heads % world or self.ffn_hidden % world):
            raise ValueError(f"seq={self.seq}, kv_heads={self.kv_heads} and ffn_hidden={self.ffn_hidden} must be "
                             f"divisible by the world size {world}")


def run_layers(cfg: LayersConfig, group=None) -> list[dict]:
    import overlapkernels as ok
    from overlapkernels.layers import TransformerBlock, allreduce_sequence_parallel_grads

    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    cfg.validate(world)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else \
        torch.device("cpu")
    dtype = DTYPES[cfg.dtype]
    rows, times = [], {}
    x = torch.randn(cfg.seq // world, cfg.batch, cfg.hidden, generator=torch.Generator().manual_seed(0))
    x = x.to(device, dtype).requires_grad_()
    for method in dict.fromkeys(("baseline", *cfg.methods)):
        torch.manual_seed(0)
        block = TransformerBlock(cfg.hidden, cfg.heads, cfg.kv_heads, cfg.ffn_hidden, group, sequence_parallel=True,
                                 method=method, dtype=dtype, device=device)

        def step():
            block(x).sum().backward()
            allreduce_sequence_parallel_grads(block, group)

        step()
        ok.reset_overlap_stats()
        t = slowest_rank(summarize(time_calls(step, cfg.iters, cfg.warmup, device, group)), device, group)["median_s"]
        calls = cfg.iters + cfg.warmup
        ran = ", ".join(f"{op}: {m} x{n // calls}" for (op, m), n in sorted(ok.overlap_stats().items()))
        times[method] = t
        if method in cfg.methods:
            rows.append({"method": method, "seq": cfg.seq, "batch": cfg.batch, "hidden": cfg.hidden,
                         "world_size": world, "backend": dist.get_backend(group), "dtype": cfg.dtype,
                         "time_us": t * 1e6, "speedup": times["baseline"] / t, "ran": ran})
    return rows


def rank_main(config: dict) -> list[dict]:
    return run_layers(LayersConfig(**config))


def config_dict(cfg: LayersConfig) -> dict:
    return asdict(cfg)
