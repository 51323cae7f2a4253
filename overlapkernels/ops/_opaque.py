"""``torch.compile(..., fullgraph=True)`` through the ops: under compile each public op that takes a
ProcessGroup (or drives our kernels) is one opaque custom op in the graph, ``overlapkernels::call``,
which runs the eager op at run time.

Why: dynamo must not trace our ops (ProcessGroups, side streams, persistent Triton kernels, waits
with timeouts), and the graph break ``eager_under_compile`` puts around each one rules out
``fullgraph=True`` - how torchtitan compiles each transformer block - and cuts every block into
small graphs. A custom op is torch's answer for code it must not trace: dynamo records the call,
AOTAutograd and Inductor take the shapes from a fake rule, and at run time the eager op runs as it
does without compile (its method choice, ``overlap_stats``, ``strict_overlap``, NVTX ranges,
timeouts, the ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` agreement check).

One generic op pair serves every op: its non-tensor arguments travel as a constant string (the
``repr`` of a tuple of constants, which dynamo can build; ProcessGroups by their registered
``group_name``), its tensors as a list.

Autograd: the forward runs the eager op with autograd on, on aliases of its inputs (not leaves: see
``_Input``), and keeps only gradient edges (``torch.autograd.graph.GradientEdge``) of its outputs and
inputs - not the tensors, so memory is freed as in eager mode - under an integer handle, a tensor
the compiled graph saves for backward. The backward op runs ``torch.autograd.grad`` between those
edges: the eager op's own overlapped backward. A forward whose backward never runs releases its
entry when the handle tensor dies.

Under compile, still eager with a graph break, as before: a group that is not a c10d ProcessGroup
(the thread world's peer groups) and arguments that are not constants, tensors and lists of them
(``group=None`` travels as None: the default group, resolved at run time). Lost under compile: the
layout tags (``tag_layout``: attributes of eager tensors, checked only in eager mode), and a
zero-bubble schedule's deferral of weight gradients (``weight_grad_store.deferring``): inside a
compiled graph they are computed in backward. Every output is contiguous (as the fake rules say)
and none aliases an input (custom ops may not): an identity forward returns a copy. What the eager
op saves for backward from the graph's own buffers is saved as a copy (Inductor reuses a buffer
once the graph is done reading it: ``_SavedPrivately``). Each call carries a number of its own, so
that two identical calls stay two. A second backward through one compiled call raises, also with
``retain_graph=True`` (the first backward released its graph); a float argument that dynamo makes
symbolic (a changing ``softmax_scale``) breaks a fullgraph compile.
"""
from __future__ import annotations

import ast
import contextlib
import functools
import inspect
import itertools
import math
import weakref

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from .._compat import eager_under_compile
from ._autocast import autocast_dtype, autocast_off, cast_weights

_OPS: dict = {}  # name -> _Op
_GRAPHS: dict = {}  # handle -> (output edges, input edges), from forward until its backward
_handles = itertools.count()
_TENSOR, _GROUP, _LIST, _TUPLE, _DICT = "__ok_tensor__", "__ok_group__", "__ok_list__", "__ok_tuple__", "__ok_dict__"


class _Op:
    def __init__(self, fn, fake, unflatten):
        self.fn, self.fake, self.unflatten = fn, fake, unflatten


def opaque_under_compile(*, fake, unflatten=None, casts=()):
    """Decorates a public op ``fn``: eager as written outside compile; under compile one
    ``overlapkernels::call`` node (see the module's docstring), or eager with a graph break where
    its arguments cannot travel as constants.

    ``fake(*args, **kwargs)``: ``fn``'s result with empty tensors of the right shapes, dtypes and
    devices (args as ``fn`` gets them, with fake tensors; it checks what shapes depend on).
    ``unflatten(flat, *args, **kwargs)``: ``fn``'s result from its tensors in order (default: the
    one tensor). ``casts``: the names of the tensor arguments ``torch.autocast`` casts on entry, as
    the eager op does; cast in the graph, so the op runs with autocast off."""
    def decorate(fn):
        name = f"{fn.__module__}.{fn.__qualname__}"
        _OPS[name] = _Op(fn, fake, unflatten or (lambda flat, *a, **k: flat[0]))
        eager = eager_under_compile(fn)
        params = list(inspect.signature(fn).parameters)

        @functools.wraps(fn)
        def op(*args, **kwargs):
            if not torch.compiler.is_compiling():
                return fn(*args, **kwargs)
            args, kwargs = _cast(casts, params, args, kwargs)
            tensors = []
            spec = _encode((args, kwargs), tensors)
            if spec is None or not tensors:
                return eager(*args, **kwargs)
            grads = [torch.is_grad_enabled() and t.requires_grad for t in tensors]
            # a number of its own per call in the graph: AOTAutograd would merge two identical calls into
            # one (pure ops, it assumes), leaving one handle for two backwards
            flat = torch.ops.overlapkernels.call(name, repr((_call_number(), spec)), tensors, grads)
            return _OPS[name].unflatten(flat[1:], *args, **kwargs)
        op.__wrapped__ = eager  # what tests and introspection see as the op
        return op
    return decorate


def _cast(names, params, args, kwargs):
    """(args, kwargs) with the autocast casts the eager op makes on entry to the arguments ``names``
    (``params``: the op's parameter names in order, to find the positional ones)."""
    args, kwargs = list(args), dict(kwargs)
    for name in names:
        where = params.index(name)
        holder, key = (args, where) if where < len(args) else (kwargs, name)
        value = holder[key] if where < len(args) or name in kwargs else None
        first = value[0] if isinstance(value, (list, tuple)) and value else value  # (a list of weights)
        if isinstance(first, torch.Tensor):
            holder[key] = cast_weights(autocast_dtype(first.device), value)
    return tuple(args), kwargs


def _encode(value, tensors):
    """``value`` as constants (tensors replaced by their index in ``tensors``, groups by name), or
    None where something cannot travel that way."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return (_TENSOR, len(tensors) - 1)
    if isinstance(value, dist.ProcessGroup):
        return (_GROUP, value.group_name)
    if isinstance(value, (list, tuple)):
        items = []
        for item in value:
            encoded = _encode(item, tensors)
            if encoded is None and item is not None:
                return None
            items.append(encoded)
        return (_LIST if isinstance(value, list) else _TUPLE, tuple(items))
    if isinstance(value, dict):
        pairs = []
        for key, item in value.items():
            encoded = _encode(item, tensors)
            if encoded is None and item is not None:
                return None
            pairs.append((key, encoded))
        return (_DICT, tuple(pairs))
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    return None


def _decode(value, tensors):
    if isinstance(value, tuple):
        tag, payload = value
        if tag == _TENSOR:
            return tensors[payload]
        if tag == _GROUP:
            return dist.distributed_c10d._resolve_process_group(payload)
        if tag == _DICT:
            return {key: _decode(item, tensors) for key, item in payload}
        items = [_decode(item, tensors) for item in payload]
        return items if tag == _LIST else tuple(items)
    return value


@functools.lru_cache(maxsize=1024)
def _parse(spec: str):
    return ast.literal_eval(spec)


def _call_args(spec, tensors):
    """The op's (args, kwargs) from its spec (its call number first) and tensors."""
    return _decode(_parse(spec)[1], tensors)


_numbers = itertools.count()


def _call_number() -> int:
    """A new number each time dynamo traces a call (a constant in the graph)."""
    return next(_numbers)


# torch.compiler.assume_constant_result's mark, set by hand: the decorator imports torch._dynamo,
# ~1.5 s on every import of overlapkernels that never compiles (see _compat.eager_under_compile)
_call_number._dynamo_marked_constant = True


def _flatten(result, out):
    if isinstance(result, torch.Tensor):
        out.append(result)
    elif isinstance(result, (list, tuple)):
        for item in result:
            _flatten(item, out)
    elif result is not None:
        raise TypeError(f"an op's result holds {type(result).__name__}: expected tensors, lists and tuples")
    return out


class _Input(torch.autograd.Function):
    """``x`` as the eager op sees it: a tensor whose gradient autograd captures at this node. Not a
    leaf: a leaf's AccumulateGrad node would keep ``x`` (its memory) alive until backward, where the
    eager op keeps only what it saves (cross-entropy its probabilities, not the logits). The graph
    hangs off ``anchor``, an empty leaf."""

    @staticmethod
    def forward(ctx, anchor, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # (not reached: backward stops at the captured gradient)
        return None, None


@torch.library.custom_op("overlapkernels::call", mutates_args=())
def _call(name: str, spec: str, tensors: list[torch.Tensor], grads: list[bool]) -> list[torch.Tensor]:
    """Runs the eager op ``name`` (see the module's docstring); returns [handle, *its tensors]."""
    record = any(grads)
    with _autograd_on(record):
        anchor = torch.empty(0, requires_grad=True)
        inputs = [_Input.apply(anchor, t.detach()) if g else t.detach() for t, g in zip(tensors, grads)]
        args, kwargs = _call_args(spec, inputs)
        saves = _SavedPrivately(tensors)
        with _autocast_off(tensors), torch.autograd.graph.saved_tensors_hooks(saves.pack, saves.unpack):
            outs = _flatten(_OPS[name].fn(*args, **kwargs), [])  # (cast in the graph already: opaque_under_compile)
        out_edges = [get_gradient_edge(o) if o.requires_grad else None for o in outs]
        in_edges = [get_gradient_edge(x) if g else None for x, g in zip(inputs, grads)]
    handle = next(_handles) if record else -1
    handle_t = torch.tensor([handle], dtype=torch.int64)
    if record:
        _GRAPHS[handle] = (out_edges, in_edges)
        # (not at exit: the process groups the nodes hold may be gone by then)
        weakref.finalize(handle_t, _GRAPHS.pop, handle, None).atexit = False
    return [handle_t, *_fresh(outs, tensors, saves.memory)]


class _SavedPrivately:
    """Hooks on what the eager op saves for backward: the memory of the compiled graph's own
    buffers is never among it. Inductor reuses a buffer once its last reader in the graph is done
    (a later kernel writes into it), and it cannot see that our op keeps its input for backward -
    x for the weight gradient, say - so a saved tensor sharing memory with an input is saved as a
    copy (memory as in eager mode: the graph's buffer is freed or reused meanwhile). Parameters are
    the graph's inputs, which it never reuses, and stay as they are. ``memory``: the storages of
    what was saved, so that an output sharing one goes out as a copy (``_fresh``)."""

    def __init__(self, inputs):
        self.inputs = {_memory(t) for t in inputs if t.numel() and not isinstance(t, torch.nn.Parameter)}
        self.memory = set()

    def pack(self, t):
        if t.numel() and _memory(t) in self.inputs:
            t = t.clone()
        self.memory.add(_memory(t))
        return t

    @staticmethod
    def unpack(t):
        return t


def resized(x: torch.Tensor, dim: int, world: int, grow: bool) -> torch.Tensor:
    """An empty ``x`` with ``dim`` times (``grow``) or divided by ``world``: a fake rule's result for
    the ops that gather or split along one dim."""
    shape = list(x.shape)
    shape[dim] = shape[dim] * world if grow else shape[dim] // world
    return x.new_empty(shape)


def _memory(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@_call.register_fake
def _call_fake(name, spec, tensors, grads):
    args, kwargs = _call_args(spec, tensors)
    outs = _flatten(_OPS[name].fake(*args, **kwargs), [])
    return [torch.empty(1, dtype=torch.int64), *(o.new_empty(o.shape) for o in outs)]


@torch.library.custom_op("overlapkernels::call_backward", mutates_args=())
def _call_backward(handle: torch.Tensor, grad_outs: list[torch.Tensor | None], like: list[torch.Tensor],
                   grads: list[bool]) -> list[torch.Tensor]:
    """The gradients of the forward's tensors (an empty tensor for those that need none); ``like``:
    tensors shaped as those (the fake rule's shapes)."""
    entry = _GRAPHS.pop(int(handle.item()), None)
    if entry is None:
        raise RuntimeError("overlapkernels: backward through a compiled call of an op ran a second time (or "
                           "after its graph was released); as an eager graph, it is freed by its first backward")
    out_edges, in_edges = entry
    pairs = [(e, g) for e, g in zip(out_edges, grad_outs) if e is not None and g is not None]
    wanted = [i for i, need in enumerate(grads) if need]
    got = [None] * len(wanted)
    if pairs and wanted:
        # (inside a zero-bubble B nothing is deferred: weight_grad_store.defer refuses the op's inputs,
        # which are not leaves - a closure would fill these aliases, not the parameters)
        with _autograd_on(False):
            got = torch.autograd.grad([e for e, _ in pairs], [in_edges[i] for i in wanted],
                                      [g for _, g in pairs], allow_unused=True)
    result = [t.new_empty(0) for t in like]
    for i, g in zip(wanted, got):
        result[i] = g if g is not None else torch.zeros(like[i].shape, dtype=like[i].dtype, device=like[i].device)
    return _fresh(result, [handle, *grad_outs])  # (nothing is saved any more)


@_call_backward.register_fake
def _call_backward_fake(handle, grad_outs, like, grads):
    return [t.new_empty(t.shape) if need else t.new_empty(0) for t, need in zip(like, grads)]


def _setup_context(ctx, inputs, output):
    _, _, tensors, grads = inputs
    ctx.grads = list(grads)
    ctx.inputs = [(t.shape, t.dtype, t.device) for t in tensors]  # metadata only: the eager op saves what it needs
    ctx.save_for_backward(output[0])


def _backward(ctx, grad_flat):
    handle, = ctx.saved_tensors
    # one element each, expanded to the input's shape: what the backward's fake rule reads
    like = [torch.empty((), dtype=dtype, device=device).expand(shape) for shape, dtype, device in ctx.inputs]
    got = torch.ops.overlapkernels.call_backward(handle, list(grad_flat[1:]), like, ctx.grads)
    return None, None, [g if need else None for g, need in zip(got, ctx.grads)], None


torch.library.register_autograd("overlapkernels::call", _backward, setup_context=_setup_context)


def _fresh(outs, inputs, saved=()):
    """``outs`` detached and contiguous, as the fake rules make them (the compiled graph's views
    rely on those strides), each copied if it shares memory with an input, an earlier output or
    (``saved``) what backward will read: a custom op's outputs may alias neither, and the graph
    may write into an output's buffer once it is done reading it (an identity forward, a world of
    one, a returned tensor that backward also reads)."""
    seen = {_memory(t) for t in inputs if t is not None and t.numel()} | set(saved)
    fresh = []
    for o in outs:
        o = o.detach().contiguous()
        if o.numel() and _memory(o) in seen:
            o = o.clone()
        elif o.numel():
            seen.add(_memory(o))
        fresh.append(o)
    return fresh


@contextlib.contextmanager
def _autograd_on(grad_enabled: bool):
    """Autograd as in eager code, inside a custom op's implementation, where torch has switched it
    off (the Autograd dispatch keys excluded below the op's own autograd kernel): the forward must
    record the eager op's graph, and the backward runs that graph's nodes. The same private guard
    torch's higher-order ops use to restore dispatch state; ``grad_enabled``: the grad mode inside."""
    include, exclude = torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()
    # (removing AutogradCPU clears the Autograd functionality for every backend, CUDA's too; views and
    # in-place ops need ADInplaceOrView back as well, or their gradients and version checks go missing)
    keys = exclude.remove(torch._C.DispatchKey.AutogradCPU).remove(torch._C.DispatchKey.ADInplaceOrView)
    with torch._C._ForceDispatchKeyGuard(include, keys), \
            torch.set_grad_enabled(grad_enabled):
        yield


def _autocast_off(tensors) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    for device in {t.device for t in tensors}:
        stack.enter_context(autocast_off(device))
    return stack
