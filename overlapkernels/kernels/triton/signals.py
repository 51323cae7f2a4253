"""Device-side signalling shared by the peer-memory kernels: peer pointers, flags, timed waits.

Flags are int32 and only grow (an epoch or a count), so a signal pad is never reset between calls
and a late reader cannot mistake the previous call's flag for this one's. Every wait gives up
after ``max_spins`` polls and leaves an error record that the host turns into an exception.
"""
import triton
import triton.language as tl

# error record: int32 [4] = (code, rank, chunk, peer); code 0 means no error
ERR_READY_TIMEOUT = tl.constexpr(1)     # waited for a peer to publish a chunk
ERR_CONSUMED_TIMEOUT = tl.constexpr(2)  # waited for a peer to finish reading our previous chunk


@triton.jit
def peer_ptr(table_ptr, peer, like_ptr):
    """``peer``'s buffer from an int64 address table, typed like ``like_ptr``."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(like_ptr.dtype.element_ty))


@triton.jit
def signal_ptr(table_ptr, peer):
    """``peer``'s int32 signal pad from an int64 address table."""
    return tl.load(table_ptr + peer).to(tl.pointer_type(tl.int32))


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
