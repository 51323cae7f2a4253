"""Tile shapes of the flash attention kernels (``flash_attn``) per device, dtype and head dim, from
compiling candidates for sm_90/sm_86 (scripts/compile_kernels_sm90.py) and, where a GPU has run them,
timing them (benchmarks/results/h200_2026-11-30.md)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .tile_gemm import FP_FUSION, shared_memory_per_block


@dataclass(frozen=True)
class FlashConfig:
    """Tile shape and launch options of one flash kernel: BLOCK_M query rows x BLOCK_N keys."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 3

    def __str__(self) -> str:  # how benchmarks and the compile report name it
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"

    def meta(self) -> dict:
        return dict(BLOCK_M=self.block_m, BLOCK_N=self.block_n, num_warps=self.num_warps, num_stages=self.num_stages,
                    **FP_FUSION)


@dataclass(frozen=True)
class FlashConfigs:
    fwd: FlashConfig
    dkdv: FlashConfig  # a program owns BLOCK_N keys and walks the queries BLOCK_M at a time
    dq: FlashConfig


def _same(cfg: FlashConfig) -> FlashConfigs:
    return FlashConfigs(cfg, cfg, cfg)


# The interpreter is slow: small tiles. GPU configs come from compiling candidates for sm_90 with
# triton 3.6 and 3.9 (scripts/compile_kernels_sm90.py: shared memory, wgmma, ptxas spills); the
# 16-bit D=128 ones (the benchmark's shape) are also timed: on an H200 (triton 3.6, B1 S8192 H32,
# benchmarks/results/h200_2026-11-30.md) the forward's 128x64 w8 s3 beat the other three
# tiles swept, and dK/dV's 64x128 w8 s2 took 7.5 ms (s3: 7.3 ms, 161 KB of shared memory) where
# 32x64 w8 s3 took 17.2 ms. D=64 and D=256 are not timed yet. The dK/dV kernel keeps two fp32
# [BLOCK_N, D] accumulators, so it spills first. Its transposed form (2026-11-30): 64x128 w8 at
# D=128 uses all 255 registers and spills 40-52 B per thread under triton 3.6 (12-28 B under 3.9),
# and was still the fastest; 32x128 at D=64 spills none; 16x64 at D=256 none (3.6) or 4 B (3.9,
# causal). The figures that follow were taken on the earlier form: at D=128 a 64x64 tile with 4 warps
# spilled ~300 B per thread, 32x64 with 8 warps none; at D=256 64x32 with 4 warps (the small-memory
# tile) spills ~100 B and 16x64 with 8 warps none (the only wgmma tile found without spills; 32x64
# with 8 warps needs 1 stage), and dQ's 64x32 spills up to 12 B with 4 warps under triton 3.6, none
# with 8. fp32 (IEEE: FMA, no tensor cores; tests and fp32 users) spilled 13-45 KB per thread in dK/dV
# at 64x64 / 32x32 with 4 warps; with 8 warps 32x32 spills none at D=64, 16x16 none at D=128
# (32x32: ~0.6 KB) and ~0.4 KB at D=256 (16x16 with 4 warps: ~2.3 KB); dQ at D=128 16x64 (84 KB; 32x64
# took 104 KB, over what ~100 KB GPUs have; with TF32 on 16x64 takes 112 KB there: CUDA_FLASH_FP32_SMALL).
INTERPRETER_FLASH = _same(FlashConfig(16, 16))
CUDA_FLASH_16BIT = {64: FlashConfigs(fwd=FlashConfig(128, 64, 8, 3), dkdv=FlashConfig(32, 128, 8, 2),
                                     dq=FlashConfig(128, 64, 8, 3)),
                    128: FlashConfigs(fwd=FlashConfig(128, 64, 8, 3), dkdv=FlashConfig(64, 128, 8, 2),
                                      dq=FlashConfig(128, 64, 8, 3)),
                    256: FlashConfigs(fwd=FlashConfig(64, 32, 4, 2), dkdv=FlashConfig(16, 64, 8, 2),
                                      dq=FlashConfig(64, 32, 8, 2))}
CUDA_FLASH_FP32 = {64: FlashConfigs(fwd=FlashConfig(32, 64, 8, 2), dkdv=FlashConfig(32, 32, 8, 2),
                                    dq=FlashConfig(32, 64, 8, 2)),
                   128: FlashConfigs(fwd=FlashConfig(32, 64, 8, 2), dkdv=FlashConfig(16, 16, 8, 2),
                                     dq=FlashConfig(16, 64, 8, 2)),
                   256: FlashConfigs(fwd=FlashConfig(16, 16, 4, 2), dkdv=FlashConfig(16, 16, 8, 2),
                                     dq=FlashConfig(16, 16, 4, 2))}
# fp32 on GPUs with ~100 KB of shared memory per block (sm_86/89): with TF32 allowed the kernels use
# mma, and dQ's 16x64 at D=128 then takes 112 KB in 2 stages (IEEE: 84 KB); in one stage 80 KB, no
# spills (compiled for sm_86, triton 3.9; checked by hand: compile_kernels_sm90.py compiles for sm_90
# only). The other fp32 tiles up to D=256 fit there with TF32 too (D=512 does not: a test path).
CUDA_FLASH_FP32_SMALL = {**CUDA_FLASH_FP32,
                         128: FlashConfigs(fwd=CUDA_FLASH_FP32[128].fwd, dkdv=CUDA_FLASH_FP32[128].dkdv,
                                           dq=FlashConfig(16, 64, 8, 1))}
# 16-bit on GPUs with ~100 KB of shared memory per block (sm_86/89; compiled for sm_86): at D=256
# 64x32 needs 100 KB in dK/dV and dQ, over the 99 KB such a GPU has.
CUDA_FLASH_SMALL = {128: _same(FlashConfig(64, 32, 4, 2)),
                    256: FlashConfigs(fwd=FlashConfig(64, 32, 4, 2), dkdv=FlashConfig(16, 32, 4, 2),
                                      dq=FlashConfig(32, 32, 4, 2))}
# D > 256, any dtype: 64x32 needs 256 KB in bf16 dQ at D=512 (over sm_90's 227 KB) and spills KBs;
# these take <= 65 KB in 16-bit and spill none in bf16 at D=512. fp32 at D=512 takes 129 KB (too much
# for ~100 KB GPUs) and dK/dV spills 2-8 KB: a test path only.
CUDA_FLASH_WIDE = FlashConfigs(fwd=FlashConfig(16, 16, 4, 2), dkdv=FlashConfig(16, 16, 8, 2), dq=FlashConfig(16, 16, 4, 2))


def _for_head_dim(table: dict, head_dim: int) -> FlashConfigs:
    """The entry of the smallest listed head dim >= ``head_dim``; the wide tiles past the last."""
    fits = [d for d in table if d >= head_dim]
    return table[min(fits)] if fits else CUDA_FLASH_WIDE


_forced: FlashConfigs | None = None


@contextlib.contextmanager
def forced_flash_configs(configs: FlashConfigs):
    """Every flash kernel launched inside uses ``configs`` (benchmark sweeps, tile-shape tests)."""
    global _forced
    previous, _forced = _forced, configs
    try:
        yield configs
    finally:
        _forced = previous


def flash_configs(device: torch.device, dtype: torch.dtype, head_dim: int) -> FlashConfigs:
    """``head_dim``: the padded (power of two, >= 16) head dimension the kernels see."""
    if _forced is not None:
        return _forced
    if device.type != "cuda":
        return INTERPRETER_FLASH
    small = shared_memory_per_block(device) < 160 * 1024
    if dtype == torch.float32:
        return _for_head_dim(CUDA_FLASH_FP32_SMALL if small else CUDA_FLASH_FP32, head_dim)
    return _for_head_dim(CUDA_FLASH_SMALL if small else CUDA_FLASH_16BIT, head_dim)
