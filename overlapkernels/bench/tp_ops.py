"""all_gather_matmul / matmul_reduce_scatter benchmark: every method on Llama-3 TP layer shapes.

Shapes are (M, K, N) of the unsharded layer: M tokens (seq x batch), K in, N out. Column-parallel
layers (qkv, fc1) run all-gather + GEMM: a_shard [M/W, K] @ b [K, N/W]. Row-parallel layers
(attn_out, fc2) run GEMM + reduce-scatter: a [M, K/W] @ b [K/W, N] -> [M/W, N]. On CPU the
presets are scaled down 8x in every dim (gloo would take minutes at full size).

Per row: median, min and max time (each the largest over ranks), TFLOP/s of this rank's GEMM (2 m k n /
T with this rank's m, k, n: what compares with one GPU's peak; M K N in the row are the layer's), speedup vs baseline,
and Flux's overlap efficiency E = 1 - (T - T_gemm) / (T_baseline - T_gemm), with T_gemm this rank's
GEMM alone, timed as every method is (``time_calls``: E subtracts one time from another, so they
must come from one timer). Methods this group cannot run (symm/fused without peer memory) are
skipped with the reason.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..parallel import comm_device
from .metrics import overlap_efficiency, summarize
from .progress import track
from .timing import (DTYPES, available_methods, check_counts, check_dtype, row_times, slowest_rank,
                     telemetry, time_calls)

# hidden, ffn, q heads, kv heads, head dim
MODELS = {"llama3-8b": (4096, 14336, 32, 8, 128), "llama3-70b": (8192, 28672, 64, 8, 128)}
TOKENS = 8192
CPU_SCALE = 8
OPS = {"ag-matmul": ("qkv", "fc1"), "matmul-rs": ("attn_out", "fc2")}
COLUMNS = [("layer", "layer", ""), ("M", "M", "d"), ("K", "K", "d"), ("N", "N", "d"), ("method", "method", ""),
           ("time_us", "time(us)", ".1f"), ("tflops", "TFLOP/s/rank", ".4f"), ("speedup", "vs base", ".3f"),
           ("efficiency", "E", ".2f")]


def layer_shapes(model: str, scale: int = 1) -> dict[str, tuple[int, int, int]]:
    hidden, ffn, heads, kv_heads, head_dim = MODELS[model]
    qkv = (heads + 2 * kv_heads) * head_dim
    shapes = {"qkv": (TOKENS, hidden, qkv), "fc1": (TOKENS, hidden, 2 * ffn), "attn_out": (TOKENS, hidden, hidden),
              "fc2": (TOKENS, ffn, hidden)}
    return {name: tuple(max(1, d // scale) for d in dims) for name, dims in shapes.items()}


def _check_shape(name, m, k, n) -> None:
    if min(m, k, n) < 1:  # an empty operand would only fail inside the ranks
        raise ValueError(f"shape {name!r} = {m}x{k}x{n}: expected M, K and N >= 1")


def parse_shapes(text: str, op: str, scale: int) -> list[tuple[str, tuple[int, int, int]]]:
    """``"llama3-8b"`` (that model's layers for ``op``) or ``"MxKxN,MxKxN"``."""
    out = []
    for item in text.split(","):
        item = item.strip()
        if item in MODELS:
            shapes = layer_shapes(item, scale)
            out += [(f"{item}/{layer}", shapes[layer]) for layer in OPS[op]]
            continue
        try:
            m, k, n = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise ValueError(f"shape {item!r}: expected a model ({', '.join(MODELS)}) or MxKxN") from None
        _check_shape(item, m, k, n)
        out.append((item, (m, k, n)))
    return out


@dataclass(frozen=True)
class TpOpsConfig:
    op: str = "ag-matmul"
    shapes: tuple = ()
    methods: tuple = ("baseline", "decomposed")
    dtype: str = "float32"
    iters: int = 10
    warmup: int = 2

    def validate(self, world: int | None = None) -> None:
        check_counts(self.iters, self.warmup)
        if self.op not in OPS:
            raise ValueError(f"op={self.op!r}: expected one of {list(OPS)}")
        check_dtype(self.dtype)
        bad = [m for m in self.methods if m not in ("baseline", "decomposed", "symm", "fused", "auto")]
        if bad or not self.methods:
            raise ValueError(f"methods={list(self.methods)}: expected a non-empty subset of baseline, decomposed, "
                             "symm, fused, auto")
        for name, (m, k, n) in self.shapes:
            _check_shape(name, m, k, n)
            split = (m, n) if self.op == "ag-matmul" else (m, k)
            if world and any(d % world for d in split):
                raise ValueError(f"shape {name} = {m}x{k}x{n}: {'M and N' if self.op == 'ag-matmul' else 'M and K'} "
                                 f"must be divisible by the world size {world} (pass --shapes MxKxN)")


def _operands(op, m, k, n, world, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(dist.get_rank())
    if op == "ag-matmul":
        a, b = torch.randn(m // world, k, generator=g), torch.randn(k, n // world, generator=g)
        gemm_shape = (m, k, n // world)
    else:
        a, b = torch.randn(m, k // world, generator=g), torch.randn(k // world, n, generator=g)
        gemm_shape = (m, k // world, n)
    return a.to(device, dtype), b.to(device, dtype), gemm_shape


def run_tp_ops(config: TpOpsConfig, group=None) -> list[dict]:
    import overlapkernels as ok

    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    config.validate(world)
    device = comm_device(group)
    dtype = DTYPES[config.dtype]
    fn = ok.all_gather_matmul if config.op == "ag-matmul" else ok.matmul_reduce_scatter
    methods = available_methods(dict.fromkeys(("baseline", *config.methods)), group, device, config.op, dtype)
    rows = []
    with torch.no_grad():
        for name, (m, k, n) in track(config.shapes, config.op, enabled=dist.get_rank(group) == 0):
            a, b, (gm, gk, gn) = _operands(config.op, m, k, n, world, dtype, device)
            a_full = torch.randn(gm, gk).to(device, dtype)  # this rank's GEMM alone: what overlap can reach
            t_gemm = slowest_rank(summarize(time_calls(lambda: a_full @ b, config.iters, config.warmup, device,
                                                       group)), device, group)["median_s"]
            times = {}
            for method in methods:  # baseline first: the reference
                with telemetry(device) as tel:
                    stats = slowest_rank(summarize(time_calls(lambda: fn(a, b, group, method=method), config.iters,
                                                              config.warmup, device, group,
                                                              f"bench {config.op} {name} [{method}]")),
                                         device, group)
                t = times[method] = stats["median_s"]
                if method not in config.methods:
                    continue
                rows.append({"op": config.op, "layer": name, "M": m, "K": k, "N": n, "method": method,
                             "world_size": world, "backend": dist.get_backend(group), "dtype": config.dtype,
                             **row_times(stats), "gemm_us": t_gemm * 1e6, "tflops": 2 * gm * gk * gn / t / 1e12,
                             "speedup": times["baseline"] / t,
                             "efficiency": overlap_efficiency(t, times["baseline"], t_gemm, world), **tel.summary()})
    return rows


def rank_main(config_dict: dict) -> list[dict]:
    return run_tp_ops(TpOpsConfig(**config_dict))


def config_dict(config: TpOpsConfig) -> dict:
    return asdict(config)
