"""An NCCL rule that gloo does not enforce, checked on gloo ranks: every tensor a collective or a
P2P op moves must be contiguous. NCCL refuses a strided one ("Tensors must be contiguous") while
gloo copies it silently, so without this check a gloo test passes where an NCCL job crashes.

``contiguity_checked()`` wraps torch.distributed's entry points, and every alias of them that a
module of the package bound at import (``_compat.all_gather_single``), for the duration of a block.
"""
import contextlib
import sys

import torch
import torch.distributed as dist

# isend/irecv are not wrapped: P2POp accepts only the originals. batch_isend_irecv checks their tensors.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "broadcast", "send", "recv")


class NonContiguous(AssertionError):
    pass


def _tensors(args, kwargs):
    for arg in list(args) + list(kwargs.values()):
        if torch.is_tensor(arg):
            yield arg
        elif isinstance(arg, (list, tuple)):
            yield from (t for t in arg if torch.is_tensor(t))


def _refuse_strided(name, tensors):
    for t in tensors:
        if not t.is_contiguous():
            raise NonContiguous(f"{name}: tensor {tuple(t.shape)} with strides {t.stride()} is not contiguous "
                                "(NCCL refuses it; gloo would copy it)")


def _checked(name, fn):
    def checked(*args, **kwargs):
        _refuse_strided(name, _tensors(args, kwargs))
        return fn(*args, **kwargs)
    return checked


@contextlib.contextmanager
def contiguity_checked():
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    batch = dist.batch_isend_irecv

    def checked_batch(ops):
        _refuse_strided("batch_isend_irecv", (op.tensor for op in ops))
        return batch(ops)

    wrapped = {id(fn): _checked(name, fn) for name, fn in originals.items()}
    wrapped[id(batch)] = checked_batch
    by_id = {id(fn): fn for fn in [*originals.values(), batch]}
    modules = [dist] + [m for name, m in list(sys.modules.items()) if name.startswith("overlapkernels") and m]
    patched = []
    for module in modules:
        for attr, value in list(vars(module).items()):
            if id(value) in wrapped and by_id.get(id(value)) is value:
                patched.append((module, attr, value))
                setattr(module, attr, wrapped[id(value)])
    try:
        yield
    finally:  # the pool's processes serve later tests
        for module, attr, value in patched:
            setattr(module, attr, value)
