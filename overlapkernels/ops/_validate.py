"""Argument checks shared by the fused ops; all run before the op communicates (the cross-rank one
under TORCH_DISTRIBUTED_DEBUG=DETAIL compares calls, and errors, before that)."""
from __future__ import annotations

import contextlib
import numbers

import torch
import torch.distributed as dist

from .._compat import dtensor_type
from ..comm.collectives import all_gather_objects
from ..parallel import resolve_group


def group_size(group) -> int:
    """World size of a ProcessGroup, or of a peer-memory world handle (thread world rank)."""
    if hasattr(group, "alloc_symmetric"):
        return group.world_size
    return dist.get_world_size(resolve_group(group))


def is_peer_world(group) -> bool:
    return hasattr(group, "alloc_symmetric")


def check_size(value, what: str) -> int:
    """A layer size (features, heads): an integer >= 1 (torch's own layers fail later, or build an
    empty or negative-sized layer, for 0, -4 or 2.0)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{what}={value!r}: expected an integer >= 1")
    return int(value)


def check_flag(value, name: str) -> bool:
    """A switch: a bool (numpy's, or a 0-d bool tensor or array, too), 0 / 1, or None for off (torch's
    own layers read ``bias=None`` and ``bias=0`` as no bias). Anything else is refused, a string
    above all: ``sequence_parallel="no"`` is truthy, so it would silently mean on (and another input
    shape)."""
    if value is None:
        return False
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    # numpy's bool scalar (named bool_ before numpy 2, bool since) and 0-d bool arrays or tensors
    if str(getattr(value, "dtype", "")) in ("bool", "torch.bool") and tuple(getattr(value, "shape", (0,))) == ():
        return bool(value)
    raise TypeError(f"{name}={value!r}: expected a bool")


def check_not_dtensor(name: str, value) -> None:
    """A DTensor carries its own placements; these ops take each rank's local part and a group, and
    a DTensor would reach the collectives, which have no sharding rule for them, deep inside torch."""
    if isinstance(value, dtensor_type()):
        raise TypeError(f"{name} is a DTensor ({value.placements}); pass its local part ({name}.to_local()) and "
                        "the mesh dimension's group (mesh.get_group(dim))")


def check_tensor(name: str, value, min_dim: int = 1) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    check_not_dtensor(name, value)
    if value.layout != torch.strided or value.is_nested:  # (a sparse b failed after the ring had started)
        raise TypeError(f"{name} is a {'nested' if value.is_nested else str(value.layout).replace('torch.', '')} "
                        "tensor; these ops take dense (strided) tensors (.to_dense() of a sparse one)")
    if value.dim() < min_dim:
        raise ValueError(f"{name} must have at least {min_dim} dims, got shape {tuple(value.shape)}")
    return value


# The floating dtypes the ops compute in. fp8 needs per-tensor scales (torch._scaled_mm) that these
# ops do not carry; integer, bool and complex inputs have no place in a matmul or a softmax. Without
# this check they failed inside the collective (gloo: "Invalid scalar type") or, for decomposed
# reduce-scatter of fp8, in the first add after the ring had started.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_float_dtype(name: str, value: torch.Tensor) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{name}.dtype={value.dtype}: expected one of {[str(d) for d in FLOAT_DTYPES]}")


def check_weights(b, a: torch.Tensor, a_name: str, *, linear: bool = False, many: bool | None = None
                  ) -> tuple[list, bool]:
    """``b`` as a list of [K, N] tensors matching ``a``; the bool says whether it was a single one.
    ``linear``: ``b`` holds ``F.linear``'s [N, K] weights (the ``*_linear`` forms), checked and named
    in those terms and returned transposed to [K, N]. ``many``: True, a sequence of them only (a
    shared gather); False, one tensor only; None, either."""
    b_name, layout, k_dim = ("weight", "[N, K]", 1) if linear else ("b", "[K, N]", 0)
    single = isinstance(b, torch.Tensor)
    if many is False and not single:
        raise TypeError(f"{b_name} must be a single {layout} tensor, got {type(b).__name__}")
    if many and single:
        raise TypeError(f"{b_name}s must be a list/tuple of {layout} tensors sharing the gather, got a single tensor "
                        f"(pass [{b_name}])")
    if not single and not isinstance(b, (str, bytes)) and hasattr(b, "__iter__"):
        b = list(b)  # a generator too
    if not single and not (isinstance(b, list) and b):
        what = "a non-empty list/tuple of " + ("them" if many is None else f"{layout} tensors")
        raise TypeError((f"{b_name} must be a {layout} tensor or {what}" if many is None else f"{b_name}s must be {what}")
                        + f", got {type(b).__name__}" + (" (empty)" if isinstance(b, list) else ""))
    bs = [b] if single else b
    k = a.shape[-1]
    for i, w in enumerate(bs):
        name = b_name if single else f"{b_name}[{i}]"
        check_tensor(name, w)
        if w.dim() != 2:
            raise ValueError(f"{name} must be 2-D {layout}, got shape {tuple(w.shape)}")
        if w.shape[k_dim] != k:
            raise ValueError(f"{name}.shape[{k_dim}]={w.shape[k_dim]} does not match {a_name}.shape[-1]={k} (the "
                             "contracted dim K)")
        if w.dtype != a.dtype:
            raise ValueError(f"{name}.dtype={w.dtype} does not match {a_name}.dtype={a.dtype}")
        if w.device != a.device:
            raise ValueError(f"{name} is on {w.device} but {a_name} is on {a.device}; expected one device")
    return ([w.t() for w in bs] if linear else bs), single


def check_dim(name: str, dim, tensor: torch.Tensor, tensor_name: str, *, last_ok: bool = False) -> int:
    """Normalise a non-negative/negative dim that must not be the contracted (last) one of an input
    (``last_ok``: a dim of the output, which has as many, its last being N)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    nd = tensor.dim()
    if not -nd <= dim < nd:
        raise ValueError(f"{name}={dim} is out of range for {tensor_name} with {nd} dims")
    if dim % nd == nd - 1 and not last_ok:  # messages keep the caller's value: -1 stays -1
        raise ValueError(f"{name}={dim} is the last dim of {tensor_name}, which the matmul contracts; expected one "
                         f"of 0..{nd - 2} (or {-nd}..-2)")
    return dim % nd


def check_ids(ids: torch.Tensor, bad: torch.Tensor, error, device_message: str) -> None:
    """Raise ``error(first bad id)`` where ``bad`` (a mask over ``ids``) has any; on CUDA a
    device-side assert instead (as torch's own embedding and cross-entropy do): reading the mask
    would sync the host on every call. Under torch.compile the same assert on every device (a
    data-dependent branch would break the graph), a RuntimeError with ``device_message``."""
    if not ids.is_cuda and not torch.compiler.is_compiling():
        if bool(bad.any()):
            raise error(int(ids[bad][0]))
    else:
        torch._assert_async(~bad.any(), device_message)


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        grad = " (gets a gradient)" if value.requires_grad and torch.is_grad_enabled() else ""
        return f"{list(value.shape)} {str(value.dtype).removeprefix('torch.')}{grad}"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_describe(v) for v in value) + "]"
    return repr(value)


class _Call:
    """What the ranks compare: the op sets ``args`` once its own checks have passed."""
    args: dict | None = None


@contextlib.contextmanager
def same_call_on_every_rank(group, op: str, device=None):
    """Wraps an op's argument checks. Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (torch's own switch)
    the ranks of ``group`` then compare their calls (``call.args``: shapes, dtypes, whether a
    gradient flows, options that change the communication) and their checks' errors, and every
    rank raises, naming the ranks and what differs, before any communication of the op. Why our
    own: torch checks its collectives that way, but not our P2P rings and peer-memory methods, where
    a mismatch aborts gloo or hangs; and a rank whose checks failed would otherwise leave the others
    waiting. Off by default: it costs an object all-gather (a host sync on NCCL) per call."""
    call = _Call()
    if is_peer_world(group) or dist.get_debug_level() != dist.DebugLevel.DETAIL:
        yield call
        return
    error = None
    try:
        yield call
    except Exception as exc:  # told to the other ranks first, then raised here as it was
        error = exc
    mine = (None if error is None else f"{type(error).__name__}: {error}",
            {name: _describe(value) for name, value in (call.args or {}).items()})
    everyone = all_gather_objects(mine, group, device)
    if error is not None:
        raise error
    hint = "every rank must make the same call (TORCH_DISTRIBUTED_DEBUG=DETAIL check)"
    failed = [f"rank {r}: {theirs}" for r, (theirs, _) in enumerate(everyone) if theirs]
    if failed:
        raise ValueError(f"{op}: other ranks' arguments were rejected ({'; '.join(failed)}); {hint}")
    args = [theirs for _, theirs in everyone]
    differ = [name for name in mine[1] if len({str(theirs.get(name)) for theirs in args}) > 1]
    if differ:
        ranks = "; ".join(f"rank {r}: " + ", ".join(f"{n}={theirs.get(n)}" for n in differ)
                          for r, theirs in enumerate(args))
        raise ValueError(f"{op}: the ranks of the group disagree on {', '.join(differ)} ({ranks}); {hint}")
