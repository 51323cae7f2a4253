"""Routes a resolved method to its implementation, on 2-D operands."""
from __future__ import annotations

from ..kernels.interpreter import bf16_message, bf16_miscomputed
from ..kernels.offsets import fused_dtype_error, fused_sizes_error
from . import _collective_methods as coll
from ._validate import is_peer_world
from .dispatch import PEER_MEMORY_METHODS, capturing


def unavailable_reason(method: str, group, device, dtype=None) -> str | None:
    """Why ``method`` (resolved, not "auto") cannot run on ``group`` with tensors of ``dtype`` on
    ``device``; None when it can. Checked before a call is recorded or anything communicates."""
    if method in PEER_MEMORY_METHODS and capturing(device):
        return (f"method={method!r} cannot be captured in a CUDA graph: its call counters live on the host, so "
                "every replay would wait for flags an earlier call already set and read half-written buffers; "
                "use 'decomposed' or 'baseline'")
    # (the dtype after what the group and device lack: fp64 fused on a CPU process group was told to
    # try 'symm', which that group cannot run either)
    dtype_error = fused_dtype_error(dtype) if method == "fused" and dtype is not None else None
    if is_peer_world(group):
        if method not in PEER_MEMORY_METHODS:
            return f"method={method!r} needs a process group; a thread-world group runs 'symm' or 'fused'"
        if dtype_error:
            return dtype_error
        # fused computes its GEMM tiles in Triton; symm multiplies with torch and only signals in Triton
        if method == "fused" and dtype is not None and bf16_miscomputed(dtype, device):
            return bf16_message("method='fused'") + ", or method='symm'"
        return None
    if method not in PEER_MEMORY_METHODS:
        return None
    if device.type == "cuda":
        # decided where the ranks meet (ProcessPeerWorld's exchange, at the group's first such call),
        # which raises on every rank with each unable rank's reason: a rank refusing alone here left
        # its peers waiting in that exchange until the group's timeout
        return dtype_error
    from ..comm.process_world import peer_memory_unavailable_reason

    reason = peer_memory_unavailable_reason(device)
    if reason:
        return (f"method={method!r} needs peer memory (CUDA tensors on one NVLink node, or a thread-world group in "
                f"CPU tests): {reason}; use 'decomposed' or 'baseline'")
    return dtype_error


def check_available(method: str, group, device, dtype=None) -> None:
    if method != "auto" and (reason := unavailable_reason(method, group, device, dtype)):
        raise ValueError(reason)


def check_fused_sizes(method: str, rows_per_chunk: int, k: int, n: int) -> None:
    """``fused`` on chunks [rows_per_chunk, k] @ [k, n]: refused by size before anything
    communicates. ``n``: every weight's width together (the backward's dual op multiplies by the
    weights concatenated, [n, k]); its three extents are the forward's."""
    if method == "fused" and (error := fused_sizes_error(rows_per_chunk, k, n)):
        raise ValueError(error)


def _peer_world(method: str, group, device, dtype):
    """The world a peer-memory method runs in: the group itself (thread world), or a CUDA process
    group's symmetric-memory world. Errors say what is missing, before anything communicates."""
    if reason := unavailable_reason(method, group, device, dtype):
        raise ValueError(reason)
    if is_peer_world(group) or method not in PEER_MEMORY_METHODS:
        return group if is_peer_world(group) else None
    from ..comm.process_world import process_peer_world

    return process_peer_world(group, device)


def _on(device):
    from ..kernels.triton.tile_gemm import launch_device

    return launch_device(device)


def ag_matmul(a_shard, bs, group, method):
    """-> (a_full [W*m, K], [a_full @ b for b in bs])"""
    world = _peer_world(method, group, a_shard.device, a_shard.dtype)
    if world is not None:
        from . import _peer_methods

        with _on(a_shard.device):
            return _peer_methods.ag_matmul(a_shard, bs, world, method)
    impl = coll.ag_matmul_baseline if method == "baseline" else coll.ag_matmul_decomposed
    return impl(a_shard, bs, group)


def matmul_rs(a, b, group, method):
    """-> sum over ranks of (a @ b), chunk ``rank`` of dim 0"""
    world = _peer_world(method, group, a.device, a.dtype)
    if world is not None:
        from . import _peer_methods

        with _on(a.device):
            return _peer_methods.matmul_rs(a, b, world, method)
    impl = coll.matmul_rs_baseline if method == "baseline" else coll.matmul_rs_decomposed
    return impl(a, b, group)


def ag_wgrad(a_shard, grad_outs, group, method):
    """-> [gather(a_shard).T @ g for g in grad_outs]"""
    if method in PEER_MEMORY_METHODS:
        a_full, _ = ag_matmul(a_shard, [], group, method)
        return [a_full.T @ g for g in grad_outs]
    return coll.ag_wgrad(a_shard, grad_outs, group, method)


def reduce_scatter(x, group):
    """-> sum over ranks of ``x``, chunk ``rank`` of dim 0 (no matmul to overlap with)."""
    if is_peer_world(group):  # (process groups take the collective: there is no GEMM to hide it behind)
        from . import _peer_methods

        with _on(x.device):
            return _peer_methods.reduce_scatter(x, group)
    from ..comm.collectives import reduce_scatter as rs

    return rs(x, group)[0]
