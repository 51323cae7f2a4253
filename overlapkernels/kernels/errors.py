"""Errors raised by kernel launchers (Triton and CUDA alike)."""


class SignalTimeoutError(RuntimeError):
    """A device-side wait gave up; the message names the op, rank and chunk it waited for."""


class CudaLibraryError(RuntimeError):
    """The CUDA library is missing, of another ABI version, or a call into it failed."""
