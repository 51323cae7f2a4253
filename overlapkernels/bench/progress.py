"""A progress bar for long sweeps (rich, when installed and stderr is a terminal; else silent)."""
from __future__ import annotations

import sys


def track(items, description: str, *, enabled: bool = True):
    items = list(items)
    if not enabled or len(items) < 2 or not sys.stderr.isatty():
        return items
    try:
        from rich.progress import track as rich_track
    except ImportError:
        return items
    return rich_track(items, description=description, transient=True)
