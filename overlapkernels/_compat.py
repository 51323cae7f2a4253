"""torch / triton version differences, in one place.

The CI machine runs torch 2.13 + triton 3.9; the GPU machine torch 2.11 + triton 3.6; the floor,
torch 2.7 + triton 3.3 (setup.py), was checked with the whole CPU suite and the sm_90 compile check
(lower: triton <= 3.2 cannot compile the fp32 flash backward nor fit the bf16 GEMM's registers for
sm_90). Everything that moved between those versions is looked up here, never ``hasattr``-probed at
call sites.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import types
import warnings

import torch
import torch.distributed as dist

# torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor in favour of *_single.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def eager_under_compile(fn):
    """``torch.compile`` runs ``fn`` eagerly, with a graph break around it, instead of tracing it.

    Why: our ops take ProcessGroups, which dynamo treats as opaque script objects (any attribute
    access is a hard error in torch 2.13, not a graph break), and they drive their own streams,
    device flags and persistent Triton kernels, which a captured graph could not replay. The code
    between them (norms, activations, residuals) still compiles.

    ``torch._disable_dynamo`` (what torch uses on its own functions) imports ``torch._dynamo`` on
    the first call rather than at import: ``torch.compiler.disable`` would import it here, adding
    ~1.5 s to every ``import overlapkernels`` (each rank, each CLI run) that never compiles. Its
    wrapper lives in torch's own file, which dynamo never traces into, so it is skipped even on a
    first call made under ``torch.compile``."""
    lazy = getattr(torch, "_disable_dynamo", None)
    return lazy(fn) if lazy is not None else torch.compiler.disable(fn)


_interp_lock = threading.Lock()
_interp_state = {"active": 0, "scope": None, "installed": False, "fixed": False}
# held while the interpreter rewrites a kernel's source (once per kernel, at its first launch)
_interp_rewrite_lock = threading.RLock()


def fix_triton_interpreter() -> None:
    """Make triton 3.6's interpreter work with numpy >= 2.4. Idempotent.

    Why: while a kernel runs, the 3.6 interpreter gives ``tl.tensor`` an ``__index__`` of
    ``int(handle.data)`` on a one-element array, which numpy 2.4 refuses ("only 0-dimensional
    arrays can be converted to Python scalars"), so ``range(tl.program_id(0), ...)`` fails;
    triton 3.9 squeezes first. We wrap its language patch to squeeze too (the same on 3.9)."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter as interp
    except ImportError:  # pragma: no cover - triton is an install requirement
        return
    with _interp_lock:
        orig_patch = getattr(interp, "_patch_lang", None)
        if _interp_state["fixed"] or orig_patch is None:  # None: another triton, whose interpreter we leave alone
            return

        def index(self):
            return int(self.handle.data.squeeze())

        def patch_lang(fn):
            scope = orig_patch(fn)
            if hasattr(scope, "set_attr"):  # triton >= 3.6: undone with the rest of the patch
                scope.set_attr(tl.core.tensor, "__index__", index)
            elif scope is None:  # triton 3.3 (torch 2.7's pin) patches the language for good, as we do
                tl.core.tensor.__index__ = index
            return scope

        interp._patch_lang = patch_lang
        _interp_state["fixed"] = True


def make_triton_interpreter_threadsafe() -> None:
    """Let several threads run interpreted Triton kernels at once (the thread world needs it).

    Why: triton's interpreter (3.6-3.9) keeps the current grid index in one module-global builder
    and monkey-patches ``triton.language`` for the duration of each launch, restoring it when that
    launch ends. Two ranks' kernels running concurrently then see each other's program ids, and the
    first to finish un-patches the language under the other (observed: "y >= grid_dim[1]"). We
    make the grid index thread-local and reference-count the language patch. It also skips the
    interpreter's copy-back of CPU arguments onto themselves, which could overwrite a peer's
    concurrent write into a symmetric buffer. And it rewrites one kernel at a time: the first launch
    parses the kernel's source with ``ast`` and transforms it with one visitor shared by every
    kernel, which Python 3.11's ``ast`` does not allow from two threads at once (observed under
    load: "SystemError: AST constructor recursion depth mismatch", CPython gh-106905). Idempotent;
    a no-op without the interpreter module.
    """
    fix_triton_interpreter()  # first, so the original patch taken below keeps the fix
    with _interp_lock:
        if _interp_state["installed"]:
            return
        try:
            import triton.language as tl
            from triton.runtime import interpreter as interp
        except ImportError:  # pragma: no cover - triton is an install requirement
            return
        tls = threading.local()
        orig_patch = interp._patch_lang
        orig_call = interp.GridExecutor.__call__
        orig_rewrite = interp.InterpretedFunction.rewrite
        # Patch the language as a kernel seeing both `tl` and `tl.core` would, so the one shared
        # patch serves every kernel whatever it imported.
        any_kernel = types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core})

        class _SharedScope:  # also what triton 3.3's _patch_lang (returning None, undoing nothing) gets
            def restore(self):
                pass

        def patch_lang(fn):
            with _interp_lock:
                if _interp_state["active"]:
                    return _SharedScope()
            return orig_patch(fn)

        def grid_call(self, *args, **kwargs):
            with _interp_lock:
                if _interp_state["active"] == 0:  # triton 3.3's patch returns None: nothing to undo
                    _interp_state["scope"] = orig_patch(any_kernel) or _SharedScope()
                _interp_state["active"] += 1
            try:
                return orig_call(self, *args, **kwargs)
            finally:
                with _interp_lock:
                    _interp_state["active"] -= 1
                    if _interp_state["active"] == 0:
                        _interp_state["scope"].restore()

        def restore_args_dev(self, args_dev, args_hst, kwargs, kwargs_hst):
            pairs = []

            def visit(dev, hst):
                if hasattr(dev, "data_ptr"):
                    dev, hst = interp._unwrap_tensor(dev), interp._unwrap_tensor(hst)
                    if dev.untyped_storage().data_ptr() != hst.untyped_storage().data_ptr():
                        pairs.append((dev.untyped_storage(), hst.untyped_storage()))
                elif isinstance(dev, tuple):
                    for d, h in zip(dev, hst):
                        visit(d, h)

            for dev, hst in zip(args_dev, args_hst):
                visit(dev, hst)
            for key, dev in kwargs.items():
                visit(dev, kwargs_hst[key])
            for dev, hst in pairs:
                dev.copy_(hst)

        def rewrite(self):
            # every launch and every device-function call asks for the rewrite: only the first
            # (not yet cached) takes the lock, so running kernels never wait on one another here
            done = self.rewritten_fn.get(self.fn)
            if done is not None:
                return done
            with _interp_rewrite_lock:
                return orig_rewrite(self)

        def thread_local(name):
            return property(lambda self: getattr(tls, name, None),
                            lambda self, value: setattr(tls, name, value))

        interp.InterpreterBuilder.grid_idx = thread_local("grid_idx")
        interp.InterpreterBuilder.grid_dim = thread_local("grid_dim")
        interp._patch_lang = patch_lang
        interp.GridExecutor.__call__ = grid_call
        interp.GridExecutor._restore_args_dev = restore_args_dev
        interp.InterpretedFunction.rewrite = rewrite
        _interp_state["installed"] = True


def _backends(group: dist.ProcessGroup) -> list:
    """The backends serving ``group``, unwrapped from the collective-checking wrapper that
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` puts around them."""
    found = []
    for device in getattr(group, "_device_types", ()):
        try:
            backend = group._get_backend(device)
        except (RuntimeError, ValueError):
            continue
        backend = getattr(backend, "wrapped_pg", backend)
        if all(backend is not seen for seen in found):
            found.append(backend)
    return found


def group_timeout(group: dist.ProcessGroup):
    """The timeout of ``group``'s collectives as a timedelta, or None where torch does not say."""
    for backend in _backends(group):
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if timeout is not None:
            return timeout
    return None


_group_timeout_tls, _group_timeout_lock = threading.local(), threading.Lock()


@contextlib.contextmanager
def new_groups_timeout(timeout):
    """Groups this thread creates inside (DeviceMesh's, which ``new_group`` gets no timeout for) take
    ``timeout`` instead of the backend's default. Why: gloo in torch 2.4-2.7 (at least; 2.11 is fixed,
    pytorch#165422) fixes a group's timeout when it is created: ``_set_default_timeout`` on a live group
    changes nothing its collectives wait on, so ``set_group_timeout`` afterwards is too late there.
    Thread-local (the thread world runs ranks as threads): torch's default lookup is wrapped once."""
    from torch.distributed import distributed_c10d as c10d

    with _group_timeout_lock:
        if not getattr(c10d._get_default_timeout, "_overlapkernels", False):
            orig = c10d._get_default_timeout

            def default_timeout(backend):
                override = getattr(_group_timeout_tls, "timeout", None)
                return orig(backend) if override is None else override

            default_timeout._overlapkernels = True
            c10d._get_default_timeout = default_timeout
    outer, _group_timeout_tls.timeout = getattr(_group_timeout_tls, "timeout", None), timeout
    try:
        yield
    finally:
        _group_timeout_tls.timeout = outer


def set_group_timeout(group: dist.ProcessGroup, timeout) -> None:
    """Give ``group``'s collectives ``timeout`` (a timedelta); warns where torch offers no way.

    Why private torch API: ``new_group`` takes a timeout, but DeviceMesh creates its groups without
    one, so each gets the backend's default (30 min on gloo, 10 on NCCL) whatever the default group
    was given. torch's own ``_set_pg_timeout`` does what this does (torch 2.11 and 2.13 alike) but
    skips the wrapper that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` adds, so we unwrap first."""
    backends = [b for b in _backends(group) if hasattr(b, "_set_default_timeout")]
    for backend in backends:
        backend._set_default_timeout(timeout)
    if not backends:
        warnings.warn(f"overlapkernels: cannot set the timeout of process group {group} on torch "
                      f"{torch.__version__}; it keeps the backend's default", stacklevel=3)


# How long, at interpreter exit, gloo's worker threads get the GIL to finish (see below).
GLOO_EXIT_GRACE_S = 0.02
_gloo_exit_grace = {"registered": False}


def let_gloo_workers_finish_at_exit() -> None:
    """Registers (once) an atexit pause that releases the GIL for GLOO_EXIT_GRACE_S.

    Why: a gloo worker thread drops its reference to a finished collective's work after the caller's
    wait returned; when it holds the last reference to the work's tensors (temporaries: a loss's
    all-reduced sums), it takes the GIL to free their Python objects. If the script ends first, that
    happens during ``Py_Finalize`` and the process aborts ("terminate called without an active
    exception", exit -6 under torchrun, after all the work is done): pytorch/pytorch#190489, open.
    Measured on 2 gloo ranks, a GPT forward then exit: 4 aborts in 20 runs without the pause, 0 in 20
    with it. ``destroy_process_group`` does not help while ``ParallelDims`` still holds the groups."""
    if _gloo_exit_grace["registered"]:
        return
    import atexit
    import time

    atexit.register(time.sleep, GLOO_EXIT_GRACE_S)
    _gloo_exit_grace["registered"] = True


def matmul_allows_tf32() -> bool:
    """Whether torch's fp32 CUDA matmuls may use TF32, whichever API the user set it with. Since
    torch 2.9 ``torch.backends.cuda.matmul.fp32_precision`` (or the global
    ``torch.backends.fp32_precision``) is the way; once it was used, reading the legacy ``allow_tf32``
    raises. Setting ``allow_tf32`` updates ``fp32_precision`` too, so reading the new one sees both."""
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)
    if precision is None:  # torch < 2.9: the legacy flag only
        return bool(matmul.allow_tf32)
    if precision == "none":  # inherits the global setting
        precision = getattr(torch.backends, "fp32_precision", "none")
    return precision == "tf32"


@functools.cache  # every op call checks every operand: look the class up once
def dtensor_type() -> type:
    """torch's DTensor class, imported on first use (torch.distributed.tensor is a heavy import)."""
    from torch.distributed.tensor import DTensor

    return DTensor


def fsdp2_sharded_params(module) -> dict:
    """``{(id(owning module), parameter name): sharded parameter}`` for every parameter torch's FSDP2
    (``fully_shard``) manages under ``module``; empty without FSDP2.

    Why torch internals: after backward with ``set_reshard_after_backward(False)`` a module holds
    FSDP2's unsharded parameter, which has no gradient; the gradient sits on the sharded one,
    reachable only through FSDP2's state (the same in torch 2.11 and 2.13). If that moves we raise:
    silently finding no gradient would let sequence-parallel weights drift apart."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch >= 2.6 has it
        return {}
    found = {}
    for sub in module.modules():
        if not isinstance(sub, FSDPModule):
            continue
        try:
            group = sub._get_fsdp_state()._fsdp_param_group
            for fsdp_param in (group.fsdp_params if group is not None else ()):
                info = fsdp_param._module_info  # a tied parameter: every (module, name) that holds it
                for owner, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
                    found[(id(owner), name)] = fsdp_param.sharded_param
        except AttributeError as exc:
            raise RuntimeError(f"torch {torch.__version__}: FSDP2's parameter state moved ({exc}); overlapkernels "
                               "cannot find the sharded gradients of a fully_shard module") from exc
    return found


def distribute_locally(tensor, mesh, placements):
    """A DTensor of ``tensor`` (the same on every rank of ``mesh``) laid out as ``placements``, each
    rank cutting its own piece: no communication. Why not plain ``distribute_tensor``: by default it
    scatters from rank 0; ``src_data_rank=None`` (torch >= 2.7) is the local cut."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(tensor, mesh, placements, src_data_rank=None)
