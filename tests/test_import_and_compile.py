"""`import overlapkernels` stays light (no torch._dynamo), and the ops run under torch.compile when their
first call is made while compiling."""
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import overlapkernels as ok

    assert "torch._dynamo" not in sys.modules, "import overlapkernels pulled in torch._dynamo"
    # a store, not tcp://...:0: torch 2.7 took port 0 for "port number missing" (2.11 does not)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = dist.group.WORLD
    torch.manual_seed(0)
    x, w1, w2 = torch.randn(6, 5), torch.randn(5, 4), torch.randn(4, 3)

    def step(x):
        h = ok.all_gather_matmul(x, w1, group).relu()  # first call of each op: under compile
        return ok.matmul_reduce_scatter(h, w2, group) * 2

    out = torch.compile(step, backend="eager")(x)
    torch.testing.assert_close(out, (x @ w1).relu() @ w2 * 2)
    dist.destroy_process_group()
    print("ok")
""")


def test_import_is_light_and_first_call_under_compile_runs_eagerly():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.parametrize("name", ["all_gather_matmul", "matmul_reduce_scatter", "ring_attention", "ulysses_attention",
                                  "vocab_parallel_cross_entropy", "shard_sequence", "unshard_sequence",
                                  "local_attention"])
def test_the_ops_taking_a_process_group_are_opaque_under_compile(name):
    """Each public op is wrapped whole by opaque_under_compile: registered for the overlapkernels::call
    custom op under its own name, its graph-break fallback (torch's dynamo-disable wrapper) kept as
    __wrapped__. A helper inserted between the decorator and the op once took the decorator instead,
    and dynamo traced the op's collectives."""
    import overlapkernels as ok
    from overlapkernels.ops import _opaque

    fn = getattr(ok, name)
    assert fn.__wrapped__.__name__ == name, fn.__wrapped__
    assert _opaque._OPS[f"{fn.__module__}.{name}"].fn.__name__ == name
