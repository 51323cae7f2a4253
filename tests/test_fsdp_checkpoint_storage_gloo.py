"""fsdp.save / fsdp.load where storage and metadata misbehave, on gloo ranks: a rank that cannot see
the checkpoint (storage not shared by the nodes) or sees it late (a network filesystem's cache), a
missing checkpoint, metadata that is not ours, optimizer hyperparameters JSON cannot hold as is, and
the caller's extra state.
Every failure is raised by every rank, never by one while the others wait."""
import math
import os

import pytest
import torch
import torch.distributed as dist

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import _batches, _loss, _net


def _blind_rank_on_rank(path, blind_in):
    """Rank 1 cannot see what rank 0 writes (storage not shared by the nodes), in ``blind_in``: both
    ranks raise naming rank 1, none waits in a collective (the pool would report a timeout). A
    failed save leaves the previous checkpoint as it was: it was switched out (and deleted) before
    the check."""
    from overlapkernels.runtime.fsdp import checkpoint_files as ck

    sharded = fsdp.shard(_net(), stage=2)
    fsdp.save(sharded, path)
    before = sharded.full_state_dict()
    x, y = _batches(1, 2, dist.get_world_size())[0]
    _loss(sharded(x), y).backward()
    sharded.step()  # what a failed save must not leave behind
    exists, wait = ck.os.path.exists, ck.VISIBILITY_WAIT_S
    ck.VISIBILITY_WAIT_S = 0.5  # it keeps looking that long (a network filesystem's cached view)
    if dist.get_rank() == 1:
        ck.os.path.exists = lambda p: False if p.endswith(ck.META) else exists(p)
    try:
        (fsdp.save if blind_in == "save" else fsdp.load)(sharded, path)
    except (RuntimeError, ValueError) as exc:
        said = type(exc).__name__, str(exc)
    else:
        said = "no error"
    finally:
        ck.os.path.exists, ck.VISIBILITY_WAIT_S = exists, wait
    fsdp.load(sharded, path)
    kept = all(torch.equal(v, before[k]) for k, v in sharded.full_state_dict().items())
    return said, kept, os.path.exists(path + ".tmp")


@pytest.mark.parametrize("blind_in", ["save", "load"])
def test_a_rank_that_cannot_see_the_checkpoint_fails_every_rank(rank_pool, tmp_path, blind_in):
    results = rank_pool(2).run(_blind_rank_on_rank, str(tmp_path / "c"), blind_in)
    for (kind, said), kept, leftover in results:
        assert "1" in said and "cannot see the checkpoint" in said and "shared by all nodes" in said, said
        assert kept and not leftover, results
    assert len({said for said, _, _ in results}) == 1  # the same error on every rank


def _different_paths_on_rank(root):
    sharded = fsdp.shard(_net(), stage=2)
    fsdp.save(sharded, os.path.join(root, "ckpt"))
    try:  # a name with a per-rank timestamp
        fsdp.save(sharded, os.path.join(root, "ckpt" if dist.get_rank() == 0 else f"ckpt-{dist.get_rank()}"))
    except ValueError as exc:
        said = str(exc)
    else:
        said = "no error"
    fsdp.load(sharded, os.path.join(root, "ckpt"))  # the previous one, whole
    return said, sorted(os.listdir(root))


def test_ranks_passing_different_paths_are_refused_before_anything_is_written(rank_pool, tmp_path):
    root = str(tmp_path)
    want = (f"fsdp.save: every rank must pass the same path; got {[root + '/ckpt', root + '/ckpt-1']} (by rank)",
            ["ckpt"])
    assert rank_pool(2).run(_different_paths_on_rank, root) == [want, want]


def _extra_state_on_rank(root):
    """``extra`` (a trainer's own state) travels with the checkpoint and comes back as it was; one
    that differs between ranks, or that JSON would not give back as it is (int keys, tuples: a
    MultiStepLR's milestones came back with string keys), is refused by every rank before anything
    is written. A NaN passed by every rank is the same value (it compared unequal to itself)."""
    sharded = fsdp.shard(_net(), stage=2)
    path = os.path.join(root, "ckpt")
    fsdp.save(sharded, path)
    said = [fsdp.load(sharded, path)]  # none saved: {}
    fsdp.save(sharded, path, extra={"steps": 3, "scaler": {"scale": 1024.0}, "best": [float("nan")]})
    said.append(fsdp.load(sharded, path))
    one = 1 if dist.get_rank() == 0 else 1.0  # equal in Python, not in the checkpoint
    for bad in ({"steps": dist.get_rank()}, {"steps": one}, {"at": torch.ones(1)} if dist.get_rank() else {"at": 1},
                {"milestones": {3: 1}}, {"betas": [(0.9, 0.95)]}, [1]):
        try:
            fsdp.save(sharded, path, extra=bad)
        except (TypeError, ValueError) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    said.append(fsdp.load(sharded, path))  # the previous one, whole
    return said, sorted(os.listdir(root))


def test_extra_state_is_saved_with_the_checkpoint_and_refused_when_ranks_differ(rank_pool, tmp_path):
    keep = "which JSON would not give back as it is; use str keys"
    for said, listing in rank_pool(2).run(_extra_state_on_rank, str(tmp_path)):
        assert said[0] == {} and said[1]["steps"] == 3 and said[1]["scaler"] == {"scale": 1024.0}, said
        assert len(said[1]["best"]) == 1 and math.isnan(said[1]["best"][0]), said[1]
        assert said[2] == ('ValueError: fsdp.save: extra must be the same on every rank; ranks [1] passed another than '
                           'rank 0\'s {"steps": 0}'), said[2]
        assert said[3] == ('ValueError: fsdp.save: extra must be the same on every rank; ranks [1] passed another than '
                           'rank 0\'s {"steps": 1}'), said[3]
        assert said[4] == "TypeError: fsdp.save: rank 1's extra['at'] is a Tensor, " + keep + \
            ", and numbers, strings, bools, None, lists and dicts (pickle and base64-encode anything else)", said[4]
        assert said[5].startswith(f"TypeError: fsdp.save: rank 0's extra['milestones'] has the key 3 (int; JSON keys are "
                                  f"strings), {keep}"), said[5]
        assert said[6].startswith(f"TypeError: fsdp.save: rank 0's extra['betas'][0] is a tuple, {keep}"), said[6]
        assert said[7] == ("TypeError: fsdp.save: rank 0's extra=list: expected a dict (of JSON values: the trainer's "
                           "own state), or None"), said[7]
        assert said[8]["steps"] == 3 and listing == ["ckpt"], (said, listing)


def _missing_checkpoint_on_rank(path):
    try:
        fsdp.load(fsdp.shard(_net(), stage=1), path)
    except FileNotFoundError as exc:
        return str(exc)


def test_a_missing_checkpoint_raises_on_every_rank(rank_pool, tmp_path):
    want = f"no overlapkernels FSDP checkpoint at {str(tmp_path / 'none')!r}"
    assert rank_pool(2).run(_missing_checkpoint_on_rank, str(tmp_path / "none")) == [want, want]


def _tensor_lr_on_rank(path):
    make = lambda: fsdp.shard(_net(), stage=2, optimizer=lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2)))  # noqa: E731
    first = make()
    for group in first.optimizer.param_groups:
        group["lr"].fill_(5e-3)  # a schedule updating the tensor in place
    fsdp.save(first, path)
    resumed = make()
    fsdp.load(resumed, path)
    # an optimizer that holds a float lr gets the saved tensor (torch's load_state_dict restores what
    # was saved, too)
    floating = fsdp.shard(_net(), stage=2, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    fsdp.load(floating, path)
    return [(type(g["lr"]).__name__, float(g["lr"]), g["lr"].dtype == torch.float32)
            for sharded in (resumed, floating) for g in sharded.optimizer.param_groups]


def test_a_tensor_learning_rate_saves_and_loads_as_a_tensor(rank_pool, tmp_path):
    """json.dump takes no tensors: a tensor lr failed the save after every shard was written; and
    loaded as a float it would change what a compiled optimizer sees."""
    for groups in rank_pool(2).run(_tensor_lr_on_rank, str(tmp_path / "c")):
        assert groups and all(g == ("Tensor", float(torch.tensor(5e-3)), True) for g in groups), groups


def test_a_checkpoint_that_shows_up_late_is_waited_for(tmp_path, monkeypatch):
    """A network filesystem may show another node's rename a little late: a rank looks again (listing
    the folder refreshes the view) before it calls the checkpoint unreachable."""
    from overlapkernels.runtime.fsdp import checkpoint_files as ck

    path = tmp_path / "c"
    calls = []
    real = ck.os.path.exists
    monkeypatch.setattr(ck.os.path, "exists", lambda p: (calls.append(p), len(calls) > 3 and real(p))[1])
    path.mkdir()
    (path / ck.META).write_text("{}")
    assert ck._sees(str(path)) and len(calls) == 4
    monkeypatch.setattr(ck, "VISIBILITY_WAIT_S", 0.3)
    assert not ck._sees(str(tmp_path / "never"))


def _unkeepable_group_value_on_rank(path):
    import numpy as np

    sharded = fsdp.shard(_net(), stage=1)
    sharded.optimizer.param_groups[0]["note"] = np.float32(0.5)  # JSON has no such number
    try:
        fsdp.save(sharded, path)
    except TypeError as exc:
        return str(exc).split(" (")[0], os.path.exists(path + ".tmp")
    return "saved", None


def test_a_param_group_value_json_cannot_keep_is_refused_before_writing(rank_pool, tmp_path):
    want = ("fsdp.save: the optimizer's param_groups hold a value the checkpoint cannot keep", False)
    assert rank_pool(2).run(_unkeepable_group_value_on_rank, str(tmp_path / "c")) == [want, want]


def _stray_optimizer_parameter_on_rank(path):
    """An optimizer that holds a parameter of its own: the checkpoint would not hold it. From the
    factory, shard() refuses it; added to the optimizer afterwards, save and load refuse by index,
    on every rank, before writing or reading anything."""
    stray = torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))
    said = []
    try:
        fsdp.shard(_net(), stage=2, optimizer=lambda ps: torch.optim.SGD([*ps, stray], lr=0.1))
    except ValueError as exc:
        said.append(str(exc))
    sharded = fsdp.shard(_net(), stage=2, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1))
    sharded.optimizer.add_param_group({"params": [stray]})
    fsdp.save(fsdp.shard(_net(), stage=2), path + "-good")
    for call in (lambda: fsdp.save(sharded, path), lambda: fsdp.load(sharded, path + "-good")):
        try:
            call()
        except ValueError as exc:
            said.append(str(exc))
    return said, os.path.exists(path) or os.path.exists(path + ".tmp")


def test_optimizer_parameters_that_are_no_units_masters_are_refused(rank_pool, tmp_path):
    want = ["fsdp.shard: the optimizer's param group 0 holds a tensor of shape (2,) that is not a parameter of the "
            "model: fsdp would neither shard nor checkpoint it; build the optimizer over the parameters the factory "
            "is given"]
    want += ["optimizer parameters [4] are not units' masters: fsdp checkpoints hold only what fsdp.shard gave the "
             "optimizer"] * 2  # the units inp, blocks, out and the root hold indices 0-3
    assert rank_pool(2).run(_stray_optimizer_parameter_on_rank, str(tmp_path / "c")) == [(want, False)] * 2


def _groups_that_do_not_partition_on_rank(path):
    """Rank 0 shards over a group of its own, rank 1 over the world: rank 0 would be in two model
    parts. Refused by save and load alike on every rank, which then still communicate in step."""
    own = dist.new_group([0])
    sharded = fsdp.shard(_net(), own if dist.get_rank() == 0 else None, stage=1)
    said = []
    for call in (fsdp.save, fsdp.load):
        try:
            call(sharded, path)
        except ValueError as exc:
            said.append(str(exc))
    total = torch.ones(1)
    dist.all_reduce(total)
    return said, int(total)


def test_sharding_groups_that_do_not_partition_the_world_are_refused(rank_pool, tmp_path):
    want = ["fsdp.save/load: the sharding groups of the ranks [(0,), (0, 1)] do not partition the world of 2 ranks; "
            "every rank must call with its own dp group"] * 2
    assert rank_pool(2).run(_groups_that_do_not_partition_on_rank, str(tmp_path / "c")) == [(want, 2)] * 2


def _malformed_metadata_on_rank(path):
    """Metadata that is JSON but not ours, ours in an older format, or not JSON at all: each refused
    by every rank, by type and name."""
    import json

    from overlapkernels.runtime.fsdp import checkpoint as ck

    sharded = fsdp.shard(_net(), stage=1)
    fsdp.save(sharded, path)
    meta_file = os.path.join(path, ck.META)
    with open(meta_file) as f:
        saved = json.load(f)
    said = []
    for text in (json.dumps({"format": ck.FORMAT}),  # missing everything else
                 json.dumps({k: v for k, v in saved.items() if k != "format"}),  # format 1 had no "format"
                 "{not json"):
        dist.barrier()
        if dist.get_rank() == 0:
            with open(meta_file, "w") as f:
                f.write(text)
        dist.barrier()
        try:
            fsdp.load(sharded, path)
        except (ValueError, RuntimeError) as exc:
            said.append((type(exc).__name__, str(exc).split(" (")[0]))
    return said


def test_malformed_metadata_is_refused_by_every_rank(rank_pool, tmp_path):
    path = str(tmp_path / "c")
    meta_file = os.path.join(path, "overlapkernels_fsdp.json")
    want = [("ValueError", f"checkpoint {path!r} has metadata this version cannot read"),
            ("ValueError", f"checkpoint {path!r} has format 1; this version reads formats [2, 3, 4]"),
            ("RuntimeError", f"fsdp.load: cannot read {meta_file!r}: JSONDecodeError: Expecting property name enclosed "
                             "in double quotes: line 1 column 2")]
    assert rank_pool(2).run(_malformed_metadata_on_rank, path) == [want, want]


@pytest.mark.usefixtures("world_of_one")
def test_a_compiled_sharded_module_saves_and_loads(tmp_path):
    """torch.compile(sharded) forwards attributes to the ShardedModule: save and load take it (the
    type check for a module that is not sharded at all refused it for a while)."""
    torch.manual_seed(0)
    sharded = fsdp.shard(_net(), stage=2)
    compiled = torch.compile(sharded)
    fsdp.save(compiled, tmp_path / "ckpt")
    want = sharded.full_state_dict()
    with torch.no_grad():
        sharded.all_units[0].master.add_(1.0)
    fsdp.load(compiled, tmp_path / "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(sharded.full_state_dict().values(), want.values()))
