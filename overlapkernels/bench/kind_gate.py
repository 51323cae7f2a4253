"""`bench all` under torchrun: the ranks agree, kind by kind, whether to run it, so a kind one rank
cannot run is skipped by every rank rather than leave the others waiting in its collectives."""
from __future__ import annotations

import os
import sys


class KindSkipped(Exception):
    """Under torchrun, a rank of `bench all` voted not to run the kind: every rank skips it."""


class KindGate:
    """`bench all` under torchrun: before a kind's first collective every rank votes whether it will
    run the kind, and the kind runs only if every rank will. A rank that fails before communicating
    (sizes this world cannot take, an output path its node cannot write) thus makes every rank skip
    the kind, where alone it would go on to the next kind's collectives while the others wait in
    this one's. The vote is a gloo all_reduce on a group of its own with a timeout: it never mixes
    with a kind's own traffic, and a peer that never votes (dead, stuck) ends in an error, not a hang.

    ``stage`` says how far the current kind got on this rank: "before" its vote, "voting",
    "running" (voted to run, in its collectives), "done" (they completed), "skipped"."""

    def __init__(self, timeout=None):
        import torch.distributed as dist

        from ..parallel import DEFAULT_TIMEOUT, init_default_process_group

        init_default_process_group()
        self._group = dist.new_group(backend="gloo", timeout=timeout or DEFAULT_TIMEOUT)
        self.stage = "before"

    def vote(self, run: bool) -> bool:
        """True when every rank votes to run the kind (then this rank runs it if it voted to)."""
        import torch
        import torch.distributed as dist

        self.stage = "voting"
        flag = torch.tensor([int(run)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group)
        everyone = bool(flag.item())
        self.stage = "running" if run and everyone else "skipped"
        return everyone


def must_stop(stage: str | None) -> bool:
    """After a kind failed on this rank, must `bench all` stop rather than go on to the next kind?
    ``stage``: None for spawned --nproc ranks (the pool isolates each kind: go on), else how far the
    kind got here (KindGate.stage). Before the vote (the vote tells the others), skipped by every
    rank, or done (its collectives completed; only the report after them failed): go on. Voting or
    running: the other ranks may be waiting in collectives this rank will never join: stop."""
    return stage in ("voting", "running")


def exit_now(code: int) -> None:
    """Leave at once: a normal exit would tear down communicators with collectives still queued,
    which can block; torchrun sees the exit code and stops the other ranks."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
