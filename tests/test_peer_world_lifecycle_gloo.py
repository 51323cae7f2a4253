"""The CUDA process peer world's life on gloo ranks (peer memory faked where it needs CUDA): caches
per group that do not outlive the group, and a rank that cannot join failing every rank."""
import torch
import torch.distributed as dist


def test_caches_per_group_do_not_outlive_their_group(monkeypatch):
    """torch names groups "0", "1", ... again after destroy_process_group and a new init: a cache keyed
    by name gave the new world the old one's peer-memory answer (and symmetric buffers, and measured
    choices). One process, two worlds in turn, peer memory able in the first only."""
    from overlapkernels.comm import group_cache, process_world as pw
    from overlapkernels.comm.group_cache import group_key
    from overlapkernels.ops import measure

    assert not dist.is_initialized()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    answers, names, measured, keys, worlds = [], [], [], [], []
    for able in (True, False):
        monkeypatch.setattr(pw, "peer_memory_unavailable_reason", lambda device, able=able: None if able else "none")
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            names.append(dist.group.WORLD.group_name)
            keys.append((dist.group.WORLD.group_name, id(dist.group.WORLD)))
            answers.append(pw.group_has_peer_memory(dist.group.WORLD, torch.device("cpu")))
            calls = []
            measure.measured("op", ("shape",), dist.group.WORLD, torch.device("cpu"), calls.append)
            measured.append(len(calls))
            worlds.append(object())  # a process world's place: it holds symmetric memory
            pw._worlds[(group_key(dist.group.WORLD), torch.device("cpu"), "auto")] = worlds[-1]
        finally:
            dist.destroy_process_group()
    assert names[0] == names[1]  # the premise: the name comes back
    assert answers == [True, False]
    assert measured[0] == measured[1] > 0  # the second world is measured afresh, not served the first's choice
    # and the first world's entries are gone (with whatever buffers they held), the second's kept
    for cache in (pw._group_peer_memory, measure._cache):
        held = [key for key in cache if any(part in keys for part in key)]
        assert held and all(keys[0] not in key for key in held), held
    # but the first world itself is kept referenced (its symmetric memory is never freed: torch's
    # rendezvous per block and group name could hand its peer mappings to the name's next group)
    assert worlds[0] not in pw._worlds.values() and worlds[1] in pw._worlds.values()
    assert any(w is worlds[0] for w in group_cache._retired)
    for key in [key for key, value in pw._worlds.items() if value is worlds[1]]:
        del pw._worlds[key]  # (a stand-in: no later test may find it)
    # a destroyed subgroup whose name never comes back goes when the next new group is keyed
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sub = dist.new_group([0])
        measure.measured("op", ("shape",), sub, torch.device("cpu"), lambda method: None)
        sub_key = group_key(sub)
        assert any(sub_key in key for key in measure._cache)
        dist.destroy_process_group(sub)
        other = dist.new_group([0])
        assert other.group_name != sub_key[0]
        group_key(other)
        assert not any(sub_key in key for key in measure._cache)
    finally:
        dist.destroy_process_group()


def _one_rank_without_peer_memory_on_rank():
    from overlapkernels.comm import process_world as pw

    r = dist.get_rank()
    saved = pw.resolve_peer_memory, pw._device_uuid, pw.failing_pairs
    pw.resolve_peer_memory = lambda *a, **k: ("ipc", None) if r == 0 else (None, "no CUDA library built here")
    pw._device_uuid, pw.failing_pairs = (lambda device: f"gpu{r}"), (lambda: {})
    try:
        pw.ProcessPeerWorld(dist.group.WORLD, torch.device("cpu"))
    except ValueError as exc:
        return str(exc)
    finally:
        pw.resolve_peer_memory, pw._device_uuid, pw.failing_pairs = saved
    return "built"


def test_a_rank_that_cannot_join_the_peer_world_fails_every_rank(rank_pool):
    """Rank 1 has no peer memory of its own (here: no CUDA library): it raised alone while rank 0
    waited for it in the world's exchange. Now both raise, naming it."""
    assert rank_pool(2).run(_one_rank_without_peer_memory_on_rank) == ["rank 1: no CUDA library built here"] * 2
