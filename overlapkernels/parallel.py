"""Parallel state: one DeviceMesh with axes ("dp", "pp", "cp", "tp"), tp innermost.

tp is the fastest-varying axis, so consecutive ranks form a TP group (ranks 0,1 | 2,3 for tp=2 on
4 ranks) and TP traffic stays inside an NVLink node, as in Megatron. No global state: callers keep
the returned ``ParallelDims`` and pass it (or its groups) on.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from . import _compat

AXES = ("dp", "pp", "cp", "tp")
DEFAULT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class ParallelDims:
    """Sizes, ranks and process groups of the four parallel axes of this rank."""

    mesh: "torch.distributed.device_mesh.DeviceMesh"
    dp_size: int
    pp_size: int
    cp_size: int
    tp_size: int

    @property
    def world_size(self) -> int:
        return self.dp_size * self.pp_size * self.cp_size * self.tp_size

    @property
    def rank(self) -> int:
        return dist.get_rank()

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(_check_axis(axis))

    def axis_rank(self, axis: str) -> int:
        return self.mesh.get_local_rank(_check_axis(axis))

    dp_group = property(lambda self: self.group("dp"))
    pp_group = property(lambda self: self.group("pp"))
    cp_group = property(lambda self: self.group("cp"))
    tp_group = property(lambda self: self.group("tp"))
    dp_rank = property(lambda self: self.axis_rank("dp"))
    pp_rank = property(lambda self: self.axis_rank("pp"))
    cp_rank = property(lambda self: self.axis_rank("cp"))
    tp_rank = property(lambda self: self.axis_rank("tp"))


def _check_axis(axis: str) -> str:
    if axis not in AXES:
        raise ValueError(f"axis={axis!r} is not a mesh axis; expected one of {AXES}")
    return axis


def resolve_sizes(world_size: int, *, tp: int, cp: int, pp: int, dp: int) -> dict[str, int]:
    """Validate the axis sizes against ``world_size``; ``dp=-1`` takes what is left."""
    for name, size in (("tp", tp), ("cp", cp), ("pp", pp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name}={size!r}: every axis size must be an integer >= 1")
    if isinstance(dp, bool) or not isinstance(dp, int) or (dp < 1 and dp != -1):
        raise ValueError(f"dp={dp!r}: expected an integer >= 1, or -1 for 'the remaining ranks'")
    inner = tp * cp * pp
    if dp == -1:
        if world_size % inner:
            raise ValueError(
                f"tp*cp*pp = {tp}*{cp}*{pp} = {inner} does not divide world size {world_size}")
        dp = world_size // inner
    if inner * dp != world_size:
        raise ValueError(
            f"tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {inner * dp} != world size {world_size}")
    return {"dp": dp, "pp": pp, "cp": cp, "tp": tp}


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def uses_nccl(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (default: the world) moves CUDA tensors through NCCL: backend "nccl", a
    mixed one ("cpu:gloo,cuda:nccl", torchtitan's), or "undefined" (``init_process_group()`` with
    no backend: gloo for CPU tensors, NCCL for CUDA ones where torch has it). Not an exact compare
    of the backend's name: those last two read as CPU-only, and a job then ran on the CPU or staged
    every message through host copies. The backend config maps each device type to its backend
    ("cpu:gloo,cuda:gloo" for gloo alone, which copies CUDA tensors through the host), also under
    TORCH_DISTRIBUTED_DEBUG=DETAIL, whose wrapper hides the backend's class."""
    return "nccl" in _backend_config(group)


def uses_gloo(group: dist.ProcessGroup | None = None) -> bool:
    """Whether gloo moves any of ``group``'s tensors: "gloo", or a mixed backend whose CPU tensors go
    through it ("cpu:gloo,cuda:nccl", torchtitan's), or "undefined" (gloo for CPU tensors)."""
    return "gloo" in _backend_config(group)


def _backend_config(group: dist.ProcessGroup | None) -> str:
    """"cpu:gloo,cuda:nccl" and the like: each device type's backend (torch < 2.2: its name)."""
    group = group or dist.group.WORLD
    config = getattr(dist, "get_backend_config", None)
    return str(dist.get_backend(group)) if config is None else config(group)


def comm_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s tensors live: this rank's current GPU under NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if uses_nccl(group) else torch.device("cpu")


def concrete_device(device) -> torch.device:
    """``device`` as tensors report theirs: "cuda" names the current GPU by its index (a tensor made
    on "cuda" says cuda:0, and torch.device("cuda") != torch.device("cuda:0")). Without CUDA it is
    left as given (what uses it then fails by name)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device


# where launchers put a process's rank on its node: torchrun, then the MPI launchers (Open MPI,
# MVAPICH, MPICH/Intel MPI, PMI, Cray PALS), then Slurm's srun last (mpirun inside an allocation
# starts its daemons with srun, so every rank it launches inherits SLURM_LOCALID=0)
LOCAL_RANK_VARIABLES = ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MV2_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID",
                        "PMI_LOCAL_RANK", "PALS_LOCAL_RANKID", "SLURM_LOCALID")


def local_rank() -> int:
    """This process's rank on its node, from the first launcher variable set (0 with none)."""
    return next((int(os.environ[name]) for name in LOCAL_RANK_VARIABLES if os.environ.get(name, "").isdigit()), 0)


def local_device_index() -> int:
    """This process's GPU: its rank on the node (torchrun's LOCAL_RANK, else mpirun's or srun's; 0
    with none). A process that sees one GPU (CUDA_VISIBLE_DEVICES per rank) takes it (ranks that
    were all given the same one then share it: not visible from here); a local rank past the GPUs it
    sees is refused by name, rather than two ranks sharing a GPU (NCCL then fails with "Duplicate
    GPU")."""
    name = next((name for name in LOCAL_RANK_VARIABLES if os.environ.get(name, "").isdigit()), None)
    local, visible = local_rank(), torch.cuda.device_count()
    if visible == 1:
        return 0
    if local >= visible:
        raise ValueError(f"{name}={local}: this process sees {visible} GPUs (0..{visible - 1}); start at most "
                         f"{visible} ranks per node, or give each rank its own GPU with CUDA_VISIBLE_DEVICES")
    return local


def _wants_nccl(backend: str) -> bool:
    """"nccl" in any spelling torch takes: "NCCL", or a device map ("cpu:gloo,cuda:nccl")."""
    return "nccl" in backend.lower()


def init_default_process_group(backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT) -> None:
    """Initialise the default group from torchrun's environment, or as a 1-rank world without it.
    With one already there, a ``backend`` asked for must agree with it on NCCL (else a job asking
    for GPUs would run on the CPU without a word)."""
    if dist.is_initialized():
        if backend is not None and _wants_nccl(backend) != uses_nccl():
            raise ValueError(f"backend={backend!r}: the default process group already exists with backend "
                             f"{dist.get_backend()!r}; pass backend=None to use it, or destroy it first")
        return
    backend = backend or default_backend()
    if _wants_nccl(backend):
        if not torch.cuda.is_available():
            raise ValueError(f"backend={backend!r} needs CUDA GPUs, and this process sees none; use 'gloo' (or None: "
                             "nccl where CUDA is available, else gloo)")
        torch.cuda.set_device(local_device_index())
    launcher = [name for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if name in os.environ]
    if launcher and int(os.environ.get("WORLD_SIZE", 1)) > 1 and len(launcher) < 4:  # half a launcher
        raise ValueError(f"the environment sets {', '.join(launcher)} but not all of RANK, WORLD_SIZE, MASTER_ADDR "
                         "and MASTER_PORT: launch with torchrun (or set all four)")
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:  # a single process with no launcher: a world of one, no sockets needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


def resolve_timeout(timeout) -> timedelta | None:
    """``timeout`` as a timedelta: seconds (int/float) or a timedelta, finite and at least 1 ms
    (gloo counts whole milliseconds); None stays None."""
    if timeout is not None and not isinstance(timeout, timedelta) and (
            not isinstance(timeout, (int, float)) or isinstance(timeout, bool)):
        raise TypeError(f"timeout={timeout!r}: expected seconds (int or float) or a datetime.timedelta")
    if timeout is None:
        return None
    try:
        resolved = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    except (OverflowError, ValueError):  # nan, inf, beyond timedelta's range
        resolved = None
    if resolved is None or resolved < timedelta(milliseconds=1):
        raise ValueError(f"timeout={timeout!r}: expected a finite duration of at least 1 ms")
    return resolved


def init_parallel(tp: int = 1, cp: int = 1, pp: int = 1, dp: int = -1, backend: str | None = None, *,
                  timeout: float | timedelta | None = None) -> ParallelDims:
    """Create the ("dp", "pp", "cp", "tp") mesh; initialises the default group when needed.

    Sizes are checked against the world size before any rank communicates, so a bad layout
    raises the same ``ValueError`` on every rank instead of hanging some of them.

    ``timeout`` (seconds or a timedelta) bounds every collective on the mesh's groups (the
    default group too, when it is created here or an axis spans every rank). ``None``: the
    default group's timeout (10 minutes when created here), not the backend's own default for
    new groups (30 minutes on gloo), so a dead peer fails every group alike. A group whose
    collective timed out is broken for good (gloo and NCCL abort it): end the job, or build a
    new mesh.
    """
    timeout = resolve_timeout(timeout)
    world_size = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    try:
        sizes = resolve_sizes(world_size, tp=tp, cp=cp, pp=pp, dp=dp)
    except ValueError as exc:
        if world_size == 1 and "world size" in str(exc) and not dist.is_initialized() and "WORLD_SIZE" not in os.environ:
            raise ValueError(f"{exc}: no launcher set WORLD_SIZE, so this is a 1-rank world; start the ranks "
                             "with torchrun --nproc-per-node N (or set RANK, WORLD_SIZE, MASTER_ADDR and "
                             "MASTER_PORT)") from None
        raise
    init_default_process_group(backend, timeout=timeout or DEFAULT_TIMEOUT)
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if uses_nccl() else "cpu"
    if uses_gloo():  # also a mixed backend's: its CPU collectives (a loss's sums) run on gloo's threads
        _compat.let_gloo_workers_finish_at_exit()
    group_timeout = timeout or _compat.group_timeout(dist.group.WORLD) or DEFAULT_TIMEOUT
    with _compat.new_groups_timeout(group_timeout):  # gloo (torch <= 2.7) fixes it at creation
        mesh = init_device_mesh(device_type, tuple(sizes[a] for a in AXES), mesh_dim_names=AXES)
    for axis in AXES:
        group = mesh.get_group(axis)
        # an axis spanning every rank may be the default group itself: given a timeout, it takes it too
        if timeout is not None or group is not dist.group.WORLD:
            _compat.set_group_timeout(group, group_timeout)
    return ParallelDims(mesh=mesh, dp_size=sizes["dp"], pp_size=sizes["pp"], cp_size=sizes["cp"], tp_size=sizes["tp"])


def resolve_group(group: dist.ProcessGroup | None, what: str = "group") -> dist.ProcessGroup:
    """``group=None`` means the default (world) group everywhere in the API. Anything else that is
    not a process group (a rank number, a mesh dim name) is refused by name here, before the first
    collective would fail on it with an unrelated AttributeError. ``what``: the argument's name."""
    if group is None:
        if not dist.is_initialized():
            raise RuntimeError("no default process group: call ok.init_parallel() (or "
                               "torch.distributed.init_process_group) first, on every rank")
        return dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER:  # what new_group() returns on ranks outside it
        raise ValueError(f"{what}: this rank is not a member of the group (torch.distributed.new_group returns "
                         "GroupMember.NON_GROUP_MEMBER to ranks outside it); call the op only on the group's ranks")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"{what}={group!r}: expected a torch.distributed ProcessGroup or None (for a DeviceMesh "
                        f"dimension pass mesh.get_group(dim)), got {type(group).__name__}")
    return group


def shared_peers(group_a: dist.ProcessGroup, group_b: dist.ProcessGroup) -> list[int]:
    """Global ranks, other than this one, in both groups: none for groups of two different axes of
    one mesh (the dp group and the tp group), some for the world and any group of 2+ ranks."""
    both = set(dist.get_process_group_ranks(group_a)) & set(dist.get_process_group_ranks(group_b))
    return sorted(both - {dist.get_rank()})
