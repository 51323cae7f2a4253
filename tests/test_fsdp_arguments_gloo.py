"""What fsdp.shard refuses, by name, before any collective: bad arguments, units it cannot build, a
model already sharded, a bad group or no process group (the group still works after a refusal)."""
import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlapkernels.runtime import fsdp
from comm_guard import no_communication


def test_bad_arguments():
    with pytest.raises(ValueError, match="stage=4: expected 1, 2 or 3"):
        fsdp.shard(nn.Linear(2, 2), stage=4)
    with pytest.raises(TypeError, match="optimizer must be a callable"):
        fsdp.shard(nn.Linear(2, 2), optimizer="adam")
    with pytest.raises(ValueError, match="prefetch=-1"):
        fsdp.shard(nn.Linear(2, 2), prefetch=-1)
    for bad in (True, 2.0, "3"):  # True == 1 and 2.0 == 2, yet neither is a stage
        with pytest.raises(ValueError, match=rf"stage={bad!r}: expected 1, 2 or 3"):
            fsdp.shard(nn.Linear(2, 2), stage=bad)
    with pytest.raises(ValueError, match="prefetch=True"):
        fsdp.shard(nn.Linear(2, 2), prefetch=True)
    dtypes = r"expected torch.float64, float32, float16, bfloat16 or None$"
    with pytest.raises(ValueError, match=r"^param_dtype=torch.int8: " + dtypes):
        fsdp.shard(nn.Linear(2, 2), param_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"^reduce_dtype='bf16': " + dtypes):
        fsdp.shard(nn.Linear(2, 2), reduce_dtype="bf16")
    with pytest.raises(ValueError, match=r"^reduce_dtype=torch.float8_e4m3fn: " + dtypes):  # (failed in backward)
        fsdp.shard(nn.Linear(2, 2), reduce_dtype=torch.float8_e4m3fn)
    # param_dtype casts parameters, not buffers: BatchNorm failed deep in its first forward
    with pytest.raises(ValueError, match=r"^param_dtype=torch.bfloat16: BatchNorm1d '1' computes its parameters with "
                                         r"torch.float32 running statistics, which param_dtype does not cast"):
        fsdp.shard(nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)), param_dtype=torch.bfloat16)
    rope = nn.Linear(2, 2)  # an fp32 cache beside parameters (RoPE's cos/sin) computes fine in mixed dtypes: left
    rope.register_buffer("cos", torch.ones(2), persistent=False)
    assert fsdp._check_buffers_compute_in(rope, torch.bfloat16) is None
    for call in (fsdp.save, fsdp.load):  # (an AttributeError about 'group' from inside)
        with pytest.raises(TypeError, match=rf"^fsdp.{call.__name__}: expected a ShardedModule \(from fsdp.shard\), "
                                            r"got Linear$"):
            call(nn.Linear(2, 2), "ckpt")


def _bad_units_on_rank():
    """Units fsdp cannot build, refused by name on every rank before any collective: the group
    still works after them."""
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())

    class MixedDevices(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))

    half_cp = nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    own = [dist.new_group([r]) for r in range(dist.get_world_size())][dist.get_rank()]  # (a CP group apart from fsdp's)
    half_cp[0][0].weight.context_parallel_group = own  # one parameter tagged, not the others
    # unit '0' can be built, unit '1' cannot: refused before '0' re-points its parameters into a flat buffer
    late = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))
    before = [(p, p.data_ptr(), p.dtype) for p in late.parameters()]
    said = []
    two = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    for make in (lambda: fsdp.shard(Mixed()), lambda: fsdp.shard(nn.Sequential(nn.Linear(2, 2)), units="Block"),
                 lambda: fsdp.shard(half_cp), lambda: fsdp.shard(late), lambda: fsdp.shard(MixedDevices()),
                 lambda: fsdp.shard(two, units=[nn.Linear, 3]),  # (not a class: it was ignored)
                 # a ShardedModule sharded again (world 1 took it, and stage 2 then trained nothing)
                 lambda: fsdp.shard(fsdp.shard(nn.Sequential(nn.Linear(2, 2)), dist.new_group([0])
                                               if dist.get_world_size() == 1 else None))):
        try:
            with no_communication():  # refused before any collective, not after one every rank ran
                make()
        except (ValueError, TypeError) as exc:
            said.append(str(exc))
    assert [(p, p.data_ptr(), p.dtype) for p in late.parameters()] == before, "a refused shard() changed the model"
    total = torch.ones(1)
    dist.all_reduce(total)
    return said, int(total)


def test_units_that_cannot_be_built_are_refused(rank_pool):
    for said, total in rank_pool(2).run(_bad_units_on_rank):
        assert len(said) == 7 and total == 2, said
        assert said[5] == "units=[<class 'torch.nn.modules.linear.Linear'>, 3]: 3 is neither a module class nor a class name"
        assert said[6].startswith("fsdp.shard: ShardedModule already holds a ShardedModule at '<model>'"), said[6]
        assert said[0].startswith("unit 'a': parameters must share one device and dtype, got devices ['cpu'] and "
                                  "dtypes ['torch.float32', 'torch.float64']"), said[0]
        assert said[1] == "units='Block': no submodule of Sequential matches"
        assert said[2] == ("unit '0': some parameters carry a context_parallel_group and some do not (or different "
                           "ones); tag every parameter of a context-parallel model alike")
        assert said[3].startswith("unit '1': parameters must share one device and dtype"), said[3]
        assert said[4] == ("unit 'a': parameters must share one device and dtype, got devices ['cpu', 'meta'] and "
                           "dtypes ['torch.float32']"), said[4]


def test_shard_refuses_a_bad_group_and_names_itself_without_a_process_group(monkeypatch):
    """shard() resolves its group before building anything (a rank number is refused by name), and
    before any process group exists says that fsdp.shard needs one."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(TypeError, match=r"group=3: expected a torch.distributed ProcessGroup or None"):
        fsdp.shard(nn.Linear(2, 2), group=3)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(RuntimeError, match=r"^fsdp.shard needs an initialised process group"):
        fsdp.shard(nn.Linear(2, 2))
