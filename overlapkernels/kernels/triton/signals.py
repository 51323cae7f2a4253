"""Device-side signalling shared by the peer-memory kernels: peer pointers, flags, timed waits.

Flags are int64 and only grow (an epoch or a count), so a signal pad is never reset between calls
and a late reader cannot mistake the previous call's flag for this one's (int64: a per-tile count
would wrap an int32 within a few thousand training steps). Every wait gives up after its
``WaitBudget`` - nanoseconds of the GPU's global timer when compiled, a poll count in the
interpreter (which has no timer; there the thread world can also release it through the record's
abort slot) - and leaves an error record (``errors.new_error_record``: code, rank, chunk, peer)
that ``raise_if_timed_out`` turns into an exception naming the op, rank, chunk and peer.

The ``@triton.jit`` helpers are inlined into kernels; ``wait_flag`` / ``set_peer_flag`` /
``add_peer_flag`` launch one-program kernels, stream-ordered like any other launch. Epochs,
targets, ranks and budgets are never specialised on (``do_not_specialize``): Triton otherwise
compiles a variant for the value 1 and for multiples of 16, so a long-running op would recompile
at call 16 while its peers spin. Flag values are typed int64 for the same reason (a count passing
2**31 would switch an untyped argument from i32 to i64: another compile, mid-run).
"""
import threading
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..errors import ABORT_SLOT, SignalTimeoutError, check_error_record
from ..interpreter import interpreted

FLAG_DTYPE = torch.int64  # signal pads and arrival flags

ERR_READY_TIMEOUT = tl.constexpr(1)     # waited for a peer to publish a chunk
ERR_CONSUMED_TIMEOUT = tl.constexpr(2)  # waited for a peer to finish reading / reducing our previous data
ERR_PARTIAL_TIMEOUT = tl.constexpr(3)   # waited for a peer's partial sum of our chunk
ABORT_SLOT_C = tl.constexpr(ABORT_SLOT)  # (jit code reads globals only as constexprs)

# A timeout converted at this rate waits at least as long: an interpreted poll takes far more than
# 50 us (measured 2026-12-02, triton 3.9, CI's CPU: ~0.33 ms on one thread, ~2.7 ms a thread with 8
# ranks sharing the GIL), so a wait gives up late, never early; the thread world releases waits
# sooner, at its run's limit or a peer's failure (errors.ABORT_SLOT).
INTERPRETER_POLLS_PER_SECOND = 20_000
# The one-program flag kernels touch one scalar: one warp (Triton's default is 4) of at most 32
# registers, 1K of an SM's 64K, so that one fits beside a persistent GEMM's block (the tightest
# config leaves 6K; scripts/compile_kernels_sm90.py fails one that leaves less than 1K).
FLAG_KERNEL_LAUNCH = dict(num_warps=1, maxnreg=32)
# Clock lanes of a timed wait (see _now_ns): at least the program's threads. The GEMMs run up to
# 8 warps; the flag kernels one (1024 lanes there would be 32 timer reads, 64 registers, a thread).
GEMM_CLOCK_LANES = tl.constexpr(1024)
FLAG_CLOCK_LANES = tl.constexpr(32 * FLAG_KERNEL_LAUNCH["num_warps"])


@dataclass(frozen=True)
class WaitBudget:
    """How long a device wait may spin: ``amount`` ns of the GPU global timer if ``timed``, else
    ``amount`` polls (the interpreter)."""
    amount: int
    timed: bool


def wait_budget(timeout_s: float, device: torch.device) -> WaitBudget:
    if interpreted(device):
        return WaitBudget(max(1, int(timeout_s * INTERPRETER_POLLS_PER_SECOND)), False)
    return WaitBudget(max(1, int(timeout_s * 1e9)), True)


def polls(count: int) -> WaitBudget:
    """A budget of ``count`` polls, wherever it runs (tests of the timeout path)."""
    return WaitBudget(count, False)


@triton.jit
def peer_ptr(table_ptr, peer, like_ptr):
    """``peer``'s buffer from an int64 address table, typed like ``like_ptr``. Symmetric buffers
    start 16-byte aligned (``SymmetricTensor`` checks it); saying so lets the compiler vectorise
    peer loads and stores, which it cannot infer of an address loaded from a table. The hint sits
    here, not at call sites: Triton 3.6 drops ``tl.multiple_of`` on a jit helper's result (the
    fused reduce-scatter's remote stores compiled to 2-byte ``st.global.b16``)."""
    return tl.multiple_of(tl.load(table_ptr + peer).to(tl.pointer_type(like_ptr.dtype.element_ty)), 16)


@triton.jit
def signal_ptr(table_ptr, peer):
    """``peer``'s int64 signal pad from an int64 address table."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(tl.int64))


@triton.jit
def set_flag(flag_ptr, value):
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def _now_ns(LANES: tl.constexpr):
    """The GPU global timer, the same value in every thread of the program: each thread reads its
    own clock, so the reading is reduced across the block (a per-thread timeout decision would let
    warps leave a wait loop at different polls and pair their barriers up wrongly afterwards).
    ``LANES`` >= the program's threads, so that every thread holds a reading of its own (fewer,
    and warps would hold replicas the reduction does not combine)."""
    per_thread = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [tl.zeros([LANES], dtype=tl.int32)],
                                           dtype=tl.int64, is_pure=False, pack=1)
    return tl.min(per_thread, axis=0)


@triton.jit
def wait_geq(flag_ptr, target, budget, abort_ptr, TIMED: tl.constexpr, CLOCK_LANES: tl.constexpr):
    """Poll (acquire, system scope) until ``*flag_ptr >= target`` or the budget is spent (``TIMED``:
    ``budget`` ns of the global timer; else ``budget`` polls, or until the host sets ``*abort_ptr``).
    Returns the last value seen, so the caller can tell a timeout (value < target) apart. Every
    thread takes the same exit: the polled value is a scalar atomic's (broadcast) and the time a
    block-wide minimum."""
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    if TIMED:
        # the clock (a block-wide reduction) only once the first poll fails: most of a fused
        # GEMM's tiles find their chunk already there
        if value < target:
            start = _now_ns(CLOCK_LANES)
            while (value < target) & (_now_ns(CLOCK_LANES) - start < budget):
                value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    else:
        spins = 0
        while (value < target) & (spins < budget) & (tl.load(abort_ptr, volatile=True) == 0):
            value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
            spins += 1
    return value


@triton.jit
def fence_proxy_async():
    """Order the program's earlier generic-proxy accesses (a flag's acquire) before its later
    async-proxy ones (TMA loads): PTX orders the two proxies only through this fence, so without it
    a TMA load could see a chunk's memory from before the flag said the chunk had arrived. Every
    thread runs it (the one that issues the TMA among them). Compiled code only: inline PTX."""
    tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, $1;", "=r,r", [tl.zeros([1], dtype=tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def record_error(err_ptr, code, rank, chunk, peer):
    # the first error wins, so the report names the wait that failed first
    if tl.atomic_cas(err_ptr, 0, code) == 0:
        tl.store(err_ptr + 1, rank)
        tl.store(err_ptr + 2, chunk)
        tl.store(err_ptr + 3, peer)


@triton.jit
def wait_or_record(flag_ptr, target, err_ptr, budget, code, rank, chunk, peer, TIMED: tl.constexpr,
                   CLOCK_LANES: tl.constexpr):
    """``wait_geq``, recording a timeout in the call's error record - unless that record already
    holds one: then give up at once. A dead peer thus costs a call one wait budget, not one per
    wait (a fused GEMM waits once per tile: 16 tiles a program at 8192 rows, 16 minutes at the 60 s
    default). The check is a scalar atomic, one value broadcast, so every thread takes one branch."""
    if tl.atomic_add(err_ptr, 0, sem="relaxed") == 0:
        if wait_geq(flag_ptr, target, budget, err_ptr + ABORT_SLOT_C, TIMED, CLOCK_LANES) < target:
            record_error(err_ptr, code, rank, chunk, peer)


@triton.jit(do_not_specialize=["target", "budget", "code", "rank", "chunk", "peer"],
            do_not_specialize_on_alignment=["flag_ptr"])  # flags are 8-byte slots of a pad: one variant
def _wait_kernel(flag_ptr, target: tl.int64, err_ptr, budget: tl.int64, code, rank, chunk, peer,
                 TIMED: tl.constexpr):
    wait_or_record(flag_ptr, target, err_ptr, budget, code, rank, chunk, peer, TIMED, FLAG_CLOCK_LANES)


@triton.jit(do_not_specialize=["peer", "index", "value"])
def _update_peer_flag_kernel(table_ptr, peer, index, value: tl.int64, ADD: tl.constexpr):
    flag = signal_ptr(table_ptr, peer) + index
    if ADD:
        tl.atomic_add(flag, value, sem="release", scope="sys")
    else:
        set_flag(flag, value)


@triton.jit(do_not_specialize=["value"], do_not_specialize_on_alignment=["flag_ptr"])
def _set_flag_kernel(flag_ptr, value: tl.int64):
    set_flag(flag_ptr, value)


def set_flag_now(flag: torch.Tensor, value: int) -> None:
    """Stream-ordered ``flag = value`` (release) on a local 1-element flag view."""
    _set_flag_kernel[(1,)](flag, value, **FLAG_KERNEL_LAUNCH)


def wait_flag(flag: torch.Tensor, target: int, err: torch.Tensor, budget: WaitBudget, *, code, rank: int, chunk: int,
              peer: int) -> None:
    """Stream-ordered wait until ``flag`` (a 1-element flag view) >= ``target``. One program: spinning
    blocks hold SMs that peers' kernels may need when ranks share a GPU, so waits stay this small."""
    check_error_record(err)
    _wait_kernel[(1,)](flag, target, err, budget.amount, code.value, rank, chunk, peer, TIMED=budget.timed,
                       **FLAG_KERNEL_LAUNCH)


def set_peer_flag(pads, peer: int, index: int, value: int) -> None:
    """``pads.peer(peer)[index] = value`` (release) through the peer-pointer table."""
    _update_peer_flag_kernel[(1,)](pads.peer_ptrs, peer, index, value, ADD=False, **FLAG_KERNEL_LAUNCH)


def add_peer_flag(pads, peer: int, index: int, value: int) -> None:
    """``pads.peer(peer)[index] += value`` (release) through the peer-pointer table."""
    _update_peer_flag_kernel[(1,)](pads.peer_ptrs, peer, index, value, ADD=True, **FLAG_KERNEL_LAUNCH)


def raise_if_timed_out(err: torch.Tensor, op: str, epoch: int) -> None:
    """Raise ``SignalTimeoutError`` from an error record (a host sync: reporting, not the hot path).

    A record on a GPU is read only once its stream is idle (an event, then the copy): a copy to
    the host queued behind spin-waits held up other threads' copies to the host, among them those
    of the peers the waits were waiting for, which made them before signalling - the one-GPU thread
    world's hangs on an H200 (2026-11-30; read from the logs, not yet re-run on a GPU)."""
    if err.device.type == "cuda":
        idle = torch.cuda.Event()
        idle.record(torch.cuda.current_stream(err.device))
        idle.synchronize()
    code, rank, chunk, peer = (int(v) for v in err[:4].tolist())
    where = f"(call {epoch}); is rank {peer} alive and in the same call?"
    if code == ERR_READY_TIMEOUT.value:
        raise SignalTimeoutError(f"{op}: rank {rank} timed out waiting for chunk {chunk} from rank {peer} {where}")
    if code == ERR_CONSUMED_TIMEOUT.value:
        raise SignalTimeoutError(f"{op}: rank {rank} timed out waiting for rank {peer} to release chunk {chunk} "
                                 f"of call {epoch - 1} {where}")
    if code == ERR_PARTIAL_TIMEOUT.value:
        raise SignalTimeoutError(f"{op}: rank {rank} timed out waiting for rank {peer}'s partial of chunk {chunk} "
                                 f"{where}")
    if code:
        raise SignalTimeoutError(f"{op}: unknown error record {err[:4].tolist()}")


class DeferredErrorCheck:
    """Error records checked without a host sync on the hot path (CUDA): each record is copied to
    pinned memory behind an event, and a later call raises once that event has completed. The
    cost: a timed-out call returns before its error is known; the next call (or ``flush``)
    raises it."""

    def __init__(self):
        self._pending: list = []
        # backward's calls submit from autograd's device thread, forward's from the caller's
        self._lock = threading.Lock()

    def submit(self, err: torch.Tensor, op: str, epoch: int) -> None:
        if err.device.type != "cuda":
            raise_if_timed_out(err, op, epoch)
            return
        host = torch.empty(4, dtype=torch.int32, pin_memory=True)
        stream = torch.cuda.current_stream(err.device)
        with torch.cuda.stream(stream):  # the copy and its event on err's device, whatever is current
            host.copy_(err[:4], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        with self._lock:
            self._pending.append((event, host, op, epoch))
        self.poll()

    def _next(self, *, wait: bool):
        """The oldest record once its copy has landed (``wait``: wait for it); None if none is ready."""
        with self._lock:
            if not self._pending or not (wait or self._pending[0][0].query()):
                return None
            event, host, op, epoch = self._pending.pop(0)
        event.synchronize()
        return host, op, epoch

    def poll(self) -> None:
        while (record := self._next(wait=False)) is not None:
            raise_if_timed_out(*record)

    def flush(self) -> None:
        """Wait for every pending record and raise the first error."""
        while (record := self._next(wait=True)) is not None:
            raise_if_timed_out(*record)
