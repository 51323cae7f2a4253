"""``baseline`` and ``decomposed`` on 2-D operands, for any process group (gloo or NCCL).

All-gather + matmul:  a_shard [m, K] on each of W ranks, bs [K, N_i]  ->  a_full [W*m, K], outs [W*m, N_i]
Matmul + reduce-scatter:  a [W*m, K], b [K, N] on each rank  ->  sum over ranks of (a @ b)[r*m:(r+1)*m]

``decomposed`` is a ring: chunk c of every operand is rows [c*m, (c+1)*m). It needs no
symmetric memory, so it also works across nodes.
"""
from __future__ import annotations

import contextlib

import torch

from ..comm.collectives import all_gather, reduce_scatter
from ..comm.ring import Ring, settled_on_error, wait_all
from ..profiling.ranges import span


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial sums travel and add in fp32 for 16-bit inputs (fp64 stays fp64)."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _ComputeStreams:
    """On CUDA, chunk GEMMs alternate between the current stream and a side stream, so one chunk's
    tail overlaps the next one's head (less wave quantisation); a no-op on CPU."""

    _side_streams: dict = {}  # one per device: a new pool stream per call would walk torch's stream pool

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.main = torch.cuda.current_stream(device)
            if device not in self._side_streams:
                # Made once (each torch.cuda.Stream() takes the next stream of torch's pool). Default
                # priority, as the main stream: a high-priority GEMM would take freed SMs ahead of the
                # ring's NCCL kernel and start the transfer it should hide late. The price: the pool
                # is ProcessGroupNCCL's too, so with 32+ streams drawn this one may alias an NCCL
                # stream (then its GEMMs queue behind that stream's transfers). Unmeasured either way.
                self._side_streams[device] = torch.cuda.Stream(device)
            self.side = self._side_streams[device]
            self.side.wait_stream(self.main)

    def step(self, s: int):
        if not self.cuda:
            return contextlib.nullcontext()
        return torch.cuda.stream(self.main if s % 2 == 0 else self.side)

    def join(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.side)


def ag_matmul_baseline(a_shard: torch.Tensor, bs: list, group) -> tuple:
    a_full, _ = all_gather(a_shard, group)  # contiguous on the wire: NCCL refuses a strided shard (a q of a qkv)
    return a_full, [a_full @ b for b in bs]


def ring_all_gather(a_shard: torch.Tensor, group, on_chunk, *, alternate_streams: bool = True,
                    name: str = "ag_matmul") -> torch.Tensor:
    """Gather ``a_shard`` around the ring, calling ``on_chunk(c, chunk_c)`` as each chunk is here.

    Step s handles chunk (r + s) % W while it is forwarded to rank r - 1 and chunk
    (r + s + 1) % W arrives from rank r + 1; step 0 is the local chunk, which needs no wait.
    Returns the gathered [W*m, K]. ``alternate_streams=False`` keeps every ``on_chunk`` on the
    current stream, for consumers that accumulate into one buffer.
    """
    ring = Ring.of(group)
    r, world, m = ring.rank, ring.world_size, a_shard.shape[0]
    # returned as allocated, not as a view: an autograd output that is a view cannot be modified
    # in place (out += bias), and the ops return it to callers
    a_flat = a_shard.new_empty((world * m, a_shard.shape[1]))
    a_full = a_flat.view(world, m, a_shard.shape[1])
    a_full[r].copy_(a_shard)
    streams = _ComputeStreams(a_shard.device if alternate_streams else torch.device("cpu"))
    pending = None
    try:
        for s in range(world):
            chunk = (r + s) % world
            with streams.step(s):
                # comm ranges are named by the chunk whose transfer they wait for / start (step 0's is local)
                if pending is not None:
                    with span(f"ok/{name}/chunk{chunk}/comm"):
                        wait_all(pending)  # chunk has arrived (on CUDA: this stream waits, the host does not)
                if s + 1 < world:
                    with span(f"ok/{name}/chunk{(chunk + 1) % world}/comm"):
                        pending = ring.exchange(a_full[chunk], r - 1, a_full[(chunk + 1) % world], r + 1)
                with span(f"ok/{name}/chunk{chunk}/compute"), settled_on_error(pending):  # (see settled_on_error)
                    on_chunk(chunk, a_full[chunk])
    finally:
        # also when a step raises (an out-of-memory that OVERLAPKERNELS_AUTO=measure catches and goes
        # on from): the buffers are freed on the main stream, and without this join the allocator
        # could hand them out while side-stream GEMMs of earlier steps still read and write them
        streams.join()
    return a_flat


def ag_matmul_decomposed(a_shard: torch.Tensor, bs: list, group) -> tuple:
    world, m = Ring.of(group).world_size, a_shard.shape[0]
    outs = [a_shard.new_empty((world * m, b.shape[1])) for b in bs]  # not views: see ring_all_gather

    def multiply(c, chunk):
        for out, b in zip(outs, bs):
            torch.matmul(chunk, b, out=out[c * m:(c + 1) * m])

    a_full = ring_all_gather(a_shard, group, multiply)
    return a_full, outs


def ag_wgrad(a_shard: torch.Tensor, grad_outs: list, group, method: str) -> list:
    """``[gather(a_shard).T @ g for g in grad_outs]`` - the weight gradient of all-gather + matmul
    when only the shard was saved. ``decomposed`` re-gathers around the ring and accumulates each
    chunk's contribution (fp32 for 16-bit) as it arrives, so the re-gather hides behind the GEMMs."""
    if method == "baseline":
        a_full, _ = ag_matmul_baseline(a_shard, [], group)
        return [a_full.T @ g for g in grad_outs]
    m = a_shard.shape[0]
    acc_dtype = accumulation_dtype(a_shard.dtype)
    grads = [torch.zeros(a_shard.shape[1], g.shape[1], dtype=acc_dtype, device=g.device) for g in grad_outs]

    def accumulate(c, chunk):
        for grad, g in zip(grads, grad_outs):
            grad += (chunk.T @ g[c * m:(c + 1) * m]).to(acc_dtype)

    ring_all_gather(a_shard, group, accumulate, alternate_streams=False, name="ag_wgrad")
    return [grad.to(a_shard.dtype) for grad in grads]


def matmul_rs_baseline(a: torch.Tensor, b: torch.Tensor, group) -> torch.Tensor:
    return reduce_scatter(a @ b, group)[0]


def matmul_rs_decomposed(a: torch.Tensor, b: torch.Tensor, group) -> torch.Tensor:
    """Step s computes this rank's partial for chunk d = (r - 1 - s) % W, adds the running sum
    that arrived from rank r - 1 and passes it to rank r + 1. Chunk d's sum starts at rank d + 1
    (the chunk that travels farthest is computed first) and ends at d after W - 1 hops, always
    adding in the order d+1, d+2, ..., d, in fp32 for 16-bit inputs: the result never depends on
    timing."""
    ring = Ring.of(group)
    r, world = ring.rank, ring.world_size
    m = a.shape[0] // world
    acc_dtype = accumulation_dtype(a.dtype)
    chunks = a.view(world, m, a.shape[1])
    recv = [a.new_empty((m, b.shape[1]), dtype=acc_dtype) for _ in range(2)]
    pending, acc = None, None
    for s in range(world):
        with span(f"ok/matmul_rs/chunk{(r - 1 - s) % world}/compute"), settled_on_error(pending):
            partial = chunks[(r - 1 - s) % world] @ b  # overlaps the previous step's transfer
        with span(f"ok/matmul_rs/chunk{(r - 1 - s) % world}/comm"):  # chunk's running sum: in, add, out
            if s == 0:
                acc = partial.to(acc_dtype)
            else:
                wait_all(pending)
                acc = recv[s % 2] + partial.to(acc_dtype)
            if s + 1 < world:
                pending = ring.exchange(acc, r + 1, recv[(s + 1) % 2], r - 1)
    return acc.to(a.dtype)
