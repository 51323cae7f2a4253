"""Triton kernels; on CPU they run under the interpreter (TRITON_INTERPRET=1), fixed up first for
the triton versions we support (see ``_compat.fix_triton_interpreter``)."""
from ..._compat import fix_triton_interpreter

fix_triton_interpreter()
