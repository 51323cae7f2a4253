"""On a GPU, every kernel an op will launch is loaded before any rank spins on a flag.

Loading a module can need a context-wide synchronisation (CUDA lazy loading; Triton loads each
compiled kernel at its first launch). If that happens while a kernel of the same context spins on
a flag that only the loading thread's next kernel would set, nothing moves until the wait times
out - and the one-GPU world (ranks as threads of one process, one context) is exactly that. So the
first call of each op signature launches every kernel it uses once on scratch buffers and
synchronises; no launch after that loads anything. Later calls with the same signature skip all
of it. Nothing happens on CPU (the interpreter loads nothing).

Ranks that share a context (the thread world) also meet at barriers around it: a load or a device
synchronise there waits for every rank's kernels. Ranks in processes of their own do not: a load
waits only for its own process's kernels, whose peers keep launching, and a barrier would pair up
wrongly (a hang) the first time a signature part that is the rank's own (the TF32 switch, a
pointer's alignment) differed between ranks.
"""
from __future__ import annotations

import torch

from .._compat import matmul_allows_tf32
from ..kernels.triton import signals as sig
from ..kernels.triton import tile_gemm
from ..kernels.triton.ag_gemm import ag_gemm
from ..kernels.triton.all_gather import signal_published
from ..kernels.triton.gemm_rs import gemm_rs
from ._collective_methods import accumulation_dtype


def warm(world, key, launch_all) -> None:
    """Run ``launch_all()`` once per ``key`` in ``world`` (in a shared context a collective: every
    rank passes the same keys in the same order, as they make the same op calls)."""
    if world.device.type != "cuda":
        return
    done = world.workspace(("kernel-warmup",), lambda _world: set())
    key = (key, matmul_allows_tf32(), tile_gemm._forced)  # both change the compiled variant
    if key in done:
        return
    shared = getattr(world, "shares_context", False)
    # first (in a shared context: every rank's) earlier kernels finish - they may spin until a
    # peer's next launch - then the loads, then nobody spins before everyone has loaded
    if shared:
        world.barrier()
    torch.cuda.synchronize(world.device)
    launch_all()
    torch.cuda.synchronize(world.device)
    if shared:
        world.barrier()
    done.add(key)


class _Scratch:
    """A symmetric-tensor stand-in whose every peer is one local buffer: kernels that write into
    peers' pads and slots write here instead."""

    def __init__(self, shape, dtype, world):
        self.local = torch.zeros(shape, dtype=dtype, device=world.device)
        self.peer_ptrs = torch.full((world.world_size,), self.local.data_ptr(), dtype=torch.int64,
                                    device=world.device)

    def peer(self, rank: int) -> torch.Tensor:
        return self.local


def _signal_kernels(world, budget: sig.WaitBudget) -> None:
    r, w = world.rank, world.world_size
    pads = _Scratch((2 * w,), sig.FLAG_DTYPE, world)
    err = world.error_record()
    sig.wait_flag(pads.local[1:2], 0, err, budget, code=sig.ERR_READY_TIMEOUT, rank=r, chunk=0, peer=0)
    sig.set_flag_now(pads.local[1:2], 0)
    sig.add_peer_flag(pads, 0, 1, 0)
    sig.set_peer_flag(pads, 0, 1, 0)
    signal_published(pads.peer_ptrs, 0, r, w)


def all_gather_matmul(world, method: str, a_shard: torch.Tensor, bs: list, budget: sig.WaitBudget) -> None:
    w, (m, k) = world.world_size, a_shard.shape
    _signal_kernels(world, budget)
    # zeros, not empty: the GEMMs read every chunk, and garbage there can be NaN (a warning under
    # the interpreter, and a needless slow path on some GPUs); first call only, so the fill is free
    a_full = torch.zeros(w * m, k, dtype=a_shard.dtype, device=a_shard.device)
    a_full[:m].copy_(a_shard)
    err = world.error_record()
    arrived = torch.ones(w, dtype=sig.FLAG_DTYPE, device=a_shard.device)  # every chunk "arrived": no wait
    for b in bs:
        out = torch.empty(w * m, b.shape[1], dtype=a_shard.dtype, device=a_shard.device)
        if method == "fused":
            ag_gemm(a_full, b, out, arrived, err, rank=world.rank, world_size=w, epoch=1, budget=budget,
                    ranks_per_device=world.ranks_per_device)
        else:  # every chunk: its offset's alignment can make cuBLAS pick another kernel
            for c in range(w):
                torch.matmul(a_full[c * m:(c + 1) * m], b, out=out[c * m:(c + 1) * m])


def reduce_scatter(world, method: str, a: torch.Tensor, b: torch.Tensor | None, m: int, n: int,
                   budget: sig.WaitBudget, config=None) -> None:
    """``b`` None: the plain reduce-scatter of ``a`` (no GEMM)."""
    w = world.world_size
    _signal_kernels(world, budget)
    slots = _Scratch((w, m, n), a.dtype, world)
    if method == "fused":
        pads = _Scratch((2 * w,), sig.FLAG_DTYPE, world)
        gemm_rs(a, b, slots, pads, rank=world.rank, world_size=w, config=config,
                ranks_per_device=world.ranks_per_device)
    else:
        for c in range(w):  # every chunk offset, as above
            slots.local[c].copy_(a[c * m:(c + 1) * m] @ b if b is not None else a[c * m:(c + 1) * m])
    acc = torch.zeros(m, n, dtype=accumulation_dtype(a.dtype), device=a.device)
    acc += slots.local[0]
    acc.to(a.dtype)  # the cast the real call ends with
