"""Errors raised by kernel launchers (Triton and CUDA alike), and the device error record."""
import torch

# A call's device error record, int32: [code, rank, chunk, peer] that the first wait to give up
# writes, then ABORT_SLOT, which only the host writes: the thread world sets it to release the
# interpreted waits of a run whose rank failed or whose time is up (an interpreted poll runs at
# the host's pace, 10-50x apart between machines and loads, so a poll budget alone cannot bound a
# wait in seconds). Compiled timed waits never read it: they stop on the GPU's global timer.
ERROR_RECORD_LEN = 5
ABORT_SLOT = 4


def new_error_record(device) -> torch.Tensor:
    return torch.zeros(ERROR_RECORD_LEN, dtype=torch.int32, device=device)


def check_error_record(err: torch.Tensor) -> None:
    """The waits read ``err[ABORT_SLOT]``: a shorter record would be read out of bounds."""
    if err.dtype != torch.int32 or err.numel() < ERROR_RECORD_LEN or not err.is_contiguous():
        raise ValueError(f"err: expected a contiguous int32 error record of {ERROR_RECORD_LEN} elements "
                         f"(new_error_record), got {err.dtype} x {err.numel()}")


class SignalTimeoutError(RuntimeError):
    """A device-side wait gave up; the message names the op, rank and chunk it waited for."""


class PeerFailedError(SignalTimeoutError):
    """Another rank of the group had a symm/fused timeout (or device error) pending: this rank stops
    too (``fsdp.save``, ``Trainer.step``). The message names that rank and its error."""


class CudaLibraryError(RuntimeError):
    """The CUDA library is missing, of another ABI version, or a call into it failed."""
