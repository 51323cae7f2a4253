"""Errors raised by kernel launchers (Triton and CUDA alike)."""


class SignalTimeoutError(RuntimeError):
    """A device-side wait gave up; the message names the op, rank and chunk it waited for."""


class PeerFailedError(SignalTimeoutError):
    """Another rank of the group had a symm/fused timeout (or device error) pending: this rank stops
    too (``fsdp.save``, ``Trainer.step``). The message names that rank and its error."""


class CudaLibraryError(RuntimeError):
    """The CUDA library is missing, of another ABI version, or a call into it failed."""
