"""The CUDA library's Python side without a GPU or an nvcc: its constants agree with the C header,
a library that cannot serve is refused by name (and not kept), and the wrappers check their
arguments and hand them to the C ABI in its order (a recording stand-in for the library, fake CUDA
tensors from torch's FakeTensorMode: devices and dtypes with no memory behind them)."""
import contextlib
import ctypes
import ctypes.util
import re
import shutil
import subprocess
import types
import warnings
from pathlib import Path

import pytest
import torch

from overlapkernels.kernels import cuda as cuda_lib
from overlapkernels.kernels.errors import CudaLibraryError, SignalTimeoutError

HEADER = Path(__file__).resolve().parent.parent / "csrc" / "ok_cuda.h"


def _header_constants() -> dict:
    text = HEADER.read_text()
    found = {name: int(value) for name, value in re.findall(r"#define (OK_\w+) (\d+)", text)}
    for body in re.findall(r"enum \w+ \{([^}]*)\}", text):
        found.update({name: int(value) for name, value in re.findall(r"(OK_\w+) = (\d+)", body)})
    return found


def test_the_python_constants_are_the_headers():
    """Nothing else ties them together: the loader compares only the ABI version with the built
    library's, so a dtype code, the source limit or the handle size out of step with csrc/ok_cuda.h
    reads bf16 as fp16, passes too many sources or truncates an IPC handle, on a GPU only."""
    h = _header_constants()
    assert cuda_lib.ABI_VERSION == h["OK_CUDA_ABI_VERSION"]
    assert cuda_lib.MAX_REDUCE_SRCS == h["OK_MAX_REDUCE_SRCS"]
    assert cuda_lib.IPC_HANDLE_BYTES == h["OK_IPC_HANDLE_BYTES"]
    assert cuda_lib._ERR_WAIT_TIMEOUT == h["OK_ERR_WAIT_TIMEOUT"]
    assert cuda_lib._DTYPE_CODES == {torch.float32: h["OK_FLOAT32"], torch.float16: h["OK_FLOAT16"],
                                     torch.bfloat16: h["OK_BFLOAT16"]}


# ---------------------------------------------------------------- loading

def test_a_file_that_is_no_library_is_refused_by_name(use_lib, tmp_path):
    bad = tmp_path / cuda_lib.LIB_NAME
    bad.write_text("not an ELF file")
    use_lib(bad)
    assert cuda_lib.is_built() and not cuda_lib.is_loadable()
    with pytest.raises(CudaLibraryError, match=rf"^cannot load {re.escape(str(bad))}: .*make cuda"):
        cuda_lib.load()


def test_a_library_without_the_exports_is_refused_by_name(use_lib):
    libm = ctypes.util.find_library("m")
    if libm is None:
        pytest.skip("no libm to stand in for a library of other exports")
    path = shutil.which(libm) or next((str(p) for d in ("/lib", "/usr/lib", "/lib64", "/usr/lib64")
                                       for p in Path(d).rglob(libm)), None)
    if path is None:
        pytest.skip(f"{libm} not found on disk")
    use_lib(path)
    with pytest.raises(CudaLibraryError, match=r"does not export \['ok_abi_version', 'ok_error_string', .*'ok_stream_create'\]"):
        cuda_lib.load()
    assert not cuda_lib.is_loadable()


def _fake_library(tmp_path, abi: int) -> Path:
    """A C library exporting the ABI's names (no CUDA: every call but the version returns 0)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler to build a stand-in library")
    src = tmp_path / "fake.c"
    body = [f"int ok_abi_version(void) {{ return {abi}; }}", 'const char* ok_error_string(int e) { return "fake"; }']
    body += [f"int {name}(void) {{ return 0; }}" for name in cuda_lib.EXPORTS[2:]]
    src.write_text("\n".join(body) + "\n")
    out = tmp_path / f"fake{abi}.so"
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(out), str(src)], check=True, capture_output=True)
    return out


def test_a_library_of_another_abi_is_refused_and_not_kept(use_lib, tmp_path):
    stale = _fake_library(tmp_path, cuda_lib.ABI_VERSION + 1)
    use_lib(stale)
    for _ in range(2):  # a second call checks again: the refused library was not kept
        with pytest.raises(CudaLibraryError, match=rf"has ABI version {cuda_lib.ABI_VERSION + 1}, this package "
                                                   rf"expects {cuda_lib.ABI_VERSION}; rebuild it"):
            cuda_lib.load()
    assert not cuda_lib.is_loadable() and cuda_lib._lib is None
    use_lib(_fake_library(tmp_path, cuda_lib.ABI_VERSION))
    assert cuda_lib.is_loadable() and cuda_lib.load() is cuda_lib.load()


# ---------------------------------------------------------------- error records and op ids

def test_op_ids_are_stable_and_name_their_op_in_the_record():
    first, second = cuda_lib.op_id("audit/op-a"), cuda_lib.op_id("audit/op-b")
    assert first != second and cuda_lib.op_id("audit/op-a") == first and cuda_lib.op_id("audit/op-b") == second
    for op, name in ((first, "audit/op-a"), (second, "audit/op-b")):
        with pytest.raises(SignalTimeoutError, match=rf"^{name}: rank 2 timed out waiting for the signal of chunk 7$"):
            cuda_lib.check_error_record(torch.tensor([1, 2, 7, op], dtype=torch.int32))


def test_an_error_record_of_an_unknown_code_or_op_is_still_raised():
    """A code other than a timeout is an error too (never silence); an op id this process never
    handed out is shown as its number, not an IndexError."""
    with pytest.raises(SignalTimeoutError, match=r"^unknown error record \[2, 0, 1, 0\]$"):
        cuda_lib.check_error_record(torch.tensor([2, 0, 1, 0], dtype=torch.int32))
    unknown = len(cuda_lib._op_names)
    with pytest.raises(SignalTimeoutError, match=rf"^op#{unknown}: rank 1 timed out"):
        cuda_lib.check_error_record(torch.tensor([1, 1, 0, unknown], dtype=torch.int32))
    with pytest.raises(SignalTimeoutError, match=r"^op#-1: rank 1 timed out"):
        cuda_lib.check_error_record(torch.tensor([1, 1, 0, -1], dtype=torch.int32))


# ---------------------------------------------------------------- arguments (a recording library)

class _Recorder:
    """Stands in for the loaded library: records each call's arguments, returns success."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        if not name.startswith("ok_"):
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, args)) or 0


@pytest.fixture
def recorder(monkeypatch):
    lib = _Recorder()
    monkeypatch.setattr(cuda_lib, "load", lambda: lib)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    with warnings.catch_warnings():  # the fake tensors' data_ptr (0) is what the library is handed
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        yield lib


STREAM = types.SimpleNamespace(cuda_stream=4242)


def _cuda(n, dtype=torch.float32, device="cuda:0", step=1):
    """A 1-d fake CUDA tensor of n elements, step apart (a view would need a CUDA device guard)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        return torch.empty_strided((n,), (step,), dtype=dtype, device=device)


def test_reduce_sum_checks_its_sources_and_passes_the_dtypes_code(recorder):
    dst = _cuda(6, dtype=torch.bfloat16)
    cuda_lib.reduce_sum(dst, [_cuda(6, dtype=torch.bfloat16)] * cuda_lib.MAX_REDUCE_SRCS, stream=STREAM)
    name, args = recorder.calls[-1]
    assert name == "ok_reduce_sum" and args[0] == 0 and args[3:] == (cuda_lib.MAX_REDUCE_SRCS, 6, 2, 4242)
    cuda_lib.reduce_sum(_cuda(6, dtype=torch.float16), [_cuda(6, dtype=torch.float16)], stream=STREAM)
    assert recorder.calls[-1][1][5] == 1
    calls = len(recorder.calls)
    for srcs, said in (
            ([dst] * (cuda_lib.MAX_REDUCE_SRCS + 1), r"expected 1\.\.64 sources, got 65"),
            ([dst, torch.zeros(6, dtype=torch.bfloat16)], r"^reduce_sum: srcs\[1\] must be a CUDA tensor, got cpu$"),
            ([dst, _cuda(7, dtype=torch.bfloat16)], r"srcs\[1\] is torch.bfloat16 x 7 \(contiguous=True\); expected "
                                                    r"contiguous torch.bfloat16 x 6 like dst"),
            ([_cuda(6, dtype=torch.float32)], r"srcs\[0\] is torch.float32 x 6"),
            ([_cuda(6, dtype=torch.bfloat16, step=2)], r"srcs\[0\] is torch.bfloat16 x 6 \(contiguous=False\)")):
        with pytest.raises(ValueError, match=said):
            cuda_lib.reduce_sum(dst, srcs, stream=STREAM)
    with pytest.raises(ValueError, match=r"^reduce_sum: dst must be contiguous$"):
        cuda_lib.reduce_sum(_cuda(6, step=2), [_cuda(6)], stream=STREAM)
    with pytest.raises(ValueError, match=r"dst dtype torch.float64 not supported"):
        cuda_lib.reduce_sum(_cuda(6, dtype=torch.float64), [_cuda(6, dtype=torch.float64)], stream=STREAM)
    assert len(recorder.calls) == calls  # nothing refused reached the library


def test_signal_wait_hands_the_c_abi_its_arguments_in_order(recorder):
    flag, record = _cuda(1, dtype=torch.int32), _cuda(5, dtype=torch.int32)
    cuda_lib.signal_wait(flag, 3, error_record=record, op="audit/wait", rank=1, chunk=6, timeout_s=2.5, stream=STREAM)
    name, args = recorder.calls[-1]
    assert name == "ok_signal_wait"
    assert (args[0], args[2], args[3], args[5:]) == (0, 3, 2_500_000_000, (cuda_lib.op_id("audit/wait"), 1, 6, 4242))
    cuda_lib.signal_set(flag, 9, stream=STREAM)
    assert recorder.calls[-1][0] == "ok_signal_set" and recorder.calls[-1][1][2:] == (9, 4242)
    calls = len(recorder.calls)
    wait = dict(op="audit/wait", rank=0, chunk=0, stream=STREAM)
    for bad_flag in (_cuda(2, dtype=torch.int32), _cuda(1, dtype=torch.int64)):
        with pytest.raises(ValueError, match=r"flag must be a 1-element int32 tensor"):
            cuda_lib.signal_set(bad_flag, 1, stream=STREAM)
        with pytest.raises(ValueError, match=r"flag must be a 1-element int32 tensor"):
            cuda_lib.signal_wait(bad_flag, 1, error_record=record, **wait)
    for bad_record in (_cuda(3, dtype=torch.int32), _cuda(4, dtype=torch.int64), _cuda(4, dtype=torch.int32, step=2)):
        with pytest.raises(ValueError, match=r"error_record must be contiguous int32 with >= 4 elements"):
            cuda_lib.signal_wait(flag, 1, error_record=bad_record, **wait)
    with pytest.raises(ValueError, match=r"error_record is on cuda:1, flag on cuda:0: expected one device"):
        cuda_lib.signal_wait(flag, 1, error_record=_cuda(5, dtype=torch.int32, device="cuda:1"), **wait)
    with pytest.raises(ValueError, match=r"^signal_wait: error_record must be a CUDA tensor, got cpu$"):
        cuda_lib.signal_wait(flag, 1, error_record=torch.zeros(5, dtype=torch.int32), **wait)
    assert len(recorder.calls) == calls


def test_ipc_calls_refuse_a_cpu_device_and_a_short_handle(recorder):
    with pytest.raises(ValueError, match=r"^CUDA IPC: device must be a CUDA device, got cpu$"):
        cuda_lib.ipc_alloc(64, "cpu")
    with pytest.raises(ValueError, match=r"^ipc_open: handle must be 64 bytes from ipc_alloc$"):
        cuda_lib.ipc_open(b"\0" * 63, "cuda:0")
    assert recorder.calls == []
    cuda_lib.ipc_open(b"\0" * 64, "cuda:1")
    assert recorder.calls[-1][0] == "ok_ipc_open" and recorder.calls[-1][1][:2] == (1, b"\0" * 64)
