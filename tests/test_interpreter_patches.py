"""Our patches to Triton's interpreter, which the thread world runs every rank's kernels in
(``_compat.fix_triton_interpreter`` and ``make_triton_interpreter_threadsafe``)."""


def test_interpreter_indexes_one_element_program_ids():
    """While a kernel runs, the interpreter turns tl tensors into ints with ``__index__`` (as in
    ``range(tl.program_id(0), ...)``); triton 3.6 did ``int(array([i]))``, which numpy >= 2.4
    refuses. Ours squeezes first, and the language patch is undone with the rest."""
    import operator
    import types

    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter as interp

    from overlapkernels._compat import fix_triton_interpreter

    fix_triton_interpreter()  # installed on import of overlapkernels.kernels.triton; idempotent

    before = tl.core.tensor.__dict__.get("__index__")
    scope = interp._patch_lang(types.SimpleNamespace(__globals__={"tl": tl, "core": tl.core}))
    try:
        pid = object.__new__(tl.core.tensor)
        pid.handle = types.SimpleNamespace(data=np.array([3], dtype=np.int32))
        assert operator.index(pid) == 3 and list(range(pid, 6)) == [3, 4, 5]
    finally:
        if scope is not None:  # triton 3.3 (torch 2.7) patches the language for good: nothing to undo
            scope.restore()
    assert scope is None or tl.core.tensor.__dict__.get("__index__") is before


def test_interpreter_rewrites_one_kernel_at_a_time(monkeypatch):
    """A kernel's first launch parses and transforms its source with ``ast`` (one visitor shared by
    every kernel); Python 3.11's ``ast`` fails when two threads do so at once ("AST constructor
    recursion depth mismatch", seen when two ranks first launched a kernel together under load).
    While one thread rewrites, another cannot take the rewrite lock (checked from inside); once it is
    rewritten, its launches take no lock."""
    import threading

    from triton.runtime import interpreter as interp

    from overlapkernels import _compat

    _compat.make_triton_interpreter_threadsafe()
    others_could_take = []

    def rewrite_ast(rewriter):
        def try_take():
            took = _compat._interp_rewrite_lock.acquire(blocking=False)
            others_could_take.append(took)
            if took:
                _compat._interp_rewrite_lock.release()
        other = threading.Thread(target=try_take)
        other.start()
        other.join()
        return rewriter.fn

    monkeypatch.setattr(interp.FunctionRewriter, "rewrite_ast", rewrite_ast)
    monkeypatch.setattr(interp.InterpretedFunction, "rewritten_fn", {})

    def kernel():
        pass

    assert interp.InterpretedFunction(kernel).rewrite() is kernel
    assert others_could_take == [False]
    # once rewritten, a launch (or a device-function call) reads the cache without the lock: it
    # returns while another thread holds it
    held, done = threading.Event(), threading.Event()

    gave_up = []

    def hold():
        with _compat._interp_rewrite_lock:
            held.set()
            gave_up.append(not done.wait(timeout=5))  # (only if the rewrite waited for the lock)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(timeout=10)
    try:
        assert interp.InterpretedFunction(kernel).rewrite() is kernel and gave_up == []
    finally:
        done.set()
        holder.join()
