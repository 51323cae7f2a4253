"""fsdp.save / fsdp.load keep what is not float32 as it was, on gloo ranks: buffers of another dtype
are refused by name, optimizer state of other dtypes and a float64 tensor learning rate come back
in their own dtypes, and JSON values that differ only in the order of their keys are the same value.
Non-persistent buffers stay out of a checkpoint.
Resume and resharding: test_fsdp_checkpoint_gloo.py."""
import json
import os

import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from test_fsdp_gloo import D_IN, OPTIMIZERS, _loss, _net


class _StatNet(nn.Module):
    """A persistent buffer (in ``dtype``) and a non-persistent cache (``cache`` elements: a rotary
    table sized for the context, rebuilt by the model, never saved)."""

    def __init__(self, dtype=torch.float64, cache=2):
        super().__init__()
        self.fc = nn.Linear(D_IN, 2)
        self.register_buffer("stat", torch.arange(3, dtype=dtype))
        self.register_buffer("cache", torch.zeros(cache), persistent=False)

    def forward(self, x):
        return self.fc(x)


def _stat_sharded(dtype=torch.float64, cache=2):
    torch.manual_seed(0)
    return fsdp.shard(_StatNet(dtype, cache).double(), stage=2, optimizer=OPTIMIZERS["sgd"])


def _buffer_dtype_on_rank(path):
    """A buffer saved as float64 and a model whose buffer is now float32 (of the same shape): DCP
    would cast it in silently; refused by every rank, naming the buffer and both dtypes."""
    saved = _stat_sharded()
    saved.module.stat.fill_(0.1)  # not exactly a float32
    fsdp.save(saved, path)
    model = _StatNet().double()
    model.stat = model.stat.float()
    other = fsdp.shard(model, stage=2, optimizer=OPTIMIZERS["sgd"])
    try:
        fsdp.load(other, path)
    except ValueError as exc:
        return str(exc)
    return f"loaded as {other.module.stat.dtype}"


def test_a_buffer_of_another_dtype_is_refused_by_name(rank_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    want = f"checkpoint {path!r}: buffer stat was saved as float64 [3]; this model's is float32 [3]"
    assert rank_pool(2).run(_buffer_dtype_on_rank, path) == [want, want]


def _non_persistent_buffer_on_rank(path):
    """A non-persistent buffer is not in the model's state_dict: a checkpoint neither holds nor
    restores it, and a model whose cache has another size (a longer context) loads it."""
    first = _stat_sharded()
    first.module.cache.fill_(3.0)
    fsdp.save(first, path)
    with open(os.path.join(path, fsdp.checkpoint.META)) as f:
        kept = sorted(json.load(f)["buffers"])
    same = _stat_sharded()
    same.module.cache.fill_(7.0)
    fsdp.load(same, path)
    longer = _stat_sharded(cache=5)
    fsdp.load(longer, path)
    return kept, same.module.cache.tolist(), longer.module.cache.tolist(), longer.module.stat.tolist()


def test_non_persistent_buffers_are_neither_saved_nor_restored(rank_pool, tmp_path):
    want = (["stat"], [7.0, 7.0], [0.0] * 5, [0.0, 1.0, 2.0])
    assert rank_pool(2).run(_non_persistent_buffer_on_rank, str(tmp_path / "ckpt")) == [want, want]


def _optimizer_state_dtypes_on_rank(path):
    """Optimizer state that is not float32 - per-rank int64 counts past 2**24, uint8 codes (a
    block-quantised optimizer's), a replicated float64 scalar - is read back in the dtype it was
    saved in: read as float32 the counts and the scalar came back rounded. (torch's
    load_state_dict then casts state to the parameter's dtype, float64 here, as without fsdp.)"""
    rank = dist.get_rank()
    x, y = torch.ones(2, D_IN, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)
    sharded = fsdp.shard(_net(), stage=2, optimizer=OPTIMIZERS["sgd"])
    _loss(sharded(x), y).backward()
    sharded.step()
    state = sharded.optimizer.state[sharded.all_units[0].master]
    want = {"counts": torch.arange(rank + 2, dtype=torch.int64) + 2 ** 40,
            "codes": torch.tensor([250, rank], dtype=torch.uint8),
            "ema": torch.tensor(0.1, dtype=torch.float64)}
    state.update({k: v.clone() for k, v in want.items()})
    fsdp.save(sharded, path)
    fresh = fsdp.shard(_net(), stage=2, optimizer=OPTIMIZERS["sgd"])
    fsdp.load(fresh, path)
    got = fresh.optimizer.state[fresh.all_units[0].master]
    return [k for k, v in want.items() if not torch.equal(got[k].to(v.dtype), v)]


def test_optimizer_state_of_other_dtypes_comes_back_exactly(rank_pool, tmp_path):
    assert rank_pool(2).run(_optimizer_state_dtypes_on_rank, str(tmp_path / "ckpt")) == [[], []]


def _float64_lr_on_rank(path):
    """A float64 tensor lr (0.1 is no float32) comes back as float64, exactly: into an optimizer
    that holds a float lr (a new tensor) as into one that holds a float64 tensor (copied in)."""
    lr = torch.tensor(0.1, dtype=torch.float64)
    first = fsdp.shard(_net(), stage=2, optimizer=lambda ps: torch.optim.SGD(ps, lr=lr.clone()))
    fsdp.save(first, path)
    said = []
    for make_lr in (lambda: 0.5, lambda: torch.tensor(0.5, dtype=torch.float64)):
        resumed = fsdp.shard(_net(), stage=2, optimizer=lambda ps, f=make_lr: torch.optim.SGD(ps, lr=f()))
        fsdp.load(resumed, path)
        said += [(str(g["lr"].dtype), g["lr"].item() == 0.1) for g in resumed.optimizer.param_groups]
    return said


def test_a_float64_tensor_learning_rate_keeps_its_dtype(rank_pool, tmp_path):
    for said in rank_pool(2).run(_float64_lr_on_rank, str(tmp_path / "ckpt")):
        assert said and all(s == ("torch.float64", True) for s in said), said


def _key_order_on_rank(path, save):
    """The ranks built the same dicts in other orders (from a set, a merge): the same value. Extra
    state is accepted and comes back; optimizer state is saved once and so reshards (as a value
    per rank it would reload only on as many ranks). Values equal in Python but not as JSON (1 and
    1.0) are not the same: each rank gets its own back."""
    rank = dist.get_rank()
    sharded = fsdp.shard(_net(), stage=2, optimizer=OPTIMIZERS["sgd"])
    master = sharded.all_units[0].master
    if save:
        pairs = [("a", 1), ("b", [2.5, None])]
        ordered = dict(pairs if rank == 0 else pairs[::-1])
        sharded.optimizer.state[master]["cfg"] = ordered
        fsdp.save(sharded, path, extra={"run": ordered})
        sharded.optimizer.state[master]["scale"] = 1 if rank == 0 else 1.0
        fsdp.save(sharded, path + "-scale")
        fresh = fsdp.shard(_net(), stage=2, optimizer=OPTIMIZERS["sgd"])
        fsdp.load(fresh, path + "-scale")
        scale = fresh.optimizer.state[fresh.all_units[0].master]["scale"]
        assert type(scale) is (int if rank == 0 else float), scale
    fresh = fsdp.shard(_net(), stage=2, optimizer=OPTIMIZERS["sgd"])
    try:
        extra = fsdp.load(fresh, path)
    except ValueError as exc:
        return str(exc)
    return extra, fresh.optimizer.state[fresh.all_units[0].master]["cfg"]


def test_json_values_that_differ_in_key_order_only_are_one_value(rank_pool, tmp_path):
    path = str(tmp_path / "ckpt")
    cfg = {"a": 1, "b": [2.5, None]}
    assert rank_pool(2).run(_key_order_on_rank, path, True) == [({"run": cfg}, cfg)] * 2
    assert rank_pool(1).run(_key_order_on_rank, path, False) == [({"run": cfg}, cfg)]


def _dict_subclass_in_extra_on_rank(path):
    """A Counter or defaultdict inside ``extra`` would come back as a plain dict: refused like a
    tuple, by every rank, before anything is written."""
    from collections import Counter, defaultdict

    said = []
    for inner in (Counter({"a": 2}), defaultdict(int, {"a": 2})):
        try:
            fsdp.save(fsdp.shard(_net(), stage=2), path, extra={"seen": inner})
        except TypeError as exc:
            said.append(str(exc).split(", which")[0])
    return said, os.path.exists(path) or os.path.exists(path + ".tmp")


def test_a_dict_subclass_inside_extra_is_refused(rank_pool, tmp_path):
    want = (["fsdp.save: rank 0's extra['seen'] is a Counter", "fsdp.save: rank 0's extra['seen'] is a defaultdict"],
            False)
    assert rank_pool(2).run(_dict_subclass_in_extra_on_rank, str(tmp_path / "ckpt")) == [want, want]
