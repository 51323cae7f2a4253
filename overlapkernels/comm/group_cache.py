"""Caches keyed per process group that do not outlive it.

torch hands out the same group names again after ``destroy_process_group`` and a new
``init_process_group`` (a restart inside one process, a test): a cache keyed by name gave the new
group the old one's symmetric buffers or answers. ``group_key`` keys by the group object instead,
and when a name comes back (its old group was destroyed: live groups never share one), or a new
group appears after others were destroyed, it empties every registered cache of the gone groups'
entries. Their values are dropped - except a cache's made with ``keep_values_alive`` (the process
worlds, which hold symmetric memory): those are kept for the life of the process, as every
symmetric buffer is. torch's symmetric memory keeps one rendezvous per allocation block and group
name, and since torch carves ``symm_mem.empty`` tensors out of a memory pool a freed buffer's block
lives on: a new group under the old name could be handed the old group's peer mappings. And a
kernel of the old group still in flight would write into freed memory.
"""
from __future__ import annotations

import torch.distributed as dist

_live: dict = {}   # group name -> the group object last keyed under it (kept alive, so its id stays unique)
_caches: list = []  # (dict whose keys are tuples holding a group_key, whether its values outlive it)
_retired: list = []  # values of keep_values_alive caches whose groups are gone


def retired() -> list:
    """The values ``keep_values_alive`` caches dropped with their groups (still referenced)."""
    return list(_retired)


def per_group_cache(*, keep_values_alive: bool = False) -> dict:
    """A dict whose keys hold ``group_key(group)``; emptied of a group's entries once it is replaced
    (``keep_values_alive``: its values are then kept referenced until the process exits)."""
    cache: dict = {}
    _caches.append((cache, keep_values_alive))
    return cache


def _forget(name: str) -> None:
    stale = (name, id(_live.pop(name)))
    for cache, keep in _caches:
        for key in [key for key in cache if stale in key]:
            value = cache.pop(key)
            if keep:
                _retired.append(value)


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
