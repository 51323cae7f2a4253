"""``pending_timeout_on(rank, message)``: a symm/fused device timeout this rank has not raised yet.

On GPUs a call's wait timeout is raised a call late (its error record is read without a host sync);
until then it waits in the process world's error queue. Here a process world stand-in whose queue
raises ``SignalTimeoutError(message)`` when flushed, on ``rank`` only, for the block."""
import contextlib
from types import SimpleNamespace

import torch.distributed as dist

from overlapkernels.comm import process_world as pw
from overlapkernels.kernels.errors import SignalTimeoutError


@contextlib.contextmanager
def pending_timeout_on(rank: int, message: str):
    def flush():
        raise SignalTimeoutError(message)

    saved = dict(pw._worlds)
    if dist.get_rank() == rank:
        pw._worlds["pending"] = SimpleNamespace(_errors=SimpleNamespace(flush=flush))
    try:
        yield
    finally:
        pw._worlds.clear()
        pw._worlds.update(saved)
