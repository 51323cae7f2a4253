"""Can the GPUs of a group read, write and atomically update each other's memory?

``symm``/``fused`` load peers' chunks, store tiles into peers' buffers and add to peers' counters
from many thread blocks at once. Over NVLink those are native; over PCIe, peer access may be
missing, or present without native atomics, and then counts can be lost: a wait that times out,
or worse. Sitting on one host is not enough, so the ranks' GPUs are checked pairwise with NVML
(by UUID, so each process's CUDA_VISIBLE_DEVICES does not matter). Each rank lists the failing pairs
of its host and the ranks exchange the lists, so all decide alike. Where NVML cannot answer (no
driver library, a UUID NVML does not list, MIG) there is no verdict: nothing fails.
"""
from __future__ import annotations

import contextlib

# what each access pattern of the kernels needs: loads, stores, and the counters' atomic adds
_CAPABILITIES = (("READ", "read"), ("WRITE", "write"), ("ATOMICS", "atomics"))


def uuid_key(uuid) -> str:
    """torch prints 'xxxxxxxx-...', NVML 'GPU-xxxxxxxx-...'."""
    text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
    return text.lower().removeprefix("gpu-")


def _status_name(nvml, status: int) -> str:
    names = [n for n in dir(nvml) if n.startswith("NVML_P2P_STATUS_") and getattr(nvml, n) == status]
    return names[0].removeprefix("NVML_P2P_STATUS_") if names else str(status)


def failing_pairs(nvml=None) -> dict:
    """``{(uuid_a, uuid_b): what is missing}`` over every pair of GPUs NVML lists on this host
    (UUIDs as ``uuid_key`` writes them, a < b), empty when every pair has peer read, write and
    native atomics, or when NVML cannot tell. Local: ranks exchange it, so that every rank decides
    from the same answers (NVML may answer on one rank and not on another)."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return {}
    try:
        nvml.nvmlInit()
    except Exception:  # no driver library here: no verdict
        return {}
    try:
        handles = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            handles[uuid_key(nvml.nvmlDeviceGetUUID(handle))] = handle
        ok, failing = nvml.NVML_P2P_STATUS_OK, {}
        uuids = sorted(handles)
        for i, a in enumerate(uuids):
            for b in uuids[i + 1:]:
                for index_name, what in _CAPABILITIES:
                    status = nvml.nvmlDeviceGetP2PStatus(handles[a], handles[b],
                                                         getattr(nvml, f"NVML_P2P_CAPS_INDEX_{index_name}"))
                    if status != ok:
                        failing[(a, b)] = f"no peer-to-peer {what} (NVML: {_status_name(nvml, status)})"
                        break
        return failing
    except Exception:  # a query this driver does not support: no verdict
        return {}
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def peer_access_problem(uuids, failing_by_rank) -> str | None:
    """Why the GPUs ``uuids`` (one per rank, repeats allowed: ranks sharing a GPU) cannot serve
    peer memory, from every rank's ``failing_pairs()``; None when no rank knows of a failing pair
    among them. The same inputs on every rank give every rank the same answer."""
    distinct = sorted({uuid_key(u) for u in uuids})
    failing = {}
    for pairs in failing_by_rank:
        failing.update(pairs)
    for i, a in enumerate(distinct):
        for b in distinct[i + 1:]:
            if (a, b) in failing:
                return (f"GPUs {a} and {b} have {failing[(a, b)]}; symm/fused need GPUs linked by NVLink (or PCIe "
                        "P2P with native atomics)")
    return None
