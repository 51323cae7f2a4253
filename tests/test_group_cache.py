"""group_cache without torch's private group registry: where ``_world.pg_map`` moved (another torch),
a destroyed group's name handed out again is what empties the caches of it."""
import torch.distributed as dist


def test_a_returning_group_name_alone_empties_the_caches_of_the_old_group(monkeypatch):
    from overlapkernels.comm import group_cache

    assert not dist.is_initialized()
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(group_cache, "_registered", lambda: None)  # torch's registry out of reach
    plain, kept = group_cache.per_group_cache(), group_cache.per_group_cache(keep_values_alive=True)
    keys, values = [], []
    for _ in range(2):
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            keys.append(group_cache.group_key(dist.group.WORLD))
            values.append(object())
            plain[("op", keys[-1])] = kept[(keys[-1], "cpu")] = values[-1]
        finally:
            dist.destroy_process_group()
    assert keys[0][0] == keys[1][0] and keys[0] != keys[1]  # the premise: the name came back
    assert plain == {("op", keys[1]): values[1]} and kept == {(keys[1], "cpu"): values[1]}
    assert any(v is values[0] for v in group_cache.retired()) and not any(v is values[1] for v in group_cache.retired())
    plain.clear(), kept.clear()
