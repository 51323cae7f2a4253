"""Ring attention benchmark: ring vs the all-gather-K/V baseline, zigzag vs contiguous, and
Ulysses (all-to-all) beside them.

Per (layout, causal): forward time of the all-gather baseline and of the ring, forward+backward of
the ring, the compute alone (every block attended without traffic) and the overlap efficiency
E = 1 - (T_ring - T_compute) / (T_allgather - T_compute). Times are the slowest rank's median;
min_us / max_us are the ring forward's (the time E and TFLOP/s come from). T_compute is timed as
the others are (``time_calls``), though it involves no other rank: E subtracts one from another.
``documents`` > 0: the sequence packs that many documents of (nearly) equal length, masked apart by
segment ids in every timed call; TFLOP/s then counts the attention within documents only.
``ulysses_attention``'s forward and forward+backward are timed last (NaN where the heads do not
split over the ranks): the other way to split attention over CP ranks. Its forward is the public op
(layout moves and output copy included), the ring's its internal forward on [B, H, S, D] tensors.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..ops.sequence_shard import LAYOUTS, segments
from ..ops.ulysses_attention import check_heads
from ..parallel import comm_device
from .metrics import overlap_efficiency, summarize
from .progress import track
from .timing import DTYPES, check_counts, check_dtype, check_sizes, slowest_rank, telemetry, time_calls

COLUMNS = [("layout", "layout", ""), ("causal", "causal", ""), ("seq", "S", "d"), ("documents", "docs", "d"), ("fwd_allgather_us", "AG fwd(us)", ".0f"),
           ("fwd_ring_us", "ring fwd(us)", ".0f"), ("compute_us", "compute(us)", ".0f"),
           ("fwd_bwd_ring_us", "ring f+b(us)", ".0f"), ("speedup", "vs AG", ".3f"), ("efficiency", "E", ".2f"),
           ("tflops_fwd", "TFLOP/s fwd", ".4f"), ("fwd_ulysses_us", "ulysses fwd(us)", ".0f"),
           ("fwd_bwd_ulysses_us", "ulysses f+b(us)", ".0f")]


@dataclass(frozen=True)
class RingConfig:
    batch: int = 1
    seq: int = 2048          # the whole sequence; each rank holds seq / world
    heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    dtype: str = "float32"
    layouts: tuple = ("contiguous", "zigzag")
    causal: tuple = (True, False)
    iters: int = 5
    warmup: int = 1
    documents: int = 0  # packed documents in the sequence (segment ids); 0: one sequence, no ids

    def validate(self, world: int | None = None) -> None:
        check_counts(self.iters, self.warmup)
        check_dtype(self.dtype)
        check_sizes(batch=self.batch, seq=self.seq, heads=self.heads, kv_heads=self.kv_heads, head_dim=self.head_dim)
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if not self.layouts or any(layout not in LAYOUTS for layout in self.layouts):
            raise ValueError(f"layouts={list(self.layouts)}: expected a non-empty subset of {', '.join(LAYOUTS)}")
        if isinstance(self.documents, bool) or not isinstance(self.documents, int) or \
                not 0 <= self.documents <= self.seq:
            raise ValueError(f"documents={self.documents!r}: expected a whole number from 0 to seq={self.seq}")
        if world and self.seq % (2 * world):
            raise ValueError(f"seq={self.seq} must be divisible by 2 x the world size {world} (zigzag)")


def _document_ids(cfg: RingConfig) -> torch.Tensor | None:
    """[B, S] ids of ``cfg.documents`` documents of nearly equal length, in order (None: no ids)."""
    if not cfg.documents:
        return None
    return (torch.arange(cfg.seq) * cfg.documents // cfg.seq).expand(cfg.batch, cfg.seq)


def _rank_ids(ids: torch.Tensor, layout: str, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s part of the [B, S] ids under ``layout`` (shard_sequence's, without its group)."""
    local = ids.shape[1] // world
    return torch.cat([ids[:, start:start + n] for _, start, n in segments(layout, world, rank, local)], dim=1)


def _flops(cfg: RingConfig, world: int, causal: bool) -> float:
    """A rank's attention matmul flops for one forward: 4 B H S_local S D, halved when causal; with
    documents, the same within each document (averaged over the ranks)."""
    lengths = torch.bincount(_document_ids(cfg)[0]).tolist() if cfg.documents else [cfg.seq]
    f = 4 * cfg.batch * cfg.heads * cfg.head_dim * sum(n * n for n in lengths) / world
    return f / 2 if causal else f


def run_ring(cfg: RingConfig, group=None) -> list[dict]:
    import overlapkernels as ok

    ra = importlib.import_module("overlapkernels.ops.ring_attention")
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    cfg.validate(world)
    device = comm_device(group)
    dtype = DTYPES[cfg.dtype]
    local = cfg.seq // world
    scale = 1 / math.sqrt(cfg.head_dim)
    g = torch.Generator().manual_seed(dist.get_rank())
    q = torch.randn(cfg.batch, cfg.heads, local, cfg.head_dim, generator=g).to(device, dtype)
    k, v = (torch.randn(cfg.batch, cfg.kv_heads, local, cfg.head_dim, generator=g).to(device, dtype) for _ in range(2))
    backend = ra.default_backend(q)  # as ok.ring_attention picks (timed beside it): torch for float64
    try:  # the same on every rank: all time ulysses_attention, or none does
        check_heads(cfg.heads, cfg.kv_heads, world)
        splits_heads = True
    except ValueError:
        splits_heads = False
    rows = []
    sweep = [(layout, causal) for layout in cfg.layouts for causal in cfg.causal]
    for layout, causal in track(sweep, "ring-attention", enabled=dist.get_rank(group) == 0):
        def timed(fn):  # -> the slowest rank's {median_s, min_s, max_s}
            return slowest_rank(summarize(time_calls(fn, cfg.iters, cfg.warmup, device, group)), device, group)

        qg, kg, vg = (t.transpose(1, 2).clone().requires_grad_() for t in (q, k, v))
        ids_all = _document_ids(cfg)
        ids = None if ids_all is None else ok.shard_sequence(ids_all.to(device), group, dim=1, layout=layout).contiguous()
        # each rank's ids, for the compute-only timing: it attends to the local K/V in every rank's place
        per_rank = None if ids_all is None else [_rank_ids(ids_all, layout, world, r).to(device) for r in range(world)]

        def fwd_bwd(attention=ok.ring_attention):
            out = attention(qg, kg, vg, group, causal=causal, layout=layout, segment_ids=ids)
            out.backward(torch.ones_like(out))

        with telemetry(device) as tel:
            with torch.no_grad():
                t_ag = timed(lambda: ra.allgather_kv_forward(q, k, v, group, causal, scale, layout,
                                                             backend, segments=ids))["median_s"]
                ring = timed(lambda: ra.ring_forward(q, k, v, group, causal, scale, layout, backend, ids))
                t_comp = timed(lambda: ra.allgather_kv_forward(q, k, v, group, causal, scale, layout, backend,
                                                               communicate=False, segments=ids,
                                                               source_segments=per_rank))["median_s"]
            t_fb = timed(fwd_bwd)["median_s"]
            t_uly = t_uly_fb = math.nan
            if splits_heads:
                with torch.no_grad():
                    t_uly = timed(lambda: ok.ulysses_attention(qg, kg, vg, group, causal=causal, layout=layout,
                                                               segment_ids=ids))["median_s"]
                t_uly_fb = timed(lambda: fwd_bwd(ok.ulysses_attention))["median_s"]
        t_ring = ring["median_s"]
        rows.append({"layout": layout, "causal": causal, "seq": cfg.seq, "documents": cfg.documents,
                     "batch": cfg.batch, "heads": cfg.heads,
                     "kv_heads": cfg.kv_heads, "head_dim": cfg.head_dim, "dtype": cfg.dtype, "world_size": world,
                     "backend": dist.get_backend(group), "kernels": backend, "fwd_allgather_us": t_ag * 1e6,
                     "fwd_ring_us": t_ring * 1e6,
                     "min_us": ring["min_s"] * 1e6, "max_us": ring["max_s"] * 1e6,
                     "compute_us": t_comp * 1e6, "fwd_bwd_ring_us": t_fb * 1e6, "speedup": t_ag / t_ring,
                     "efficiency": overlap_efficiency(t_ring, t_ag, t_comp, world),
                     "tflops_fwd": _flops(cfg, world, causal) / t_ring / 1e12,
                     "fwd_ulysses_us": t_uly * 1e6, "fwd_bwd_ulysses_us": t_uly_fb * 1e6, **tel.summary()})
    return rows


def rank_main(config: dict) -> list[dict]:
    return run_ring(RingConfig(**config))


def config_dict(cfg: RingConfig) -> dict:
    return asdict(cfg)
