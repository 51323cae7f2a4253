"""ctypes loader of the CUDA library built from ../csrc (``make cuda``).

Loaded lazily on first use: ``import overlapkernels`` works with no GPU, no nvcc and no built
library. Functions take torch tensors, check them, and pass raw device pointers plus the current
stream (``torch.cuda.current_stream().cuda_stream``) to the C ABI in csrc/ok_cuda.h.
"""
from __future__ import annotations

import ctypes
import math
import os
import threading
from pathlib import Path

import torch

from .errors import CudaLibraryError, SignalTimeoutError

LIB_NAME = "liboverlapkernels_cuda.so"
ABI_VERSION = 3          # must match OK_CUDA_ABI_VERSION in csrc/ok_cuda.h
MAX_REDUCE_SRCS = 64     # OK_MAX_REDUCE_SRCS
IPC_HANDLE_BYTES = 64    # OK_IPC_HANDLE_BYTES
EXPORTS = ("ok_abi_version", "ok_error_string", "ok_signal_set", "ok_signal_wait", "ok_reduce_sum", "ok_ipc_alloc",
           "ok_ipc_open", "ok_ipc_close", "ok_free", "ok_stream_create")
_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_ERR_WAIT_TIMEOUT = 1
BUILD_HINT = ("build it with `make cuda` (needs nvcc), or reinstall with nvcc on PATH: "
              "`OVERLAPKERNELS_BUILD_CUDA=1 pip install .`")

# op ids travel through the int32 error record; names make the host-side message readable
_op_names: list[str] = []
_lock = threading.Lock()
_lib = None


def library_path() -> Path:
    """Where the library is looked for: $OVERLAPKERNELS_CUDA_LIB, else inside the package."""
    env = os.environ.get("OVERLAPKERNELS_CUDA_LIB")
    return Path(env) if env else Path(__file__).resolve().parent.parent / "_lib" / LIB_NAME


def is_built() -> bool:
    return library_path().exists()


def is_loadable() -> bool:
    """Built, loadable and of this package's ABI (a stale build is not)."""
    try:
        load()
    except CudaLibraryError:
        return False
    return True


def load() -> ctypes.CDLL:
    """The loaded library; raises ``CudaLibraryError`` saying how to build it when absent."""
    global _lib
    with _lock:
        if _lib is not None:
            return _lib
        path = library_path()
        if not path.exists():
            raise CudaLibraryError(f"the overlapkernels CUDA library is not built ({path} missing); {BUILD_HINT}")
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise CudaLibraryError(f"cannot load {path}: {exc}; {BUILD_HINT}") from exc
        missing = [name for name in EXPORTS if not hasattr(lib, name)]
        if missing:
            raise CudaLibraryError(f"{path} does not export {missing}; rebuild it: {BUILD_HINT}")
        c = ctypes
        lib.ok_abi_version.restype = c.c_int
        lib.ok_error_string.argtypes, lib.ok_error_string.restype = [c.c_int], c.c_char_p
        lib.ok_signal_set.argtypes = [c.c_int32, c.c_void_p, c.c_uint32, c.c_void_p]
        lib.ok_signal_wait.argtypes = [c.c_int32, c.c_void_p, c.c_uint32, c.c_uint64, c.c_void_p, c.c_int32,
                                       c.c_int32, c.c_int32, c.c_void_p]
        lib.ok_reduce_sum.argtypes = [c.c_int32, c.c_void_p, c.POINTER(c.c_void_p), c.c_int32, c.c_int64,
                                      c.c_int32, c.c_void_p]
        lib.ok_ipc_alloc.argtypes = [c.c_int32, c.c_uint64, c.POINTER(c.c_void_p), c.c_char_p]
        lib.ok_ipc_open.argtypes = [c.c_int32, c.c_char_p, c.POINTER(c.c_void_p)]
        lib.ok_ipc_close.argtypes = [c.c_int32, c.c_void_p]
        lib.ok_free.argtypes = [c.c_int32, c.c_void_p]
        lib.ok_stream_create.argtypes = [c.c_int32, c.POINTER(c.c_void_p)]
        for fn in EXPORTS[2:]:
            getattr(lib, fn).restype = c.c_int
        if lib.ok_abi_version() != ABI_VERSION:
            raise CudaLibraryError(f"{path} has ABI version {lib.ok_abi_version()}, this package expects "
                                   f"{ABI_VERSION}; rebuild it: {BUILD_HINT}")
        _lib = lib
        return lib


def _check(lib, err: int, what: str) -> None:
    if err:
        raise CudaLibraryError(f"{what}: CUDA error {err}: {lib.ok_error_string(err).decode()}")


def _require_cuda(what: str, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{what}: {name} must be a CUDA tensor, got {where}")


def _stream(stream, device: torch.device) -> int:
    return (stream or torch.cuda.current_stream(device)).cuda_stream


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def _on(index: int, call, *args) -> int:
    """``call(*args)`` with device ``index`` current. Why: the library's device guard restores the
    thread's previous device with cudaSetDevice, which creates a context there when it had none
    (a thread that never chose a device is on GPU 0: every rank would open one on GPU 0). torch's
    guard restores without creating one, so we switch here and the library never has to."""
    if torch.cuda.current_device() == index:
        return call(*args)
    with torch.cuda.device(index):
        return call(*args)


def _flag_arg(what: str, flag: torch.Tensor) -> None:
    if flag.dtype not in (torch.int32, torch.uint32) or flag.numel() != 1:
        raise ValueError(f"{what}: flag must be a 1-element int32 tensor (a view into a signal pad), got "
                         f"{flag.dtype} x {flag.numel()}")


def op_id(op: str) -> int:
    """A small integer for ``op`` that survives the trip through a device error record."""
    with _lock:
        if op not in _op_names:
            _op_names.append(op)
        return _op_names.index(op)


def signal_set(flag: torch.Tensor, value: int, *, stream=None) -> None:
    """Stream-ordered ``flag = value`` (release, system scope)."""
    _flag_value("value", value)
    lib = load()
    _require_cuda("signal_set", flag=flag)
    _flag_arg("signal_set", flag)
    index = _index(flag.device)
    _check(lib, _on(index, lib.ok_signal_set, index, flag.data_ptr(), value, _stream(stream, flag.device)),
           "signal_set")


def signal_wait(flag: torch.Tensor, expected: int, *, error_record: torch.Tensor, op: str, rank: int, chunk: int,
                timeout_s: float = 60.0, stream=None) -> None:
    """Stream-ordered wait until ``flag >= expected``; on timeout fills ``error_record`` (int32 [4])
    instead of hanging; ``check_error_record`` raises from it."""
    _flag_value("expected", expected)
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < 1e9:
        raise ValueError(f"signal_wait: timeout_s={timeout_s!r}: expected a finite number of seconds > 0 (a "
                         "negative one wrapped to centuries in the unsigned nanoseconds the kernel takes)")
    lib = load()
    _require_cuda("signal_wait", flag=flag, error_record=error_record)
    _flag_arg("signal_wait", flag)
    if error_record.dtype != torch.int32 or error_record.numel() < 4 or not error_record.is_contiguous():
        raise ValueError(f"signal_wait: error_record must be contiguous int32 with >= 4 elements (the kernel "
                         f"writes 4 in a row), got {error_record.dtype} x {error_record.numel()} with strides "
                         f"{error_record.stride()}")
    if error_record.device != flag.device:
        raise ValueError(f"signal_wait: error_record is on {error_record.device}, flag on {flag.device}: expected "
                         "one device")
    index = _index(flag.device)
    err = _on(index, lib.ok_signal_wait, index, flag.data_ptr(), expected, int(timeout_s * 1e9),
              error_record.data_ptr(), op_id(op), rank, chunk, _stream(stream, flag.device))
    _check(lib, err, "signal_wait")


def _flag_value(name: str, value) -> None:
    """Flags are uint32 in the library: a value outside wrapped silently (-1 to 0xFFFFFFFF)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32:
        raise ValueError(f"{name}={value!r}: expected an integer in [0, 2**32) (the signal flags are uint32)")


def check_error_record(error_record: torch.Tensor) -> None:
    """Raise ``SignalTimeoutError`` if a wait wrote ``error_record`` (synchronises with the device)."""
    code, rank, chunk, op = (int(v) for v in error_record[:4].tolist())
    if code == _ERR_WAIT_TIMEOUT:
        name = _op_names[op] if 0 <= op < len(_op_names) else f"op#{op}"
        raise SignalTimeoutError(f"{name}: rank {rank} timed out waiting for the signal of chunk {chunk}")
    if code:
        raise SignalTimeoutError(f"unknown error record {error_record[:4].tolist()}")


def reduce_sum(dst: torch.Tensor, srcs, *, stream=None) -> torch.Tensor:
    """``dst = srcs[0] + srcs[1] + ...`` with fp32 accumulation in list order (fp32/fp16/bf16).

    ``srcs`` may live on peers (peer-mapped pointers); ``dst`` may be ``srcs[0]``.
    """
    lib = load()
    srcs = list(srcs)
    if not 1 <= len(srcs) <= MAX_REDUCE_SRCS:
        raise ValueError(f"reduce_sum: expected 1..{MAX_REDUCE_SRCS} sources, got {len(srcs)}")
    _require_cuda("reduce_sum", dst=dst, **{f"srcs[{i}]": s for i, s in enumerate(srcs)})
    if dst.dtype not in _DTYPE_CODES:
        raise ValueError(f"reduce_sum: dst dtype {dst.dtype} not supported; expected one of {list(_DTYPE_CODES)}")
    for i, s in enumerate(srcs):
        if s.dtype != dst.dtype or s.numel() != dst.numel() or not s.is_contiguous():
            raise ValueError(f"reduce_sum: srcs[{i}] is {s.dtype} x {s.numel()} (contiguous={s.is_contiguous()}); "
                             f"expected contiguous {dst.dtype} x {dst.numel()} like dst")
    if not dst.is_contiguous():
        raise ValueError("reduce_sum: dst must be contiguous")
    ptrs = (ctypes.c_void_p * len(srcs))(*[s.data_ptr() for s in srcs])
    index = _index(dst.device)
    err = _on(index, lib.ok_reduce_sum, index, dst.data_ptr(), ptrs, len(srcs), dst.numel(), _DTYPE_CODES[dst.dtype],
              _stream(stream, dst.device))
    _check(lib, err, "reduce_sum")
    return dst


# --- CUDA IPC peer memory (the process world's fallback to torch symmetric memory) ---------------
def _cuda_device(device) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"CUDA IPC: device must be a CUDA device, got {device}")
    return torch.device("cuda", _index(device))


def ipc_alloc(nbytes: int, device) -> tuple[int, bytes]:
    """A fresh ``cudaMalloc`` of ``nbytes`` on ``device`` -> (device pointer, IPC handle bytes)."""
    lib, device = load(), _cuda_device(device)
    ptr, handle = ctypes.c_void_p(), ctypes.create_string_buffer(IPC_HANDLE_BYTES)
    _check(lib, _on(device.index, lib.ok_ipc_alloc, device.index, nbytes, ctypes.byref(ptr), handle),
           f"ipc_alloc({nbytes} B)")
    return ptr.value, handle.raw


def ipc_open(handle: bytes, device) -> int:
    """Map a peer's ``ipc_alloc`` buffer into this process, usable from ``device`` -> its pointer."""
    lib, device = load(), _cuda_device(device)
    if not isinstance(handle, bytes) or len(handle) != IPC_HANDLE_BYTES:
        raise ValueError(f"ipc_open: handle must be {IPC_HANDLE_BYTES} bytes from ipc_alloc")
    ptr = ctypes.c_void_p()
    _check(lib, _on(device.index, lib.ok_ipc_open, device.index, handle, ctypes.byref(ptr)), "ipc_open")
    return ptr.value


def ipc_close(ptr: int, device) -> None:
    lib, device = load(), _cuda_device(device)
    _check(lib, _on(device.index, lib.ok_ipc_close, device.index, ptr), "ipc_close")


def free(ptr: int, device) -> None:
    lib, device = load(), _cuda_device(device)
    _check(lib, _on(device.index, lib.ok_free, device.index, ptr), "free")


def own_stream(device) -> torch.cuda.ExternalStream:
    """A stream no one else is handed (see csrc/stream.cu): non-blocking, at the device's highest
    priority, kept for the life of the process."""
    lib, device = load(), _cuda_device(device)
    stream = ctypes.c_void_p()
    _check(lib, _on(device.index, lib.ok_stream_create, device.index, ctypes.byref(stream)), "stream_create")
    return torch.cuda.ExternalStream(stream.value, device=device)


def tensor_at(ptr: int, shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over memory at ``ptr``, labelled as on ``device`` (also
    for a peer GPU's mapped memory: kernels and copies then run on this rank's device, and torch
    never opens a context on the peer's). It does not own the memory: the caller keeps the
    allocation alive for the tensor's lifetime.

    torch has no public constructor for this; ``_construct_storage_from_data_pointer`` is the one
    torch's CUDA-graph trees use for the same purpose."""
    device = torch.device(device)
    storage = torch._C._construct_storage_from_data_pointer(ptr, device, math.prod(shape) * dtype.itemsize)
    return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, tuple(shape))
