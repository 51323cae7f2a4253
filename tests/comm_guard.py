"""``no_communication()``: a block in which any torch.distributed communication fails the test.

Checks the promise of DESIGN.md that bad input is refused "before any rank starts communicating":
a test that only runs one collective after every rank made the same bad call cannot see a
collective that every rank ran before raising. While the block runs, every entry point the
package communicates through (``torch.distributed``'s collectives, P2P ops and ``P2POp``, which
the rings build just before ``batch_isend_irecv``) is replaced by a function that raises
``Communicated`` naming the call; so is every alias a module of the package bound at import
(``_compat.all_gather_single``, imported into ``comm.collectives`` and ``fsdp.flat_unit``). The
package calls everything else as ``dist.<name>(...)``, looked up at call time. A call that the code
under test swallowed (an ``except`` around it) still fails the block when it ends.

Not covered: DTensor's functional collectives (``full_tensor``) and DeviceMesh creation
(``init_device_mesh``, which makes its groups in its own module), which no bad-input path reaches.
"""
import contextlib
import sys

import torch.distributed as dist

ENTRY_POINTS = (
    "all_gather", "all_gather_into_tensor", "_all_gather_base", "all_gather_single", "all_gather_object",
    "all_gather_coalesced", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "reduce_scatter_single", "all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "broadcast_object_list",
    "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list", "barrier",
    "monitored_barrier", "batch_isend_irecv", "isend", "irecv", "send", "recv", "send_object_list",
    "recv_object_list", "P2POp", "new_group", "new_subgroups", "split_group",  # group creation: a store barrier
)


class Communicated(AssertionError):
    """A torch.distributed entry point was called inside ``no_communication()``."""


def _package_modules():
    return [m for name, m in list(sys.modules.items()) if name.startswith("overlapkernels") and m is not None]


@contextlib.contextmanager
def no_communication():
    """Yields the list of the names called so far (empty unless the block communicated)."""
    originals = {name: getattr(dist, name) for name in ENTRY_POINTS if hasattr(dist, name)}
    called = []

    def refusing(name):
        def refuse(*args, **kwargs):
            called.append(name)
            raise Communicated(f"torch.distributed.{name} was called inside no_communication(): the code "
                               "communicated before raising")
        refuse.__name__ = refuse.__qualname__ = f"no_communication_{name}"
        return refuse

    guards = {}  # id(original) -> guard; one original may have two names (a deprecated alias)
    for name, fn in originals.items():
        guards.setdefault(id(fn), refusing(name))
    by_id = {id(fn): fn for fn in originals.values()}
    patched = []
    for module in [dist] + _package_modules():
        for attr, value in list(vars(module).items()):
            if id(value) in guards and by_id[id(value)] is value:
                patched.append((module, attr, value))
                setattr(module, attr, guards[id(value)])
    try:
        yield called
    finally:  # the pool's processes serve later tests: put every original back
        for module, attr, value in patched:
            setattr(module, attr, value)
        originals_of = {id(guard): by_id[key] for key, guard in guards.items()}
        for module in _package_modules():  # one first imported inside the block may have bound a guard
            for attr, value in list(vars(module).items()):
                if id(value) in originals_of:
                    setattr(module, attr, originals_of[id(value)])
        if called:  # also when the code caught the guard's error and raised something else
            raise Communicated(f"no_communication(): the block called torch.distributed.{', '.join(called)}")
