"""Caches keyed per process group that do not outlive it.

torch hands out the same group names again after ``destroy_process_group`` and a new
``init_process_group`` (a restart inside one process, a test): a cache keyed by name gave the new
group the old one's symmetric buffers or answers. ``group_key`` keys by the group object instead,
and when a name comes back (its old group was destroyed: live groups never share one) it empties
every registered cache of the old group's entries, so their buffers are freed with it.
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


def group_key(group: dist.ProcessGroup) -> tuple:
    """A key only this group object has: (name, id)."""
    name = group.group_name
    old = _live.get(name)
    if old is not None and old is not group:
        stale = (name, id(old))
        for cache in _caches:
            for key in [key for key in cache if stale in key]:
                del cache[key]
    _live[name] = group
    return name, id(group)
