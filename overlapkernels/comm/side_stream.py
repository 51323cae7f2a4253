"""Copy-engine streams: work submitted runs in order, concurrently with the submitting rank.

``ThreadSideStream`` (CPU thread world): a thread. ``CudaSideStream``: a CUDA stream; copies
submitted to it are cudaMemcpyAsync, i.e. the copy engine, not SMs. Both have ``submit(fn)`` and
``synchronize()``, after which the rank's work is ordered after everything submitted.
"""
from __future__ import annotations

import os
import queue
import threading

import torch


def hardware_queues() -> int | None:
    """CUDA_DEVICE_MAX_CONNECTIONS as CUDA reads it (8 when unset: its default), None when it is no
    number: how many hardware queues the process's streams share."""
    raw = os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    return int(raw) if raw.strip().isdigit() else None


class ThreadSideStream:
    """A thread that runs submitted callables in order: the thread world's stand-in for a CUDA
    side stream driving the copy engine. ``synchronize`` waits and re-raises the first error."""

    def __init__(self, name: str):
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            fn, done = self._queue.get()
            if fn is None:
                done.set()
                return
            try:
                if self._error is None:
                    fn()
            except BaseException as exc:  # reported by synchronize, on the rank's thread
                self._error = exc
            finally:
                done.set()

    def submit(self, fn, keep_alive=()) -> threading.Event:
        """``keep_alive``: tensors ``fn`` reads (the closure holds them here anyway). ``fn`` runs in
        the caller's grad and inference modes, which are per thread: a copy into a tensor made under
        ``inference_mode`` fails outside it (and the rank would spin on the flag it never sets)."""
        done = threading.Event()
        inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

        def in_callers_modes():
            with torch.inference_mode(inference), torch.set_grad_enabled(grad):
                fn()

        self._queue.put((in_callers_modes, done))
        return done

    def synchronize(self, timeout: float | None = None) -> None:
        if not self.submit(lambda: None).wait(timeout):
            raise TimeoutError(f"{self._thread.name}: side stream still busy after {timeout} s")
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self._queue.put((None, threading.Event()))


# Streams of our own, one per (device, slot), made once: never destroyed, since the caching allocator
# may still record events on a stream that tensors were record_stream'ed to after their last use.
_own_streams: dict = {}
_own_streams_lock = threading.Lock()


def own_streams(device, slots) -> list:
    """The streams of ``slots`` on ``device``, those not made yet made now, one after another.

    High priority, as Flux's copy stream: copies get ahead of queued compute. Streams of our own
    (csrc/stream.cu) where the CUDA library is built: torch's pooled streams are handed out
    round-robin and ProcessGroupNCCL draws from the same pools (the high-priority one under
    TORCH_NCCL_HIGH_PRIORITY=1), and a collective sharing a side stream would queue behind a
    spin-wait that may wait, through a peer, on that collective. Made back to back as a
    precaution: streams sharing one of the CUDA_DEVICE_MAX_CONNECTIONS hardware queues run in that
    queue's order, so a spin-wait there could hold up the other stream's work, which may be what it
    waits for (the one-GPU thread world: one rank's wait, a peer's signal); streams made together
    are more likely to get queues of their own (the driver's assignment is not documented). The
    thread world's hangs on an H200 outlived this change: their likely cause was reading error
    records behind spin-waits (signals.raise_if_timed_out). Without the library, torch's
    high-priority pool."""
    from ..kernels import cuda as cuda_lib

    device = torch.device(device)
    with _own_streams_lock:  # (thread-world ranks ask concurrently)
        for slot in slots:
            key = (device, slot)
            if key not in _own_streams:
                _own_streams[key] = (cuda_lib.own_stream(device) if cuda_lib.is_loadable()
                                     else torch.cuda.Stream(device, priority=-1))
        return [_own_streams[(device, slot)] for slot in slots]


class CudaSideStream:
    def __init__(self, device: torch.device, slot=0):
        """``slot``: which of this device's own streams (a thread-world rank's, reused by each run; a
        process world's, by its group's name, which a re-created group reuses). See own_streams."""
        self.stream = own_streams(device, [slot])[0]

    def submit(self, fn, keep_alive=()) -> None:
        """Run ``fn`` on the side stream after everything the rank enqueued so far. Tensors in
        ``keep_alive`` (made on the rank's stream, read here) are not reused by the allocator until
        the side stream is done with them."""
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # that device's, whatever is current
        for t in keep_alive:
            t.record_stream(self.stream)
        with torch.cuda.stream(self.stream):
            fn()

    def synchronize(self, timeout: float | None = None) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)  # stream order, no host sync

    def close(self) -> None:
        pass
