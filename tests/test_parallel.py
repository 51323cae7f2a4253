"""init_parallel: mesh layouts (tp innermost), groups that really communicate, bad sizes."""
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist

import overlapkernels as ok
from overlapkernels.parallel import AXES, resolve_group, resolve_sizes


def expected_layout(world, sizes):
    """Rank grid in (dp, pp, cp, tp) row-major order: tp varies fastest."""
    grid = torch.arange(world).reshape([sizes[a] for a in AXES])
    out = {}
    for rank in range(world):
        coord = [int(c) for c in (grid == rank).nonzero()[0]]
        out[rank] = {}
        for i, axis in enumerate(AXES):
            index = list(coord)
            index[i] = slice(None)
            out[rank][axis] = (coord[i], grid[tuple(index)].tolist())
    return out


def _layout_on_rank(kwargs):
    dims = ok.init_parallel(**kwargs)
    result = {"sizes": {a: getattr(dims, f"{a}_size") for a in AXES}, "world": dims.world_size}
    for axis in AXES:
        group = getattr(dims, f"{axis}_group")
        members = dist.get_process_group_ranks(group)
        # prove the group communicates with exactly those members
        total = torch.tensor([dist.get_rank()])
        dist.all_reduce(total, group=group)
        result[axis] = (getattr(dims, f"{axis}_rank"), members, int(total))
    return result


LAYOUTS = [dict(), dict(tp=2), dict(tp=4), dict(cp=2), dict(pp=2), dict(tp=2, cp=2), dict(tp=2, pp=2),
           dict(cp=2, pp=2), dict(pp=2, dp=2), dict(tp=2, dp=2), dict(dp=4)]


@pytest.mark.parametrize("kwargs", LAYOUTS, ids=lambda k: ",".join(f"{a}{v}" for a, v in k.items()) or "default")
def test_layouts_on_4_ranks(rank_pool, kwargs):
    results = rank_pool(4).run(_layout_on_rank, kwargs)
    sizes = resolve_sizes(4, **{"tp": 1, "cp": 1, "pp": 1, "dp": -1, **kwargs})
    expected = expected_layout(4, sizes)
    for rank, res in enumerate(results):
        assert res["sizes"] == sizes and res["world"] == 4
        for axis in AXES:
            axis_rank, members = expected[rank][axis]
            assert res[axis] == (axis_rank, members, sum(members)), (rank, axis)


def test_tp_is_innermost(rank_pool):
    res = rank_pool(4).run(_layout_on_rank, dict(tp=2))
    assert [r["tp"][1] for r in res] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r["dp"][1] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "does not divide world size 4"),
    (dict(tp=2, cp=2, dp=2), "= 8 != world size 4"),
    (dict(tp=0), "tp=0"),
    (dict(cp=-1), "cp=-1"),
    (dict(pp=1.5), "pp=1.5"),
    (dict(dp=0), "dp=0"),
    (dict(dp=-2), "dp=-2"),
])
def test_bad_sizes_name_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("*", r"\*")):
        resolve_sizes(4, **{"tp": 1, "cp": 1, "pp": 1, "dp": -1, **kwargs})


def _bad_init_on_rank():
    try:
        ok.init_parallel(tp=3)
    except ValueError as exc:
        # the error came before any collective: the group still works and no peer is waiting
        one = torch.ones(1)
        dist.all_reduce(one)
        return str(exc), int(one)
    return None, None


def test_bad_layout_raises_on_every_rank_before_communicating(rank_pool):
    for message, total in rank_pool(4).run(_bad_init_on_rank):
        assert "tp*cp*pp = 3*1*1 = 3 does not divide world size 4" in message
        assert total == 4


def _default_group_on_rank():
    return resolve_group(None) is dist.group.WORLD, dist.get_world_size(resolve_group(None))


def test_group_none_is_world(rank_pool):
    assert rank_pool(2).run(_default_group_on_rank) == [(True, 2), (True, 2)]


def test_single_process_without_launcher():
    """No torchrun environment: a world of one on gloo, every axis of size 1."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    code = ("import overlapkernels as ok, torch.distributed as dist; d = ok.init_parallel();"
            "print(d.world_size, d.tp_size, d.dp_size, d.tp_rank, dist.get_backend())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1", "0", "gloo"]
