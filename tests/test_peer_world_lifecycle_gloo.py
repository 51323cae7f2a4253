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


def test_a_peer_memory_setting_changed_between_calls_gets_its_own_answer_and_world(monkeypatch):
    """OVERLAPKERNELS_PEER_MEMORY is read at every call: set to ipc where only symmetric memory
    serves, the group's cached 'yes' (and its symm_mem world) must not answer for it."""
    from overlapkernels.comm import process_world as pw

    assert not dist.is_initialized()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(pw, "peer_memory_unavailable_reason",
                        lambda device: "no CUDA library built here" if pw.requested_peer_memory() == "ipc" else None)
    monkeypatch.setattr(pw, "resolve_peer_memory", lambda requested, **kw: (requested, None))
    monkeypatch.setattr(pw, "failing_pairs", lambda: {})
    cpu, answers, worlds = torch.device("cpu"), [], []
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for setting in ("symm_mem", "ipc", "symm_mem"):
            monkeypatch.setenv(pw.PEER_MEMORY_ENV, setting)
            answers.append(pw.group_has_peer_memory(dist.group.WORLD, cpu))
            worlds.append(pw.process_peer_world(dist.group.WORLD, cpu))
        assert answers == [True, False, True]
        assert [w.peer_memory for w in worlds] == ["symm_mem", "ipc", "symm_mem"] and worlds[2] is worlds[0]
    finally:
        for key in [key for key, value in pw._worlds.items() if any(value is w for w in worlds)]:
            del pw._worlds[key]  # (stand-ins: no later test may find them)
        dist.destroy_process_group()


def _peer_world_agreement_on_rank(cases):
    """A ProcessPeerWorld built (on CPU, peer memory faked) for each case of per-rank (kind, GPU,
    host, failing pairs): what each rank got, its kind and ranks per GPU, or the error it raised."""
    from overlapkernels.comm import process_world as pw

    r, got = dist.get_rank(), []
    saved = pw.resolve_peer_memory, pw._device_uuid, pw.host_identity, pw.failing_pairs
    try:
        for kinds, uuids, hosts, pairs in cases:
            pw.resolve_peer_memory = lambda *a, kinds=kinds, **k: (kinds[r], None)
            pw._device_uuid = lambda device, uuids=uuids: uuids[r]
            pw.host_identity = lambda hosts=hosts: hosts[r]
            pw.failing_pairs = lambda pairs=pairs: pairs[r]
            try:
                world = pw.ProcessPeerWorld(dist.group.WORLD, torch.device("cpu"))
                got.append((world.peer_memory, world.ranks_per_device))
            except ValueError as exc:
                got.append(str(exc))
    finally:
        pw.resolve_peer_memory, pw._device_uuid, pw.host_identity, pw.failing_pairs = saved
    return got


def test_the_ranks_of_a_peer_world_agree_on_what_every_rank_found(rank_pool):
    """Each rank decides from every rank's report: ranks sharing a GPU (each persistent GEMM takes its
    share of the SMs), kinds of peer memory that differ (alloc_symmetric would deadlock), two hosts,
    and a failing GPU pair that only one rank's NVML could name - every rank raises alike."""
    ipc, same, both = ["ipc", "ipc"], ["h", "h"], [{}, {}]
    no_atomics = {("gpu0", "gpu1"): "no peer-to-peer atomics (NVML: NOT_SUPPORTED)"}
    cases = [(ipc, ["gpu0", "gpu0"], same, both), (ipc, ["gpu0", "gpu1"], same, both),
             (["ipc", "symm_mem"], ["gpu0", "gpu1"], same, both), (ipc, ["gpu0", "gpu1"], ["node0", "node1"], both),
             (ipc, ["gpu0", "gpu1"], same, [{}, no_atomics])]
    for got in rank_pool(2).run(_peer_world_agreement_on_rank, cases):
        assert got[:2] == [("ipc", 2), ("ipc", 1)], got
        for said, want in zip(got[2:], ["ranks chose different peer memory ['ipc', 'symm_mem'] (set",
                                        "peer memory ('symm'/'fused') needs the group on one node; its ranks are on "
                                        "['node0', 'node1']",
                                        "peer memory ('symm'/'fused'): GPUs gpu0 and gpu1 have no peer-to-peer atomics"],
                              strict=True):
            assert isinstance(said, str) and said.startswith(want), (said, want)
