"""Device-side signalling shared by the peer-memory kernels: peer pointers, flags, timed waits.

Flags are int64 and only grow (an epoch or a count), so a signal pad is never reset between calls
and a late reader cannot mistake the previous call's flag for this one's (int64: a per-tile count
would wrap an int32 within a few thousand training steps). Every wait gives up
after ``max_spins`` polls and leaves an error record (int32 [4] = code, rank, chunk, peer) that
``raise_if_timed_out`` turns into an exception naming the op, rank, chunk and peer.

The ``@triton.jit`` helpers are inlined into kernels; ``wait_flag`` / ``set_peer_flag`` /
``add_peer_flag`` launch one-program kernels, stream-ordered like any other launch.
"""
import torch
import triton
import triton.language as tl

from ..errors import SignalTimeoutError

FLAG_DTYPE = torch.int64  # signal pads and arrival flags

ERR_READY_TIMEOUT = tl.constexpr(1)     # waited for a peer to publish a chunk
ERR_CONSUMED_TIMEOUT = tl.constexpr(2)  # waited for a peer to finish reading / reducing our previous data
ERR_PARTIAL_TIMEOUT = tl.constexpr(3)   # waited for a peer's partial sum of our chunk

# Interpreted polls are ~10-50 us each, compiled ones well under 1 us: converting a timeout in
# seconds with these rates gives a wait at least that long on either.
POLLS_PER_SECOND = {"interpreter": 20_000, "gpu": 2_000_000}


def max_spins_for(timeout_s: float, device: torch.device) -> int:
    import os

    kind = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" or device.type == "cpu" else "gpu"
    return max(1, int(timeout_s * POLLS_PER_SECOND[kind]))


@triton.jit
def peer_ptr(table_ptr, peer, like_ptr):
    """``peer``'s buffer from an int64 address table, typed like ``like_ptr``."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(like_ptr.dtype.element_ty))


@triton.jit
def signal_ptr(table_ptr, peer):
    """``peer``'s int64 signal pad from an int64 address table."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(tl.int64))


@triton.jit
def set_flag(flag_ptr, value):
    tl.atomic_xchg(flag_ptr, value, sem="release", scope="sys")


@triton.jit
def wait_geq(flag_ptr, target, max_spins):
    """Poll (acquire, system scope) until ``*flag_ptr >= target`` or ``max_spins`` polls; returns
    the last value seen, so the caller can tell a timeout (value < target) apart."""
    spins = 0
    value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    while (value < target) & (spins < max_spins):
        value = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        spins += 1
    return value


@triton.jit
def record_error(err_ptr, code, rank, chunk, peer):
    # the first error wins, so the report names the wait that failed first
    if tl.atomic_cas(err_ptr, 0, code) == 0:
        tl.store(err_ptr + 1, rank)
        tl.store(err_ptr + 2, chunk)
        tl.store(err_ptr + 3, peer)


@triton.jit
def _wait_kernel(flag_ptr, target, err_ptr, max_spins, code, rank, chunk, peer):
    if wait_geq(flag_ptr, target, max_spins) < target:
        record_error(err_ptr, code, rank, chunk, peer)


@triton.jit
def _update_peer_flag_kernel(table_ptr, peer, index, value, ADD: tl.constexpr):
    flag = signal_ptr(table_ptr, peer) + index
    if ADD:
        tl.atomic_add(flag, value, sem="release", scope="sys")
    else:
        set_flag(flag, value)


@triton.jit
def _set_flag_kernel(flag_ptr, value):
    set_flag(flag_ptr, value)


def set_flag_now(flag: torch.Tensor, value: int) -> None:
    """Stream-ordered ``flag = value`` (release) on a local 1-element flag view."""
    _set_flag_kernel[(1,)](flag, value)


def wait_flag(flag: torch.Tensor, target: int, err: torch.Tensor, max_spins: int, *, code, rank: int, chunk: int,
              peer: int) -> None:
    """Stream-ordered wait until ``flag`` (a 1-element flag view) >= ``target``. One program: spinning
    blocks hold SMs that peers' kernels may need when ranks share a GPU, so waits stay this small."""
    _wait_kernel[(1,)](flag, target, err, max_spins, code.value, rank, chunk, peer)


def set_peer_flag(pads, peer: int, index: int, value: int) -> None:
    """``pads.peer(peer)[index] = value`` (release) through the peer-pointer table."""
    _update_peer_flag_kernel[(1,)](pads.peer_ptrs, peer, index, value, ADD=False)


def add_peer_flag(pads, peer: int, index: int, value: int) -> None:
    """``pads.peer(peer)[index] += value`` (release) through the peer-pointer table."""
    _update_peer_flag_kernel[(1,)](pads.peer_ptrs, peer, index, value, ADD=True)


def raise_if_timed_out(err: torch.Tensor, op: str, epoch: int) -> None:
    """Raise ``SignalTimeoutError`` from an error record (a host sync: reporting, not the hot path)."""
    code, rank, chunk, peer = (int(v) for v in err.tolist())
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
        raise SignalTimeoutError(f"{op}: unknown error record {err.tolist()}")


class DeferredErrorCheck:
    """Error records checked without a host sync on the hot path (CUDA): each record is copied to
    pinned memory behind an event, and a later call raises once that event has completed. The
    cost: a timed-out call returns before its error is known; the next call (or ``flush``)
    raises it."""

    def __init__(self):
        self._pending: list = []

    def submit(self, err: torch.Tensor, op: str, epoch: int) -> None:
        if err.device.type != "cuda":
            raise_if_timed_out(err, op, epoch)
            return
        host = torch.empty(4, dtype=torch.int32, pin_memory=True)
        host.copy_(err, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._pending.append((event, host, op, epoch))
        self.poll()

    def poll(self) -> None:
        while self._pending and self._pending[0][0].query():
            _, host, op, epoch = self._pending.pop(0)
            raise_if_timed_out(host, op, epoch)

    def flush(self) -> None:
        """Wait for every pending record and raise the first error."""
        while self._pending:
            event, host, op, epoch = self._pending.pop(0)
            event.synchronize()
            raise_if_timed_out(host, op, epoch)
