"""NCCL's rules that gloo does not enforce, checked on gloo ranks, so that a gloo test cannot pass
where an NCCL job would crash, hang or pair the wrong tensors:

- every tensor a collective or P2P op moves is contiguous (NCCL refuses a strided one: "Tensors must
  be contiguous"; gloo copies it silently);
- P2P messages pair in posting order: NCCL ignores tags, so per communicator and direction the n-th
  send meets the n-th receive, and a batch's sends complete only while the receiver's batch runs.
  gloo pairs by tag, so an order that would cross two messages under NCCL passes there unseen;
- a communicator runs its work in order: a collective completes only when every member reaches it,
  so a rank that posts it before a P2P batch its peer posts after it hangs NCCL;
- MAX and MIN reductions are fmax/fmin, which drop a NaN (gloo keeps one from rank 0 only): a NaN
  that reaches one is refused, since the result would differ between the two backends.

``nccl_rules()`` wraps torch.distributed's entry points, and every alias of them that a module of
the package bound at import (``_compat.all_gather_single``), for the duration of a block, and
records each ``batch_isend_irecv`` and collective; ``check_p2p_logs`` replays the records of all
ranks as NCCL would run them.
"""
import contextlib
import inspect
import sys

import torch
import torch.distributed as dist

# isend/irecv are not wrapped: P2POp accepts only the originals. batch_isend_irecv checks their tensors.
_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "reduce_scatter",
                "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single", "broadcast", "barrier",
                "all_gather_object", "send", "recv")
_POINT_TO_POINT = ("send", "recv")


class Collective(tuple):
    """A log item: ``(name, member global ranks)``; every member must reach it."""


class NonContiguous(AssertionError):
    """A tensor NCCL would refuse."""


class NaNIntoMinMax(AssertionError):
    """A NaN that NCCL's fmax/fmin would drop."""


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


def _checked(name, fn, log):
    signature = inspect.signature(fn)

    def checked(*args, **kwargs):
        _refuse_strided(name, _tensors(args, kwargs))
        try:  # op may come by keyword or by position (all_reduce's 2nd, reduce's 3rd)
            op = signature.bind_partial(*args, **kwargs).arguments.get("op")
        except TypeError:  # a call torch itself will refuse
            op = kwargs.get("op")
        if op in (dist.ReduceOp.MAX, dist.ReduceOp.MIN) and any(
                t.is_floating_point() and t.isnan().any() for t in _tensors(args, kwargs)):
            raise NaNIntoMinMax(f"{name}(op={op}): a NaN enters the reduction; NCCL's fmax/fmin drops it "
                                "(gloo keeps one from rank 0 only)")
        if name not in _POINT_TO_POINT:
            try:
                group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            except TypeError:  # a call torch itself will refuse
                group = kwargs.get("group")
            group = group or dist.group.WORLD
            log.append((group.group_name, Collective((name, tuple(dist.get_process_group_ranks(group))))))
        return fn(*args, **kwargs)
    return checked


@contextlib.contextmanager
def nccl_rules():
    """Yields this rank's log: per ``batch_isend_irecv``, ``(group name, [(send?, peer global rank,
    tag, shape, dtype), ...])``; per collective, ``(group name, Collective((name, member ranks)))``."""
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    batch, log = dist.batch_isend_irecv, []

    def recorded_batch(ops):
        _refuse_strided("batch_isend_irecv", (op.tensor for op in ops))
        group = ops[0].group or dist.group.WORLD
        log.append((group.group_name, [(op.op is dist.isend, op.peer, op.tag, tuple(op.tensor.shape),
                                        str(op.tensor.dtype)) for op in ops]))
        return batch(ops)

    wrapped = {id(fn): _checked(name, fn, log) for name, fn in originals.items()}
    wrapped[id(batch)] = recorded_batch
    by_id = {id(fn): fn for fn in [*originals.values(), batch]}
    modules = [dist] + [m for name, m in list(sys.modules.items()) if name.startswith("overlapkernels") and m]
    patched = []
    for module in modules:
        for attr, value in list(vars(module).items()):
            if id(value) in wrapped and by_id.get(id(value)) is value:
                patched.append((module, attr, value))
                setattr(module, attr, wrapped[id(value)])
    try:
        yield log
    finally:  # the pool's processes serve later tests
        for module, attr, value in patched:
            setattr(module, attr, value)
        # a module first imported inside the block may have bound a wrapper: give it the original
        originals_of = {id(wrapper): by_id[key] for key, wrapper in wrapped.items()}
        for name, module in list(sys.modules.items()):
            if name.startswith("overlapkernels") and module:
                for attr, value in list(vars(module).items()):
                    if id(value) in originals_of:
                        setattr(module, attr, originals_of[id(value)])


def check_p2p_logs(logs) -> int:
    """``logs[r]``: global rank r's ``nccl_rules`` log. Replays each communicator (group) on its own,
    as NCCL runs them; returns the number of P2P batches checked."""
    groups = {name for log in logs for name, _ in log}
    for name in sorted(groups):
        replay_like_nccl([[item for group, item in log if group == name] for log in logs])
    return sum(not isinstance(item, Collective) for log in logs for _, item in log)


def replay_like_nccl(logs):
    """NCCL's rules on what each rank posted to one communicator, in order: per direction the n-th
    send meets the n-th receive, which must be the same message (``op[2:]``: tag or name, shape); a
    send completes only while its receiver's batch runs; the n-th collective of every member is the
    same one and completes only when every member has reached it.
    ``logs[r]``: rank r's items, each a batch (a list of ``(send?, peer, *message)``) or a ``Collective``."""
    p = len(logs)
    partner = {}
    for a in range(p):
        for b in range(p):
            sends = [(i, j, op) for i, batch in enumerate(logs[a]) if not isinstance(batch, Collective)
                     for j, op in enumerate(batch) if op[0] and op[1] == b]
            recvs = [(i, j, op) for i, batch in enumerate(logs[b]) if not isinstance(batch, Collective)
                     for j, op in enumerate(batch) if not op[0] and op[1] == a]
            assert [op[2:] for _, _, op in sends] == [op[2:] for _, _, op in recvs], f"rank {a} -> rank {b}"
            for (i, j, _), (k, n, _) in zip(sends, recvs):
                partner[(a, i, j)], partner[(b, k, n)] = (b, k, n), (a, i, j)
    ordinal = []  # per rank and position: the how-many-th collective it is
    for r, log in enumerate(logs):
        seen, marks = 0, []
        for item in log:
            marks.append(seen)
            seen += isinstance(item, Collective)
        ordinal.append(marks)
    collectives = [[item for item in log if isinstance(item, Collective)] for log in logs]
    for r, items in enumerate(collectives):
        for n, (name, members) in enumerate(items):
            for q in members:
                there = collectives[q][n] if n < len(collectives[q]) else None
                assert there == (name, members), f"rank {r}'s collective {n} is {name}, rank {q}'s is {there}"
    cur, matched, moved = [0] * p, set(), True
    while moved:
        moved = False
        for r in range(p):
            while cur[r] < len(logs[r]):
                item = logs[r][cur[r]]
                if isinstance(item, Collective):
                    n, members = ordinal[r][cur[r]], item[1]
                    if not all(cur[q] < len(logs[q]) and isinstance(logs[q][cur[q]], Collective)
                               and ordinal[q][cur[q]] == n for q in members):
                        break
                    for q in members:
                        cur[q] += 1
                    moved = True
                    continue
                for j in range(len(item)):
                    q, k, n = partner[(r, cur[r], j)]
                    if cur[q] == k:
                        matched |= {(r, cur[r], j), (q, k, n)}
                if any((r, cur[r], j) not in matched for j in range(len(item))):
                    break
                cur[r], moved = cur[r] + 1, True
    assert cur == [len(log) for log in logs], f"deadlock: ranks stuck at items {cur}"
