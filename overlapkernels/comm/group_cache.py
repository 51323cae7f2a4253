"""Caches keyed per process group that do not outlive it.

torch hands out the same group names again after ``destroy_process_group`` and a new
``init_process_group`` (a restart inside one process, a test): a cache keyed by name gave the new
group the old one's symmetric buffers or answers. ``group_key`` keys by the group object instead,
and when a name comes back (its old group was destroyed: live groups never share one), or a new
group appears after others were destroyed, it empties every registered cache of the gone groups'
entries, so their buffers are freed with them.
"""
from __future__ import annotations

import torch.distributed as dist

_live: dict = {}   # group name -> the group object last keyed under it (kept alive, so its id stays unique)
_caches: list = []  # dicts whose keys are tuples holding a group_key


def per_group_cache() -> dict:
    """A dict whose keys hold ``group_key(group)``; emptied of a group's entries once it is replaced."""
    cache: dict = {}
    _caches.append(cache)
    return cache


def _forget(name: str) -> None:
    stale = (name, id(_live.pop(name)))
    for cache in _caches:
        for key in [key for key in cache if stale in key]:
            del cache[key]


def _registered() -> set | None:
    """ids of the groups torch still holds (None where its private registry moved)."""
    pg_map = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    return None if pg_map is None else {id(g) for g in pg_map}


def group_key(group: dist.ProcessGroup) -> tuple:
    """A key only this group object has: (name, id). A group seen for the first time also clears
    out groups torch has let go of since (a destroyed subgroup whose name never returns)."""
    name = group.group_name
    if _live.get(name) is not group:
        if name in _live:  # a destroyed group's name, handed out again
            _forget(name)
        held = _registered()
        for gone in [n for n, g in _live.items() if held is not None and id(g) not in held]:
            _forget(gone)
        _live[name] = group
    return name, id(group)
