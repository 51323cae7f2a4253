"""fsdp.save's atomic switch on gloo ranks when a save fails partway: a crash that left both the old
and the new checkpoint, a save that fails in DCP's write (on one rank) or between the two renames,
and a failure on rank 0 alone. The failure is raised on every rank (none waits alone), and the
previous checkpoint still loads bit for bit. Resume, resharding and what a checkpoint holds:
test_fsdp_checkpoint_gloo.py."""
import copy
import os

import pytest
import torch
import torch.distributed as dist

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import OPTIMIZERS, _batches, _loss, _net


def _checkpoint_after_crash_on_rank(path):
    """A crash after the switch left both checkpoints, whole: ``path`` is the newer, and a load takes
    it, not ``.old``. A save interrupted before it left a temp folder: the next save starts afresh,
    none of its files end up in the checkpoint."""
    import shutil

    sharded = fsdp.shard(_net(), stage=2)
    fsdp.save(sharded, path + "-older")
    with torch.no_grad():
        sharded.all_units[0].master.add_(1.0)
    fsdp.save(sharded, path)
    newer = sharded.full_state_dict()
    if dist.get_rank() == 0:  # a crash after the switch but before the old one was deleted
        shutil.copytree(path + "-older", path + ".old")
        os.makedirs(path + ".tmp")
        open(os.path.join(path + ".tmp", "stale.distcp"), "w").close()
    dist.barrier()
    fresh = fsdp.shard(_net(), stage=2)
    fsdp.load(fresh, path)
    took_newer = all(torch.equal(v, newer[k]) for k, v in fresh.full_state_dict().items())
    fsdp.save(sharded, path)  # must not trip over the leftovers
    fsdp.load(sharded, path)
    return took_newer, not os.path.exists(path + ".old"), os.listdir(path).count("stale.distcp")


def test_save_after_a_crash_that_left_both_checkpoints(rank_pool, tmp_path):
    assert rank_pool(2).run(_checkpoint_after_crash_on_rank, str(tmp_path / "c")) == [(True, True, 0)] * 2


def _fail_in_dcp_write_on_rank_1(mp, ck):
    """Rank 1 writes its shards, then its disk fills (DCP's write step fails there only)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    write = FileSystemWriter.write_data

    def full_disk(self, plan, planner):
        written = write(self, plan, planner)
        if dist.get_rank() == 1:
            written.wait()
            raise OSError(28, "No space left on device")
        return written

    mp.setattr(FileSystemWriter, "write_data", full_disk)


def _crash_between_the_renames(mp, ck):
    """Rank 0's switch fails when it moves the new checkpoint into place (after whatever it did to
    the old one first)."""
    replace = os.replace

    def failing(src, dst, **kwargs):
        if os.fspath(src).endswith(".tmp"):
            raise OSError(5, "Input/output error")
        return replace(src, dst, **kwargs)

    mp.setattr(ck.os, "replace", failing)


def _interrupted_save_on_rank(path, plant):
    from overlapkernels.runtime.fsdp import checkpoint as ck

    world, rank = dist.get_world_size(), dist.get_rank()
    sharded = fsdp.shard(_net(), stage=3, optimizer=OPTIMIZERS["adamw"])

    def train(x, y):
        _loss(sharded(x[rank * 4:(rank + 1) * 4]), y[rank * 4:(rank + 1) * 4]).backward()
        sharded.step()

    def optim_state():  # this rank's shards of Adam's moments and its step count, and the groups
        state = sharded.optimizer.state_dict()  # (Adam's betas stay a tuple, though JSON has only lists)
        return ({(i, k): v.clone() for i, entry in state["state"].items() for k, v in entry.items()},
                copy.deepcopy(state["param_groups"]))

    batches = _batches(2, 4, world)
    train(*batches[0])
    fsdp.save(sharded, path)  # checkpoint A
    want_model, (want_state, want_groups) = sharded.full_state_dict(), optim_state()
    train(*batches[1])
    assert not all(torch.equal(want_model[k], v) for k, v in sharded.full_state_dict().items())
    with pytest.MonkeyPatch.context() as mp:
        plant(mp, ck)
        try:
            fsdp.save(sharded, path)
        except Exception as exc:  # noqa: BLE001 - DCP's own is a BaseException: fsdp.save raises a RuntimeError
            told = f"{type(exc).__name__}: {exc}"
        else:
            told = "no error"
    total = torch.ones(1)
    dist.all_reduce(total)  # no rank is left behind in the failed save
    after_model = sharded.full_state_dict()
    fsdp.load(sharded, path)
    got_model, (got_state, got_groups) = sharded.full_state_dict(), optim_state()
    assert list(got_model) == list(want_model)
    differ = [k for k in want_model if not torch.equal(got_model[k], want_model[k])]
    differ += [k for k in want_state if not torch.equal(got_state[k], want_state[k])]
    assert not differ and sorted(got_state) == sorted(want_state), f"not checkpoint A: {differ}"
    assert got_groups == want_groups, (got_groups, want_groups)
    fsdp.save(sharded, path + "2")  # the leftovers of the failed save do not hold up the next ones
    fsdp.save(sharded, path)
    return told, int(total), not all(torch.equal(after_model[k], v) for k, v in got_model.items())


@pytest.mark.parametrize("plant, told, why", [
    (_fail_in_dcp_write_on_rank_1, "RuntimeError: fsdp.save: writing ", "No space left on device"),
    (_crash_between_the_renames, "RuntimeError: fsdp.save: moving ", "on rank 0: OSError: [Errno 5] Input/output"),
])
def test_an_interrupted_save_keeps_the_previous_checkpoint(rank_pool, tmp_path, plant, told, why):
    """A save that fails in DCP's write (on rank 1 only) or between the two renames (rank 0's part)
    raises on every rank, and a load gives back checkpoint A bit for bit: the parameters and the
    optimizer's moments, step count and groups (not the step trained since, nor a mix)."""
    got = rank_pool(2).run(_interrupted_save_on_rank, str(tmp_path / "ckpt"), plant)
    for message, total, reverted in got:
        assert message.startswith(told) and why in message, got
        assert total == 2 and reverted, got


def _rank0_failure_on_rank(path):
    from overlapkernels.runtime.fsdp import checkpoint as ck

    sharded = fsdp.shard(_net(), stage=2)
    original = ck._switch

    def fail_on_rank0(*args):
        if dist.get_rank() == 0:
            raise OSError(28, "No space left on device")
        return original(*args)

    ck._switch = fail_on_rank0
    try:
        fsdp.save(sharded, path)
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = "no error"
    finally:
        ck._switch = original
    total = torch.ones(1)
    dist.all_reduce(total)  # nobody is left behind in the save
    return message, int(total)


def test_a_failure_on_rank0_during_save_reaches_every_rank(rank_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    want = (f"fsdp.save: moving {path + '.tmp'!r} to {path!r} failed on rank 0: OSError: [Errno 28] No space left "
            "on device", 2)
    assert rank_pool(2).run(_rank0_failure_on_rank, path) == [want, want]


def _pending_timeout_on_rank_1(path):
    """Rank 1 holds a symm/fused call's device timeout not yet raised (checked a call late)."""
    from pending_timeout import pending_timeout_on

    sharded = fsdp.shard(_net(), stage=2)
    try:
        with pending_timeout_on(1, "ok/all_gather_matmul[fused]: rank 1 timed out waiting for chunk 0 from rank 0"):
            fsdp.save(sharded, path)
        message = "saved"
    except (RuntimeError, ValueError) as exc:
        message = f"{type(exc).__name__}: {exc}"
    total = torch.ones(1)
    dist.all_reduce(total)  # nobody is left behind in the save
    return message, int(total), os.path.exists(path) or os.path.exists(path + ".tmp")


def test_a_timeout_pending_on_one_rank_stops_the_save_on_every_rank(rank_pool, tmp_path):
    """A symm/fused call whose wait timed out computed garbage; its error is raised a call late, so
    a save right after it would have checkpointed that garbage. fsdp.save first checks every rank's
    pending errors: all ranks raise, and nothing is written."""
    timeout = "ok/all_gather_matmul[fused]: rank 1 timed out waiting for chunk 0 from rank 0"
    rank0, rank1 = rank_pool(2).run(_pending_timeout_on_rank_1, str(tmp_path / "ckpt"))
    assert rank1 == (f"SignalTimeoutError: {timeout}", 2, False)
    assert rank0 == (f"PeerFailedError: fsdp.save: rank 1 of the group failed, so this rank stops too: "
                     f"SignalTimeoutError: {timeout}", 2, False)


def _chunks_in_one_checkpoint_on_rank(path):
    """An interleaved pipeline rank's chunks (two ShardedModules over one group, of other shapes)
    go into one checkpoint, replaced atomically together, and resume bit for bit: their keys and
    metadata do not collide. A load with another chunk count, or chunks over other groups, is
    refused by every rank."""
    torch.manual_seed(0)
    make = lambda: [fsdp.shard(torch.nn.Linear(4, 6).double(), stage=3, optimizer=OPTIMIZERS["adamw"]),  # noqa
                    fsdp.shard(torch.nn.Linear(6, 3).double(), stage=2, optimizer=OPTIMIZERS["sgd"])]
    chunks, batches = make(), _batches(4, 2, dist.get_world_size())

    def run(chunks, steps):
        for x, y in steps:
            rows = slice(dist.get_rank() * 2, dist.get_rank() * 2 + 2)
            _loss(chunks[1](chunks[0](x[rows, :4])), y[rows]).backward()
            for chunk in chunks:
                chunk.step()

    run(chunks, batches[:2])
    fsdp.save(chunks, path, extra={"step": 2})
    run(chunks, batches[2:])
    torch.manual_seed(1)  # other initial weights: the load must replace them all
    resumed = make()
    said = [fsdp.load(resumed, path)]
    run(resumed, batches[2:])
    said.append(all(torch.equal(a.full_state_dict()[k], b.full_state_dict()[k])
                    for a, b in zip(chunks, resumed) for k in a.full_state_dict()))
    alone = fsdp.shard(torch.nn.Linear(6, 3).double(), dist.new_group([dist.get_rank()]), stage=2)
    one = dist.get_rank() == 1  # refused on every rank also where one rank alone passes the mistake
    for bad in (resumed[:1], [resumed[0], alone] if one else resumed, resumed if one else resumed[:1]):
        try:
            fsdp.load(bad, path)
        except ValueError as exc:
            said.append(str(exc))
    return said


def test_a_ranks_chunks_share_one_checkpoint(rank_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    for said in rank_pool(2).run(_chunks_in_one_checkpoint_on_rank, path):
        assert said[:2] == [{"step": 2}, True], said
        assert said[2] == f"checkpoint {path!r} holds 2 chunks per rank; this rank passed 1", said[2]
        assert said[3].startswith("fsdp.load: rank 1: the chunks are sharded over different groups"), said[3]
        assert said[4] == "fsdp.load: every rank must pass as many chunks; got [1, 2] (by rank)", said[4]
