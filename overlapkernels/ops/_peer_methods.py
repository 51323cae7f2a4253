"""``symm`` and ``fused`` on a peer-memory world: symmetric buffers, signal pads, a copy engine.

The world (``group``) offers ``rank``, ``world_size``, ``device``, ``ranks_per_device``,
``wait_timeout`` (seconds a device wait may spin), collective ``alloc_symmetric``, ``workspace``,
a ``side_stream`` (the copy engine) and ``check_errors`` (at once in the thread world; a call late, without host syncs, in the
process world). The thread world provides it on CPU, where every kernel runs under the Triton
interpreter: that is how CI proves these algorithms; with ``device="cuda"`` it runs them
compiled on one GPU; ``comm.process_world`` serves CUDA process groups on one NVLink node.
Workspaces persist per (op, dtype), shared by both methods, their slot buffers grown to the largest call so far;
their flags only grow, so nothing is reset between calls. Every wait gives up after the world's
wait_timeout and the op raises ``SignalTimeoutError`` naming the rank, chunk and peer.

All-gather + matmul, call e on rank r (pads: ready[0:W], released[W:2W]):
  1. wait until every peer released r's slot of call e-1, copy a_shard into it, set ready[r] = e
     in every peer's pad;
  2. copy engine, ring order r+1, r+2, ...: wait ready[c] >= e, pull chunk c into the local
     gathered A, count the read in c's released[r], set the local arrived[c] = e;
  3. symm: per chunk (local first) wait arrived[c], then a GEMM (cuBLAS on GPU);
     fused: one persistent Triton GEMM whose tiles wait on arrived[c] themselves.
Matmul + reduce-scatter (pads: counts[0:W], released[W:2W]):
  1. wait until every owner d released its slots of call e-1;
  2. symm: partial of chunk d = a[d] @ b, pushed by the copy engine into d's slots[r];
     fused: the Triton GEMM's epilogue stores each tile into d's slots[r]; both count in d's pad;
  3. wait for all W counts, sum slots[0..W-1] in that fixed order in fp32, release our slots.
"""
from __future__ import annotations

import contextlib
import math
from functools import partial

import torch

from ..comm.symmetric import SymmetricTensor
from ..kernels.triton import signals as sig
from ..kernels.triton.ag_gemm import ag_gemm
from ..kernels.triton.all_gather import signal_published
from ..kernels.triton.gemm_rs import gemm_rs
from ..kernels.triton.tile_gemm import gemm_config
from ..profiling.ranges import span
from . import _kernel_warmup as warmup
from ._collective_methods import accumulation_dtype


class _Workspace:
    """Symmetric slots and signal pads of one (op, dtype), kept across calls.

    Shapes may change from call to call (variable sequence lengths): each call uses a prefix of
    the slot buffer, which grows geometrically when a call needs more, so a run of changing shapes
    allocates a handful of buffers instead of one per shape (symmetric memory is never freed while
    the process runs, so per-shape buffers would grow without bound). Like every allocation here,
    growing is collective: ranks make the same calls, so they grow at the same call. Pads and
    epochs carry over: the release waits of the next call still refer to the previous one."""

    def __init__(self, world, dtype):
        self.world, self.dtype = world, dtype
        w = world.world_size
        self._buffer = None
        # Outgrown buffers stay referenced: a peer may still be pulling from ours (its previous
        # call), and IPC memory cannot be freed while mapped. Geometric growth keeps their total
        # below the current buffer's size.
        self._outgrown = []
        self.pads = world.alloc_symmetric((2 * w,), sig.FLAG_DTYPE)
        self.arrived = torch.zeros(w, dtype=sig.FLAG_DTYPE, device=world.device)
        self.epoch = 0
        # reduce-scatter: count units every rank has added to each owner's pad so far. Summed per
        # call, not epoch * units: the tile count of a call depends on its K (gemm_config), so two
        # calls of one workspace may count differently.
        self.counted = 0
        # why a call stopped on this rank alone once under way (out of memory, an interrupt): its
        # flags and epoch are out of step with the peers' for good - a later call would spin until
        # its timeout, or pair with the peers' next call and compute with stale slots - so every
        # later call of the workspace raises this at once instead
        self.broken = None

    def open_call(self, op: str) -> int:
        """The next call's epoch; refused on a broken workspace."""
        if self.broken is not None:
            raise RuntimeError(f"{op}: an earlier call on this group stopped mid-protocol ({self.broken}); its "
                               "peer flags are out of step with the other ranks' for good: end the job (every rank), "
                               "or use method='baseline' / 'decomposed'")
        self.epoch += 1
        return self.epoch

    def stopped(self, op: str, exc: BaseException) -> None:
        self.broken = f"{op}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"

    @property
    def capacity(self) -> int:
        """Elements of this rank's slot buffer (0 before the first call)."""
        return 0 if self._buffer is None else self._buffer.local.numel()

    def slots(self, shape) -> SymmetricTensor:
        """This call's slots: a prefix of the buffer, viewed as ``shape``."""
        numel, capacity = math.prod(shape), self.capacity
        if self._buffer is None or numel > capacity:  # (an empty first call still gets a buffer)
            poison = float("nan") if self.dtype.is_floating_point else 0  # a read before a write shows up
            grown = self.world.alloc_symmetric((max(numel, 2 * capacity, 1),), self.dtype, fill=poison)
            if self._buffer is not None:
                self._outgrown.append(self._buffer)
            self._buffer = grown
        return self._buffer.prefix(shape)


def _workspace(world, kind: str, dtype) -> _Workspace:
    """One per (op kind, dtype), shared by ``symm`` and ``fused`` (and the plain reduce-scatter):
    their protocols use the slots and pads alike - the same publish/pull and release flags, counts
    summed per call whatever unit a method counts in - so a call of one may follow a call of the
    other. Symmetric memory is never freed, so a workspace per method would keep the loser's
    buffers for the life of the process wherever both run (auto=measure times both; ~256 MiB a
    rank at TP 8, 1024 rows, N 8192, bf16)."""
    return world.workspace((kind, dtype), lambda w: _Workspace(w, dtype))


def _join_quietly(side) -> None:
    """On an error: wait for the copy stream (it still writes buffers the allocator would reuse),
    without letting a second error hide the first."""
    with contextlib.suppress(Exception):
        side.synchronize()


def _op_name(op: str, method: str) -> str:
    return f"ok/{op}[{method}]"


def ag_matmul(a_shard: torch.Tensor, bs: list, world, method: str) -> tuple:
    r, w = world.rank, world.world_size
    m, k = a_shard.shape
    budget = sig.wait_budget(world.wait_timeout, a_shard.device)
    shard = a_shard.contiguous()
    warmup.warm(world, ("ag", method, shard.shape, shard.dtype,
                        tuple((b.shape, b.stride(), b.data_ptr() % 16) for b in bs)),
                lambda: warmup.all_gather_matmul(world, method, shard, bs, budget))
    # one slot per rank: only our shard is published there (peers pull it; nothing is pushed)
    ws = _workspace(world, "ag", a_shard.dtype)
    slots = ws.slots((m, k))  # (growing it is collective, every rank told of a failure)
    op = _op_name("all_gather_matmul", method)
    epoch, side = ws.open_call(op), world.side_stream()
    try:  # from here on a failure on this rank alone puts its flags out of step: see _Workspace.broken
        err = world.error_record()
        a_flat = torch.empty(w * m, k, dtype=shard.dtype, device=shard.device)  # returned as is, not a view
        a_full = a_flat.view(w, m, k)
        outs = [torch.empty(w * m, b.shape[1], dtype=shard.dtype, device=shard.device) for b in bs]

        # 1. publish: once every reader released our slot of call e-1 (one count per read), fill it
        # and tell everyone. One-program waits, not a waiting copy kernel: spinning blocks must stay
        # few (they hold SMs that peers' kernels may need when ranks share a GPU).
        for reader in range(w):
            if reader != r:
                sig.wait_flag(ws.pads.local[w + reader:w + reader + 1], epoch - 1, err, budget,
                              code=sig.ERR_CONSUMED_TIMEOUT, rank=r, chunk=r, peer=reader)
        slots.local.copy_(shard)
        signal_published(ws.pads.peer_ptrs, epoch, r, w)
        a_full[r].copy_(shard)

        # 2. the copy engine pulls the other chunks in ring order (it writes a_full and err until
        # joined: joined on an error too)
        def pull(src):
            with span(f"ok/ag_matmul/chunk{src}/comm"):
                sig.wait_flag(ws.pads.local[src:src + 1], epoch, err, budget, code=sig.ERR_READY_TIMEOUT, rank=r,
                              chunk=src, peer=src)
                a_full[src].copy_(slots.peer(src))
                sig.add_peer_flag(ws.pads, src, w + r, 1)
                sig.set_flag_now(ws.arrived[src:src + 1], epoch)

        for step in range(1, w):
            side.submit(partial(pull, (r + step) % w))

        # 3. compute as chunks arrive
        if method == "fused":
            with span("ok/ag_matmul/fused_gemm/compute"):
                for b, out in zip(bs, outs):
                    ag_gemm(a_flat, b, out, ws.arrived, err, rank=r, world_size=w, epoch=epoch, budget=budget,
                            ranks_per_device=world.ranks_per_device)
        else:
            for step in range(w):
                c = (r + step) % w
                if c != r:
                    sig.wait_flag(ws.arrived[c:c + 1], epoch, err, budget, code=sig.ERR_READY_TIMEOUT, rank=r, chunk=c,
                                  peer=c)
                with span(f"ok/ag_matmul/chunk{c}/compute"):
                    for b, out in zip(bs, outs):
                        torch.matmul(a_full[c], b, out=out[c * m:(c + 1) * m])
        side.synchronize()
    except BaseException as exc:
        ws.stopped(op, exc)
        _join_quietly(side)
        raise
    world.check_errors(err, op, epoch)
    return a_flat, outs


def _reduce_scatter_partials(world, method: str, dtype, m: int, n: int, device, fill_slots) -> torch.Tensor:
    """Common body of matmul + reduce-scatter and plain reduce-scatter: ``fill_slots(slots, pads,
    err)`` puts this rank's partials into the owners' slots, counts them in the owners' pads and
    returns how many count units each owner waits for."""
    r, w = world.rank, world.world_size
    ws = _workspace(world, "rs", dtype)
    slots = ws.slots((w, m, n))  # (growing it is collective, every rank told of a failure)
    budget = sig.wait_budget(world.wait_timeout, device)
    op = _op_name("matmul_reduce_scatter", method)
    epoch = ws.open_call(op)
    try:  # from here on a failure on this rank alone puts its flags out of step: see _Workspace.broken
        err = world.error_record()
        acc = torch.zeros(m, n, dtype=accumulation_dtype(dtype), device=device)
        out = torch.empty(m, n, dtype=dtype, device=device)
        for owner in range(w):  # 1. may we overwrite our slot at every owner?
            if owner != r:
                sig.wait_flag(ws.pads.local[w + owner:w + owner + 1], epoch - 1, err, budget,
                              code=sig.ERR_CONSUMED_TIMEOUT, rank=r, chunk=owner, peer=owner)
        # 2. (symm: the copy stream reads the partials and writes err until joined: joined on an
        # error too; a partial's GEMM may run out of memory after other pushes were counted)
        ws.counted += fill_slots(slots, ws.pads, err)
        for q in range(w):  # 3. every rank's partial of our chunk is here
            sig.wait_flag(ws.pads.local[q:q + 1], ws.counted, err, budget, code=sig.ERR_PARTIAL_TIMEOUT, rank=r,
                          chunk=r, peer=q)
        world.side_stream().synchronize()
        for q in range(w):  # fixed order: bitwise reproducible whatever order partials arrived in
            acc += slots.local[q]
        out.copy_(acc)
        for q in range(w):  # 4. release our slots for the next call
            if q != r:
                sig.set_peer_flag(ws.pads, q, w + r, epoch)
    except BaseException as exc:
        ws.stopped(op, exc)
        _join_quietly(world.side_stream())
        raise
    # last, as in ag_matmul: on a GPU it may raise an earlier call's timeout (checked a call late);
    # raised before step 4, this call's slots would stay held and every peer's next call time out
    world.check_errors(err, op, epoch)
    return out


def _push_partials(world, slots, pads, partial_of) -> int:
    """symm: the copy engine pushes each partial into its owner's slot, farthest-first order."""
    r, w = world.rank, world.world_size
    side = world.side_stream()

    def push(owner, value):
        with span(f"ok/matmul_rs/chunk{owner}/comm"):
            slots.peer(owner)[r].copy_(value)
            sig.add_peer_flag(pads, owner, r, 1)

    for step in range(w):
        owner = (r + 1 + step) % w
        value = partial_of(owner)
        # the next GEMM overlaps this push; keep_alive stops the allocator from handing the
        # partial's memory to that GEMM while the copy stream still reads it
        side.submit(partial(push, owner, value), keep_alive=(value,))
    return 1


def matmul_rs(a: torch.Tensor, b: torch.Tensor, world, method: str) -> torch.Tensor:
    w = world.world_size
    m, n = a.shape[0] // w, b.shape[1]
    config = gemm_config(a.device, a.dtype, m, n, a.shape[1])
    warmup.warm(world, ("rs", method, a.shape, a.stride(), a.data_ptr() % 16, b.shape, b.stride(), b.data_ptr() % 16,
                        a.dtype),
                lambda: warmup.reduce_scatter(world, method, a, b, m, n, sig.wait_budget(world.wait_timeout, a.device),
                                              config))

    def fill(slots, pads, err):
        if method == "fused":
            return gemm_rs(a, b, slots, pads, rank=world.rank, world_size=w, config=config,
                           ranks_per_device=world.ranks_per_device)
        return _push_partials(world, slots, pads, lambda owner: a[owner * m:(owner + 1) * m] @ b)

    return _reduce_scatter_partials(world, method, a.dtype, m, n, a.device, fill)


def reduce_scatter(x: torch.Tensor, world) -> torch.Tensor:
    """Sum over ranks of ``x``, chunk ``rank`` of dim 0, through the symm protocol (no GEMM)."""
    w = world.world_size
    m = x.shape[0] // w
    # strides and alignment too, as matmul_rs keys them: a strided x pushes through a copy kernel,
    # not a memcpy, and that kernel must be loaded before any rank spins
    warmup.warm(world, ("rs", "symm", x.shape, x.stride(), x.data_ptr() % 16, x.dtype),
                lambda: warmup.reduce_scatter(world, "symm", x, None, m, x.shape[1],
                                              sig.wait_budget(world.wait_timeout, x.device)))
    return _reduce_scatter_partials(world, "symm", x.dtype, m, x.shape[1], x.device,
                                    lambda slots, pads, err: _push_partials(world, slots, pads,
                                                                            lambda d: x[d * m:(d + 1) * m]))
