"""The process world: a CUDA process group on one NVLink node as a peer-memory world.

Symmetric buffers come from torch's symmetric memory (peer-mapped allocations, exchanged by
``rendezvous``) or, where this torch lacks it (or ``OVERLAPKERNELS_PEER_MEMORY=ipc`` asks, e.g.
where it fails on a platform), from CUDA IPC (``cudaMalloc`` + ``cudaIpcOpenMemHandle`` in
csrc/ipc.cu, handles exchanged over the group).
Either way the peer-pointer tables the kernels get are NVLink addresses of the other GPUs.
``OVERLAPKERNELS_PEER_MEMORY`` = ``auto`` (default: symmetric memory when torch has it), ``symm_mem``
or ``ipc`` chooses; every rank must choose the same (checked). The copy engine is a CUDA side
stream. Control (barriers) goes through the process group.

Not yet run on a multi-GPU node by this project: the algorithms are proven in the thread world
(CPU and one GPU); this class only supplies buffers, a stream and a barrier to them.
"""
from __future__ import annotations

import atexit
import math
import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist

from ..kernels.errors import new_error_record
from .collectives import all_gather_objects, refuse_together
from .group_cache import group_key, per_group_cache
from .peer_access import failing_pairs, peer_access_problem
from .side_stream import CudaSideStream, hardware_queues
from .symmetric import SymmetricTensor


PEER_MEMORY_ENV = "OVERLAPKERNELS_PEER_MEMORY"
PEER_MEMORY_KINDS = ("auto", "symm_mem", "ipc")
TIMEOUT_ENV = "OVERLAPKERNELS_PEER_TIMEOUT"  # seconds a symm/fused device wait may spin (default 60)
DEFAULT_TIMEOUT_S = 60.0
IPC_GRANULE = 2 << 20  # bytes: what CUDA IPC allocations are rounded up to
MAX_TIMEOUT_S = 1e9  # ~31 years: the device clock's budget is nanoseconds in an int64 (9.2e9 s at most)


def peer_wait_timeout() -> float:
    """``$OVERLAPKERNELS_PEER_TIMEOUT`` seconds (default 60), read at every call, so it can be set
    between calls; the same on every rank or the ranks report timeouts at different moments."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not 0 < value <= MAX_TIMEOUT_S:  # (a larger one overflowed the kernels' budget: a failed launch mid-call)
        raise ValueError(f"{TIMEOUT_ENV}={raw!r}: expected a positive number of seconds, at most {MAX_TIMEOUT_S:.0e}")
    return value


def torch_has_symmetric_memory() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return all(hasattr(symm_mem, name) for name in ("empty", "rendezvous"))  # empty(): torch >= 2.5


def resolve_peer_memory(requested: str, *, has_symm_mem: bool, ipc_built: bool) -> tuple[str | None, str | None]:
    """-> (kind, None), or (None, why neither can serve). ``requested``: a PEER_MEMORY_KINDS value."""
    if requested not in PEER_MEMORY_KINDS:
        raise ValueError(f"{PEER_MEMORY_ENV}={requested!r}: expected one of {list(PEER_MEMORY_KINDS)}")
    if requested in ("auto", "symm_mem") and has_symm_mem:
        return "symm_mem", None
    if requested in ("auto", "ipc") and ipc_built:
        return "ipc", None
    from ..kernels.cuda import BUILD_HINT

    if requested == "symm_mem":
        return None, f"{PEER_MEMORY_ENV}=symm_mem but this torch ({torch.__version__}) has no symmetric memory"
    why = "" if requested == "ipc" else f"this torch ({torch.__version__}) has no symmetric memory and "
    return None, f"{why}CUDA IPC needs the overlapkernels CUDA library, which is not built; {BUILD_HINT}"


def symm_mem_peer_views(handle, offsets: list, local: torch.Tensor, rank: int) -> tuple:
    """Every rank's copy of ``local`` from a symmetric-memory ``handle``: rank r's tensor starts
    ``offsets[r]`` bytes into its block (``handle.get_buffer`` counts from the block base).
    Checked: our own view must be ``local`` itself, since the kernels index peers by address."""
    item = local.element_size()
    hint = f"(torch {torch.__version__}); {PEER_MEMORY_ENV}=ipc on every rank uses CUDA IPC instead"
    for r, offset in enumerate(offsets):
        if not isinstance(offset, int) or offset < 0 or offset % item:
            raise RuntimeError(f"torch symmetric memory: rank {r}'s buffer starts {offset!r} bytes into its "
                               f"block, expected a non-negative multiple of {item} {hint}")
    peers = tuple(handle.get_buffer(r, tuple(local.shape), local.dtype, offset // item)
                  for r, offset in enumerate(offsets))
    if peers[rank].data_ptr() != local.data_ptr():
        raise RuntimeError(f"torch symmetric memory: rank {rank}'s view of its own buffer is at "
                           f"{peers[rank].data_ptr():#x}, not at the tensor's address {local.data_ptr():#x} {hint}")
    return peers


BOOT_ID_PATH = "/proc/sys/kernel/random/boot_id"


def host_identity() -> str:
    """Which machine this process runs on: its host name and, where Linux has one, the kernel's boot
    id. Containers on different nodes can share a host name (one image's, a pod template's), never a
    boot id; the ranks of one node share both. Peer memory across nodes cannot map, and there the
    ranks would fail one by one in the middle of setting it up."""
    name = socket.gethostname()
    try:
        with open(BOOT_ID_PATH) as f:
            boot = f.read().strip()
    except OSError:  # not Linux, or /proc hidden: the name alone
        return name
    return f"{name} (boot {boot[:8]})" if boot else name


def requested_peer_memory() -> str:
    return os.environ.get(PEER_MEMORY_ENV, "auto")


def _device_uuid(device: torch.device) -> str:
    """Identifies the physical GPU (indices differ between processes with other visible devices)."""
    if device.type != "cuda":
        return str(device)
    return str(getattr(torch.cuda.get_device_properties(device), "uuid", device))


def peer_memory_unavailable_reason(device: torch.device) -> str | None:
    """None when symmetric memory or CUDA IPC can serve ``device``; else why not. (That the group
    sits on one node is checked where the ranks meet: ``ProcessPeerWorld``, ``group_has_peer_memory``.)"""
    if device.type != "cuda":
        return f"tensors are on {device}, peer memory needs CUDA"
    from ..kernels import cuda as cuda_lib
    from ..kernels.triton.tile_gemm import reserved_sms

    peer_wait_timeout()  # bad settings raise here, before anything communicates
    reserved_sms()
    _, why = resolve_peer_memory(requested_peer_memory(), has_symm_mem=torch_has_symmetric_memory(),
                                 ipc_built=cuda_lib.is_loadable())
    return why


_group_peer_memory: dict = per_group_cache()


def group_has_peer_memory(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether every rank of ``group`` can use peer memory, they all sit on one host, and their GPUs
    have peer access with native atomics (``peer_access``).
    Collective (once per group and setting, then cached): every rank calls it at the same point,
    and every rank gets the same answer. Why ask the ranks rather than the launcher's numbering
    (LOCAL_WORLD_SIZE): that can be inherited from an outer launcher, ranks can be renumbered and
    nodes can differ in size, and ranks that disagreed would then disagree on what to run."""
    key = (group_key(group), device, os.environ.get(PEER_MEMORY_ENV))
    if key not in _group_peer_memory:
        try:
            able, error = peer_memory_unavailable_reason(device) is None, None
        except ValueError as exc:  # a bad setting here: every rank is told, none is left waiting
            able, error = False, str(exc)
        mine = (_device_uuid(device), failing_pairs()) if able else (None, {})
        everyone = all_gather_objects((host_identity(), able, error, *mine), group, device)
        if errors := [f"rank {dist.get_global_rank(group, r)}: {e}" for r, (_, _, e, *_) in enumerate(everyone) if e]:
            raise ValueError("; ".join(errors))
        _group_peer_memory[key] = (len({host for host, *_ in everyone}) == 1 and all(ok for _, ok, *_ in everyone)
                                   and peer_access_problem([u for *_, u, _ in everyone],
                                                           [pairs for *_, pairs in everyone]) is None)
    return _group_peer_memory[key]


def warn_single_hardware_queue() -> None:
    """CUDA_DEVICE_MAX_CONNECTIONS=1 (which Megatron-LM asks for its own overlap) puts every stream
    of the process in one hardware queue: symm/fused's copy-engine pulls, queued behind their flag
    waits, then hold up the GEMM behind them. Results stay right, but nothing overlaps - say so."""
    if (queues := hardware_queues()) is not None and queues < 2:
        warnings.warn(f"CUDA_DEVICE_MAX_CONNECTIONS={queues}: one hardware queue for every stream, so method='symm'/"
                      "'fused' run their transfers and GEMMs one after the other (correct, not overlapped); set it "
                      "to 2 or more (8, CUDA's default) for these ops", stacklevel=4)


class ProcessPeerWorld:
    """``rank``/``world_size`` of ``group``, symmetric allocation, workspaces, a copy stream."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device
        self._workspaces: dict = {}
        self._side = None
        from ..kernels import cuda as cuda_lib
        from ..kernels.triton.signals import DeferredErrorCheck

        self._errors = DeferredErrorCheck()
        from ..kernels.triton.tile_gemm import reserved_sms

        try:  # bad settings too: said in the exchange, not raised here alone
            peer_wait_timeout()
            reserved_sms()
            kind, why = resolve_peer_memory(requested_peer_memory(), has_symm_mem=torch_has_symmetric_memory(),
                                            ipc_built=cuda_lib.is_loadable())
        except ValueError as exc:
            kind, why = None, str(exc)
        # a rank that cannot take part still joins the exchange (a collective its peers are in) and
        # says why, so every rank raises rather than some waiting for it
        mine = _device_uuid(device) if kind else None
        exchanged = all_gather_objects((kind, mine, host_identity(), failing_pairs() if kind else {},
                                        None if kind else why), group, device)
        if unable := [f"rank {dist.get_global_rank(group, r)}: {w}" for r, (*_, w) in enumerate(exchanged) if w]:
            raise ValueError("; ".join(unable))
        ranks = [entry[:4] for entry in exchanged]
        kinds, hosts = [k for k, *_ in ranks], sorted({h for _, _, h, _ in ranks})
        if len(set(kinds)) > 1:  # mixed kinds would deadlock in alloc_symmetric
            raise ValueError(f"ranks chose different peer memory {kinds} (set {PEER_MEMORY_ENV} alike on every "
                             "rank, and install the same torch and CUDA library everywhere)")
        if len(hosts) > 1:  # every rank sees the same hosts, so every rank raises
            raise ValueError(f"peer memory ('symm'/'fused') needs the group on one node; its ranks are on {hosts}: "
                             "use 'decomposed' or 'baseline'")
        if problem := peer_access_problem([uuid for _, uuid, _, _ in ranks], [pairs for *_, pairs in ranks]):
            raise ValueError(f"peer memory ('symm'/'fused'): {problem}; use 'decomposed' or 'baseline'")
        self.peer_memory = kind
        # ranks sharing this GPU (tests, or MPS): each persistent kernel takes only its share of SMs,
        # or ranks spinning on each other's signals could hold every SM
        self.ranks_per_device = max(1, sum(uuid == mine for _, uuid, _, _ in ranks))
        if device.type == "cuda":
            warn_single_hardware_queue()

    @property
    def wait_timeout(self) -> float:
        """Seconds a device-side wait spins before it gives up and the op raises."""
        return peer_wait_timeout()

    def error_record(self) -> torch.Tensor:
        """A call's device error record (its waits write it; check_errors reads it)."""
        return new_error_record(self.device)

    def check_errors(self, err: torch.Tensor, op: str, epoch: int) -> None:
        """Raise a wait's timeout a call late rather than sync the host on every call."""
        self._errors.submit(err, op, epoch)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def alloc_symmetric(self, shape, dtype: torch.dtype, *, fill=0) -> SymmetricTensor:
        """Collective: every rank calls it in the same order. Never an inference tensor (see the
        thread world's)."""
        with torch.inference_mode(False):
            return self._alloc_symmetric(shape, dtype, fill)

    def _alloc_symmetric(self, shape, dtype: torch.dtype, fill) -> SymmetricTensor:
        if self.peer_memory == "ipc":
            return self._alloc_ipc(tuple(shape), dtype, fill)
        import torch.distributed._symmetric_memory as symm_mem

        problem = None
        try:
            with warnings.catch_warnings():  # deprecated where torch no longer needs it
                warnings.simplefilter("ignore", FutureWarning)
                warnings.simplefilter("ignore", DeprecationWarning)
                symm_mem.enable_symm_mem_for_group(self.group.group_name)  # older torch needs it; idempotent
            local = symm_mem.empty(tuple(shape), dtype=dtype, device=self.device)
            local.fill_(fill)
        except RuntimeError as exc:  # (out of memory on this rank): told to every rank, not raised alone
            problem = f"rank {self.rank}: {str(exc).splitlines()[0][:200]}"
        _raise_where_any(all_gather_objects(problem, self.group, self.device),
                         f"torch symmetric memory could not allocate {tuple(shape)} {dtype}")
        try:
            handle = symm_mem.rendezvous(local, self.group.group_name)
        except RuntimeError as exc:
            raise RuntimeError(f"torch symmetric memory failed on {self.device} ({exc}); "
                               f"{PEER_MEMORY_ENV}=ipc on every rank uses CUDA IPC instead") from exc
        # Where the tensor sits in its symmetric block: torch >= 2.11 carves symm_mem.empty()
        # tensors out of a memory pool, so buffer_ptrs (and get_buffer's offset 0) are block bases,
        # not tensor addresses. Ranks exchange their offsets rather than assume them equal; None
        # where rendezvous gave no handle (newer torch warns and returns None for a tensor outside
        # its pool), so that every rank raises, not only that one while the others wait.
        # A handle of another group (torch caches rendezvous per block and group name, and names
        # come back after destroy_process_group) counts as none.
        foreign = handle is not None and (getattr(handle, "world_size", self.world_size) != self.world_size
                                          or getattr(handle, "rank", self.rank) != self.rank)
        offset = None if handle is None or foreign else local.data_ptr() - handle.buffer_ptrs[self.rank]
        offsets = all_gather_objects(offset, self.group, self.device)
        if None in offsets:
            missing = [r for r, o in enumerate(offsets) if o is None]
            raise RuntimeError(f"torch symmetric memory gave no handle (or one of another group's size or rank) on "
                               f"ranks {missing} of the group; {PEER_MEMORY_ENV}=ipc on every rank uses CUDA IPC instead")
        # nobody may write into a peer's buffer before that peer's fill has landed
        torch.cuda.current_stream(self.device).synchronize()
        self.barrier()
        peers = symm_mem_peer_views(handle, offsets, local, self.rank)
        ptrs = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=self.device)
        return SymmetricTensor(self.rank, self.world_size, local, ptrs, peers, handle)

    def _alloc_ipc(self, shape: tuple, dtype: torch.dtype, fill) -> SymmetricTensor:
        from ..kernels import cuda as cuda_lib

        nbytes, handle, problem = max(math.prod(shape), 1) * dtype.itemsize, None, None
        try:
            # whole 2 MiB granules: the driver may carve small cudaMallocs out of one larger block, and
            # an IPC handle then shares the whole block (CUDA programming guide, IPC): two tiny signal
            # pads of one rank could map onto each other in a peer
            ptr, handle = cuda_lib.ipc_alloc(-(-nbytes // IPC_GRANULE) * IPC_GRANULE, self.device)
            local = cuda_lib.tensor_at(ptr, shape, dtype, self.device)
            local.fill_(fill)
        except (cuda_lib.CudaLibraryError, RuntimeError) as exc:  # told to every rank, not raised alone
            problem = f"rank {self.rank}: {str(exc).splitlines()[0][:200]}"
        exchanged = all_gather_objects((handle, problem), self.group, self.device)
        _raise_where_any([p for _, p in exchanged], f"CUDA IPC could not allocate {nbytes} bytes")
        handles = [h for h, _ in exchanged]
        peers, problem = [], None
        for r, h in enumerate(handles):
            try:
                peers.append(local if r == self.rank else
                             cuda_lib.tensor_at(cuda_lib.ipc_open(h, self.device), shape, dtype, self.device))
            except cuda_lib.CudaLibraryError as exc:
                problem = f"rank {self.rank} cannot map rank {r}'s buffer ({exc})"
                break
        # every rank learns of a rank that could not map a peer, rather than wait for it at the barrier
        if problems := [p for p in all_gather_objects(problem, self.group, self.device) if p]:
            raise RuntimeError(f"CUDA IPC: {'; '.join(problems)}. A common cause: each rank sees only its own GPU "
                               "(CUDA_VISIBLE_DEVICES per rank); let every process see the node's GPUs and pick its "
                               f"own, or set {PEER_MEMORY_ENV}=symm_mem")
        peers = tuple(peers)
        torch.cuda.current_stream(self.device).synchronize()  # our fill lands before any peer writes
        self.barrier()
        ptrs = torch.tensor([p.data_ptr() for p in peers], dtype=torch.int64, device=self.device)
        # Buffers live as long as the process (like the workspace cache that holds them): freeing
        # one while a peer still maps it would be undefined, and process exit releases both.
        return SymmetricTensor(self.rank, self.world_size, local, ptrs, peers, handle=("ipc", ptr, handles))

    def workspace(self, key, factory):
        if key not in self._workspaces:
            with torch.inference_mode(False):  # (kept across calls: see alloc_symmetric)
                self._workspaces[key] = factory(self)
        return self._workspaces[key]

    def side_stream(self) -> CudaSideStream:
        if self._side is None:
            # a stream per world, as before streams of our own: two groups' ops (TP and CP) issued from
            # different streams must not queue behind each other's spin-waits
            self._side = CudaSideStream(self.device, slot=("world", self.group.group_name))
        return self._side


# Workspaces hold symmetric buffers that are expensive to set up (a collective rendezvous), so
# each (group, device) keeps one world for the life of the process, like torch's own
# symmetric-memory workspace cache - also once its group is destroyed (see group_cache).
_worlds: dict = per_group_cache(keep_values_alive=True)


def _raise_where_any(problems: list, what: str) -> None:
    """Every rank raises where any rank's set-up step failed (each said so in an exchange): a rank
    raising alone left its peers waiting in the next collective until the group's timeout."""
    if said := [p for p in problems if p]:
        raise RuntimeError(f"{what}: {'; '.join(said)}")


def process_peer_world(group: dist.ProcessGroup, device: torch.device) -> ProcessPeerWorld:
    key = (group_key(group), device, requested_peer_memory())
    if key not in _worlds:
        _worlds[key] = ProcessPeerWorld(group, device)
    return _worlds[key]


def check_pending_errors() -> None:
    """Wait for the device error records of every symm/fused call so far and raise the first
    timeout (errors are otherwise raised one call late, to keep host syncs off the hot path).
    ``ok.check_pending_errors()``; ``fsdp.save`` and the Trainer's step call it, so a timed-out
    call's garbage is not checkpointed."""
    from .group_cache import retired

    for world in list(_worlds.values()) + [w for w in retired() if isinstance(w, ProcessPeerWorld)]:
        world._errors.flush()


def check_pending_errors_together(group: dist.ProcessGroup, what: str, device: torch.device) -> None:
    """``check_pending_errors`` on every rank of ``group`` (collective): a timeout pending on any rank
    raises on all of them, before ``what`` (a checkpoint, an optimizer step) uses the results."""
    from ..kernels.errors import PeerFailedError

    error = None
    try:
        check_pending_errors()
    except Exception as exc:  # noqa: BLE001 - a device error too: every rank must learn of it
        error = exc
    refuse_together(error, group, what, device, elsewhere=PeerFailedError, verb="failed")


def report_pending_errors() -> bool:
    """Prints a pending timeout (one in the last call would otherwise go unreported); whether there
    was one. Never raises."""
    try:
        check_pending_errors()
    except Exception as exc:  # noqa: BLE001 - exiting: report, never raise
        print(f"overlapkernels: {type(exc).__name__}: {exc}", file=sys.stderr)
        return True
    return False


def exit_failed_on_pending_errors() -> None:
    """At exit: a timeout still pending is printed and the process exits with status 1, not 0 - a
    launcher or scheduler must see that the job's last results are garbage. Registered when this
    module is imported (``import overlapkernels``), so it runs after the exit handlers registered
    later (the user's, wandb's); ``os._exit`` skips those registered before, so logging is shut
    down (flushed) here first. An exit status the program asked for (``sys.exit(3)``) becomes 1."""
    if report_pending_errors():
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)


atexit.register(exit_failed_on_pending_errors)
