"""A progress bar for long sweeps (rich, when installed and stderr is a terminal; else silent)."""
from __future__ import annotations

import sys


def track(items, description: str, *, enabled: bool = True):
    items = list(items)
    if not enabled or len(items) < 2 or not sys.stderr.isatty():
        return items
    try:
        from rich.console import Console
        from rich.progress import track as rich_track
    except ImportError:
        return items
    # on stderr, the terminal it checked: rich's default (stdout) put a stray line into piped results
    return rich_track(items, description=description, transient=True, console=Console(stderr=True))
