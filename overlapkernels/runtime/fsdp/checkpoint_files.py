"""Where a checkpoint lives on disk: the atomic switch from ``<path>.tmp`` (the previous one kept as
``<path>.old`` until the new one is in place), rank 0's filesystem steps told to every rank, and
whether every rank sees what rank 0 wrote (storage that is not shared by all nodes)."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import time

import torch.distributed as dist

from ... import _compat

META = "overlapkernels_fsdp.json"

# How long a rank keeps looking for a checkpoint another rank wrote before calling it unreachable:
# NFS caches directory lookups (acdirmin, 30 s by default, but listing the folder revalidates it)
VISIBILITY_WAIT_S = 10.0


def _sees(path: str) -> bool:
    """Whether this rank sees the checkpoint at ``path``, waiting up to VISIBILITY_WAIT_S for it."""
    meta = os.path.join(path, META)
    # the ranks that see it wait in a collective meanwhile: stay well inside the group's timeout
    timeout = _compat.group_timeout(dist.group.WORLD)
    wait = min(VISIBILITY_WAIT_S, timeout.total_seconds() / 4) if timeout is not None else VISIBILITY_WAIT_S
    deadline = time.monotonic() + wait
    while not os.path.exists(meta):
        if time.monotonic() >= deadline:
            return False
        with contextlib.suppress(OSError):  # listing the parent refreshes a network filesystem's view
            os.listdir(os.path.dirname(path) or ".")
        time.sleep(0.2)
    return True


def _every_rank_sees(path: str, what: str) -> None:
    """Raise on every rank unless every rank sees the checkpoint at ``path`` (a collective). Rank 0
    alone renames and writes the metadata: on storage that is not shared by all nodes, the others'
    shards stayed in their own temp folders, and a load would find nothing there."""
    seen = [None] * dist.get_world_size()
    dist.all_gather_object(seen, _sees(path))
    if blind := [r for r, ok in enumerate(seen) if not ok]:
        raise RuntimeError(f"{what}: ranks {blind} cannot see the checkpoint {path!r} that rank 0 sees; every rank "
                           "must reach it through one filesystem shared by all nodes")


def _switch(tmp: str, path: str, old: str) -> None:
    if os.path.exists(path):
        if os.path.exists(old):  # a crash after the last switch left both: path is the newer
            shutil.rmtree(old)
        os.replace(path, old)
    # (path missing and old present: a crash between the two renames - old is the one to keep)
    os.replace(tmp, path)
    if os.path.exists(old):
        shutil.rmtree(old)


def _on_rank0_for_all(fn, what: str) -> None:
    """Run ``fn`` on world rank 0 and tell every rank how it went (a collective, so it is also the
    barrier after it): a failure there (a full disk, a permission) raises on every rank instead of
    leaving the others waiting for a rank that already gave up."""
    error = None
    if dist.get_rank() == 0:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
    told = [None if error is None else f"{type(error).__name__}: {error}"]
    dist.broadcast_object_list(told, src=0)
    if told[0] is not None:
        raise RuntimeError(f"fsdp.save: {what} failed on rank 0: {told[0]}") from error


def _find(path: str) -> tuple:
    """(the checkpoint's path, its metadata, None), or (path, None, the error to raise on every rank)."""
    if not os.path.exists(os.path.join(path, META)) and os.path.exists(os.path.join(path + ".old", META)):
        path += ".old"  # a save was interrupted between its two renames
    meta_file = os.path.join(path, META)
    if not os.path.exists(meta_file):
        return path, None, FileNotFoundError(f"no overlapkernels FSDP checkpoint at {path!r}")
    try:
        with open(meta_file) as f:
            return path, json.load(f), None
    except (OSError, ValueError) as exc:
        return path, None, RuntimeError(f"fsdp.load: cannot read {meta_file!r}: {type(exc).__name__}: {exc}")
