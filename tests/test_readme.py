"""The README's code is what users copy: its commands must parse with the real CLI and Makefile, and
its Python snippets must call the public API with names and arguments that exist. Each call in a
snippet is bound (``inspect.Signature.bind``) against the real function, class or method: a renamed
function, a dropped or renamed keyword, or a positional argument too many fails here instead of in a
user's job. Nothing runs (the snippets are fragments on a 4096-wide model under torchrun)."""
from __future__ import annotations

import ast
import dataclasses
import inspect
import re
import shlex
from pathlib import Path

import pytest

import overlapkernels as ok
from overlapkernels.cli import build_parser
from overlapkernels.models import GPT
from overlapkernels.runtime import fsdp
from overlapkernels.runtime import pipeline as pp

ROOT = Path(__file__).resolve().parent.parent

# What the snippets' variables are (they come from earlier snippets or from the reader's own code)
VARIABLE_TYPES = {"dims": ok.ParallelDims, "model": GPT, "sharded": fsdp.ShardedModule, "scaler": fsdp.GradScaler,
                  "runner": pp.PipelineRunner, "sched": pp.Schedule, "res": pp.SimResult}


def fenced_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def _attribute(obj, name: str, where: str):
    """``getattr``, also for a dataclass field (no class attribute without a default)."""
    if dataclasses.is_dataclass(obj) and isinstance(obj, type) and name in {f.name for f in dataclasses.fields(obj)}:
        return None  # a field: its value exists only on an instance
    if not hasattr(obj, name):
        raise AssertionError(f"{where}: {getattr(obj, '__name__', obj)!r} has no attribute {name!r}")
    return getattr(obj, name)


def _resolve(node: ast.expr, namespace: dict, where: str):
    """The object an expression names -> (object, is_method_of_a_variable), or (None, False) when
    it is outside the library (torch, a tensor, a lambda)."""
    chain = []
    while isinstance(node, ast.Attribute):
        chain.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None, False
    chain.reverse()
    if node.id in namespace:
        obj, of_a_variable = namespace[node.id], False
    elif node.id in VARIABLE_TYPES and chain:
        obj, of_a_variable = VARIABLE_TYPES[node.id], True  # its class: a method is read off it unbound
    else:
        return None, False
    for name in chain:
        obj = _attribute(obj, name, where)
        if obj is None:
            return None, False
    return obj, of_a_variable and len(chain) == 1 and inspect.isfunction(obj)


def check_python(snippet: str, where: str = "snippet") -> int:
    """Runs the snippet's imports, then binds every call into the library -> how many it bound."""
    tree = ast.parse(snippet)
    namespace = {"ok": ok}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            exec(compile(ast.Module([node], []), where, "exec"), namespace)
    bound = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            _resolve(node, namespace, f"{where} line {node.lineno}")  # e.g. dims.tp_group: the attribute exists
        if not isinstance(node, ast.Call):
            continue
        at = f"{where} line {node.lineno}: {ast.unparse(node)[:100]}"
        fn, is_method = _resolve(node.func, namespace, at)
        if fn is None or not callable(fn):
            continue
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):  # a builtin without a signature
            continue
        args = [None] * (len(node.args) + is_method)  # (the instance, for a method read off its class)
        kwargs = {kw.arg: None for kw in node.keywords if kw.arg is not None}
        try:
            sig.bind(*args, **kwargs)
        except TypeError as exc:
            raise AssertionError(f"{at}: does not match {getattr(fn, '__qualname__', fn)}{sig}: {exc}") from None
        bound += 1
    return bound


def test_every_python_snippet_calls_the_api_as_it_is():
    blocks = fenced_blocks(_readme(), "python")
    assert len(blocks) >= 8, "the README's python snippets were not found"
    bound = [check_python(block, f"README python block {i}") for i, block in enumerate(blocks)]
    # every snippet is about the library: each binds some of its calls (a checker that resolves
    # nothing would pass anything)
    assert all(n > 0 for n in bound), bound
    assert sum(bound) >= 40, bound


@pytest.mark.parametrize("snippet", [
    "ok.all_gather_matmul(x, w, g, gather_dims=0)",          # a keyword that does not exist
    "ok.matmul_reduce_scatter(h, w, g, 0)",                   # scatter_dim is keyword-only
    "ok.all_gather_matmull(x, w, g)",                         # a misspelt function
    "sharded.no_sync(reshard_after_backwards=False)",         # a method's keyword
    "dims.tp_grp",                                            # an attribute
    "from overlapkernels.runtime import pipeline as pp\npp.make_schedule('1f1b', 4, 8, virtual=2)",
])
def test_the_checker_catches_a_wrong_call(snippet):
    with pytest.raises((AssertionError, ImportError)):
        check_python(snippet)


def _command_lines() -> list[str]:
    lines = []
    for block in fenced_blocks(_readme(), "bash"):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()  # (comments start after two spaces)
            if line and not line.startswith("#"):
                lines.append(line)
    return lines


def check_command(line: str, makefile: str, parser) -> str:
    """A ``make`` line names a Makefile target; an overlapkernels command line parses with the CLI."""
    words = shlex.split(line)
    if words[0] == "make":
        for target in words[1:]:
            if "=" not in target and not re.search(rf"^{re.escape(target)}:", makefile, flags=re.M):
                raise AssertionError(f"{line!r}: the Makefile has no target {target!r}")
        return "make"
    if "-m" in words and words[words.index("-m") + 1] == "overlapkernels":
        args = words[words.index("-m") + 2:]
    elif words[0] == "overlapkernels":
        args = words[1:]
    else:
        return "other"
    try:
        parser.parse_args(args)
    except SystemExit:
        raise AssertionError(f"{line!r}: the CLI refuses {args}") from None
    return "cli"


def test_every_command_parses():
    makefile, parser = (ROOT / "Makefile").read_text(), build_parser()
    kinds = [check_command(line, makefile, parser) for line in _command_lines()]
    assert kinds.count("make") >= 5 and kinds.count("cli") >= 7, kinds


@pytest.mark.parametrize("line", [
    "make gpu-chek",
    "overlapkernels bench ag-matmul --algorithm fused",
    "torchrun --nproc-per-node 8 -m overlapkernels bench ring --csv x.csv",
])
def test_the_command_checker_catches_a_wrong_line(line):
    with pytest.raises(AssertionError):
        check_command(line, (ROOT / "Makefile").read_text(), build_parser())
