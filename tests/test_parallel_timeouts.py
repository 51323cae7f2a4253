"""init_parallel's timeouts and launch environment: the default group it creates, an axis that is
the default group itself, the mesh's groups created under the timeout (new_groups_timeout), a
group whose timeout torch cannot set; RANK without the rest of a launcher."""
from datetime import timedelta

import pytest
import torch.distributed as dist

import overlapkernels as ok


def test_the_default_group_init_parallel_creates_takes_its_timeout(monkeypatch):
    """Given a timeout, the default group created here takes it too; without one, 10 minutes."""
    from overlapkernels import parallel

    class Made(Exception):
        pass

    made = []

    def init_default_process_group(backend=None, timeout=None):
        made.append(timeout)
        raise Made

    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel, "init_default_process_group", init_default_process_group)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    for timeout in (7.5, timedelta(minutes=2), None):
        with pytest.raises(Made):
            ok.init_parallel(timeout=timeout)
    assert made == [timedelta(seconds=7.5), timedelta(minutes=2), timedelta(minutes=10)]


def test_an_axis_spanning_the_world_gives_the_default_group_the_timeout(world_of_one, monkeypatch):
    """On one rank every axis is the default group itself: init_parallel(timeout=) reaches it, and
    the mesh's groups are created under that timeout (gloo in torch <= 2.7 fixes it at creation)."""
    import torch.distributed.device_mesh as device_mesh
    from torch.distributed import distributed_c10d as c10d

    from overlapkernels import _compat

    before = _compat.group_timeout(dist.group.WORLD)
    make_mesh, at_creation = device_mesh.init_device_mesh, []
    monkeypatch.setattr(device_mesh, "init_device_mesh",
                        lambda *a, **k: at_creation.append(c10d._get_default_timeout("gloo")) or make_mesh(*a, **k))
    try:
        dims = ok.init_parallel(timeout=7.5)
        assert dims.dp_group is dist.group.WORLD and _compat.group_timeout(dist.group.WORLD) == timedelta(seconds=7.5)
        assert at_creation == [timedelta(seconds=7.5)]
    finally:
        _compat.set_group_timeout(dist.group.WORLD, before)


def test_new_groups_timeout_nests_and_restores():
    from torch.distributed import distributed_c10d as c10d

    from overlapkernels import _compat

    with _compat.new_groups_timeout(timedelta(seconds=1)):
        pass  # (installs the lookup)
    default = c10d._get_default_timeout("gloo")
    with _compat.new_groups_timeout(timedelta(seconds=3)):
        with _compat.new_groups_timeout(timedelta(seconds=5)):
            assert c10d._get_default_timeout("gloo") == timedelta(seconds=5)
        assert c10d._get_default_timeout("gloo") == timedelta(seconds=3)
    assert c10d._get_default_timeout("gloo") == default


def test_a_group_whose_timeout_cannot_be_set_says_so():
    from overlapkernels import _compat

    with pytest.warns(UserWarning, match=r"cannot set the timeout of process group .*; it keeps the backend's default"):
        _compat.set_group_timeout(object(), timedelta(seconds=1))


def test_rank_without_a_rendezvous_address_is_a_world_of_one(monkeypatch):
    """RANK alone (a scheduler's, WORLD_SIZE unset): no launcher to meet, so a world of one, not an
    env:// rendezvous waiting for a MASTER_ADDR nobody set."""
    from overlapkernels import parallel

    made = []
    monkeypatch.setattr(parallel.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(parallel.dist, "init_process_group", lambda backend, **kwargs: made.append(kwargs))
    for name in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    parallel.init_default_process_group("gloo", timeout=timedelta(seconds=3))
    assert [(k.get("rank"), k.get("world_size"), k.get("timeout")) for k in made] == [(0, 1, timedelta(seconds=3))]
