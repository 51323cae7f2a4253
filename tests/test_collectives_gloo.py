"""The raw collectives (comm.collectives) on 3 gloo ranks, exactly: every rank's chunk in its place,
the async forms handing back a work to wait on, the coalesced all-reduce keeping each tensor's
values apart, and the agreement to refuse (refuse_together) confined to its group, naming the
lowest refusing rank of that group and the reasons' types."""
import torch
import torch.distributed as dist


def _strided(x):
    return x.t().contiguous().t()  # the same values, column-major: a q cut from a packed qkv


def _raw_collectives_on_rank(async_op):
    from nccl_like import nccl_rules
    from overlapkernels.comm import collectives as C

    r, w = dist.get_rank(), dist.get_world_size()
    want, got, works = {}, {}, []
    mine = lambda q: torch.arange(2 * w * 2, dtype=torch.float64).reshape(2 * w, 2) + 100 * q  # noqa: E731
    calls = {  # strided inputs (but all_reduce's, reduced in place): handed to the wire contiguous, as NCCL needs
        "all_gather": (lambda: C.all_gather(_strided(mine(r))[:2], async_op=async_op),
                       torch.cat([mine(q)[:2] for q in range(w)])),
        "reduce_scatter": (lambda: C.reduce_scatter(_strided(mine(r)), async_op=async_op),
                           sum(mine(q).chunk(w)[r] for q in range(w))),
        "all_reduce": (lambda: C.all_reduce(mine(r), async_op=async_op), sum(mine(q) for q in range(w))),
        "all_to_all": (lambda: C.all_to_all(_strided(mine(r)), async_op=async_op),
                       torch.cat([mine(q).chunk(w)[r] for q in range(w)])),
    }
    with nccl_rules():
        for op, (call, expected) in calls.items():
            out, work = call()
            works.append(work is not None)
            if work is not None:
                work.wait()
            got[op], want[op] = out, expected
    return works, {op: torch.equal(got[op], want[op]) for op in calls}


def test_raw_collectives_put_every_chunk_in_its_place_and_hand_back_their_work(rank_pool):
    """The async forms return the work (an overlap waits on it later): a collective run
    synchronously instead, with None handed back, serialised what the caller meant to overlap."""
    every = {op: True for op in ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")}
    for async_op in (False, True):
        assert rank_pool(3).run(_raw_collectives_on_rank, async_op) == [([async_op] * 4, every)] * 3


def _coalesced_on_rank():
    from overlapkernels.comm.collectives import all_reduce_coalesced

    r = dist.get_rank()
    pair, alone = dist.new_group([0, 2]), dist.new_group([1])
    members = [0, 2] if r in (0, 2) else [1]
    base = torch.zeros(3, 4)

    def tensors(q):
        return [torch.arange(6.0).reshape(2, 3) + q, torch.tensor([2 ** 40 + q, -q], dtype=torch.int64),
                torch.tensor(1.5 * q), torch.full((5,), float(10 * q)), torch.arange(4, dtype=torch.int64) * q]

    mine = tensors(r)
    strided = base.t()[1:3]  # [2, 3] with strides (1, 4): a view into base, written back in place
    strided.copy_(torch.arange(6.0).reshape(2, 3) * (r + 1))
    all_reduce_coalesced(mine + [strided], pair if r in (0, 2) else alone)  # within the group only
    want = [sum(t[i] for t in map(tensors, members)) for i in range(len(mine))]
    strided_want = torch.arange(6.0).reshape(2, 3) * sum(q + 1 for q in members)
    return ([torch.equal(got, exp) and got.dtype == exp.dtype for got, exp in zip(mine, want)]
            + [torch.equal(base.t()[1:3], strided_want)])


def test_coalesced_all_reduce_sums_each_tensor_in_place_within_its_group(rank_pool):
    """Several tensors share a dtype's buffer: each must get back its own slice of the sum (in
    place, a strided view included), not its neighbour's; and only over the group's ranks."""
    assert rank_pool(3).run(_coalesced_on_rank) == [[True] * 6] * 3


def _objects_in_a_subgroup_on_rank():
    from overlapkernels.comm.collectives import all_gather_objects

    r = dist.get_rank()
    pair, alone = dist.new_group([0, 2]), dist.new_group([1])
    return all_gather_objects(("from", r), pair if r in (0, 2) else alone)


def test_objects_are_gathered_within_the_group_in_its_rank_order(rank_pool):
    assert rank_pool(3).run(_objects_in_a_subgroup_on_rank) == [[("from", 0), ("from", 2)], [("from", 1)],
                                                                 [("from", 0), ("from", 2)]]


class Stopped(ValueError):
    """A caller's own ``elsewhere`` class."""


def _refusals_on_rank():
    from overlapkernels.comm.collectives import refuse_together

    r = dist.get_rank()
    said = []

    def agree(error, group, **kwargs):
        try:
            refuse_together(error, group, "audit", torch.device("cpu"), **kwargs)
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            return type(exc).__name__, str(exc)
        return "went on"

    pair, alone = dist.new_group([0, 2]), dist.new_group([1])
    # group {0, 2}: its rank 1 (global rank 2) refuses; group {1}: nobody does, and it goes on
    error = KeyError("bad stage") if r == 2 else None
    said.append(agree(error, pair if r in (0, 2) else alone, elsewhere=Stopped, verb="gave up"))
    # the world: ranks 1 and 2 refuse, each its own reason; rank 0 hears of the lowest
    error = {1: ValueError("one"), 2: RuntimeError("two")}.get(r)
    said.append(agree(error, dist.group.WORLD))
    said.append(agree(None, dist.group.WORLD))  # and the group is usable after
    return said


def test_a_refusal_stops_every_rank_of_its_group_only(rank_pool):
    results = rank_pool(3).run(_refusals_on_rank)
    world_said = "audit: rank 1 of the group (and ranks [2]) refused, so this rank stops too: ValueError: one"
    assert results[0] == [("Stopped", "audit: rank 1 of the group gave up, so this rank stops too: KeyError: "
                                      "'bad stage'"), ("RefusedElsewhere", world_said), "went on"]
    assert results[1] == ["went on", ("ValueError", "one"), "went on"]
    assert results[2] == [("KeyError", "'bad stage'"), ("RuntimeError", "two"), "went on"]
