"""What this machine has: versions, process-group backends, and GPUs as NVML describes them.

Uses nvidia-ml-py (``pynvml``); every NVML query is optional, since what NVML answers differs by
GPU, driver and permissions. Without a GPU or driver it says so instead of failing.
"""
from __future__ import annotations

import os
import platform
import sys

# NVML topology levels (nvmlGpuTopologyLevel_t) as `nvidia-smi topo -m` prints them
_TOPOLOGY = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def _try(fn, *args, default=None):
    try:
        return fn(*args)
    except Exception:  # NVML raises NVMLError_NotSupported / NoPermission / ... per query
        return default


def _text(value):
    return value.decode() if isinstance(value, bytes) else value


def _nvlink(nvml, handle) -> dict:
    """Active links, NVLink version and per-link speed where NVML reports them."""
    max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
    active, versions, remote_bus_ids = 0, set(), []
    for link in range(max_links):
        state = _try(nvml.nvmlDeviceGetNvLinkState, handle, link)
        if state is None:
            continue
        if state == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
            active += 1
            version = _try(nvml.nvmlDeviceGetNvLinkVersion, handle, link)
            if version is not None:
                versions.add(version)
            remote = _try(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            if remote is not None:
                remote_bus_ids.append(_text(remote.busId).lower())
    speed_mbps = None
    field = getattr(nvml, "NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON", None)
    if active and field is not None:
        values = _try(nvml.nvmlDeviceGetFieldValues, handle, [field])
        if values and getattr(values[0], "nvmlReturn", 1) == 0:
            speed_mbps = int(values[0].value.uiVal)
    return {"active_links": active, "versions": sorted(versions), "link_speed_mbps": speed_mbps,
            "remote_bus_ids": remote_bus_ids}


def gpu_inventory(nvml=None) -> dict:
    """GPUs, driver and GPU-to-GPU topology via NVML; ``{"available": False, "reason": ...}``
    when there is no NVML, driver or GPU. ``nvml`` defaults to the ``pynvml`` module."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return {"available": False, "reason": "nvidia-ml-py (pynvml) is not installed", "gpus": []}
    try:
        nvml.nvmlInit()
    except Exception as exc:
        return {"available": False, "reason": f"no NVIDIA driver/GPU visible to NVML ({exc})", "gpus": []}
    try:
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        gpus = []
        for i, h in enumerate(handles):
            mem = _try(nvml.nvmlDeviceGetMemoryInfo, h)
            pci = _try(nvml.nvmlDeviceGetPciInfo, h)
            gpus.append({
                "index": i, "name": _text(_try(nvml.nvmlDeviceGetName, h, default="?")),
                "memory_bytes": int(mem.total) if mem is not None else None,
                "sm_clock_max_mhz": _try(nvml.nvmlDeviceGetMaxClockInfo, h, getattr(nvml, "NVML_CLOCK_SM", 1)),
                "mem_clock_max_mhz": _try(nvml.nvmlDeviceGetMaxClockInfo, h, getattr(nvml, "NVML_CLOCK_MEM", 2)),
                "pci_bus_id": _text(pci.busId).lower() if pci is not None else None,
                "nvlink": _nvlink(nvml, h),
            })
        return {"available": count > 0, "reason": "" if count else "NVML sees no GPU",
                "driver": _text(_try(nvml.nvmlSystemGetDriverVersion, default="")),
                "cuda_driver": _try(nvml.nvmlSystemGetCudaDriverVersion), "gpus": gpus,
                "topology": _topology(nvml, handles, gpus)}
    finally:
        _try(nvml.nvmlShutdown)


def _topology(nvml, handles, gpus) -> list[list[str]]:
    """``nvidia-smi topo -m`` style matrix: NV<links> over NVLink, else the PCIe/socket level."""
    matrix = []
    for i, hi in enumerate(handles):
        row = []
        for j, hj in enumerate(handles):
            if i == j:
                row.append("X")
                continue
            links = gpus[i]["nvlink"]["remote_bus_ids"].count(gpus[j]["pci_bus_id"])
            if links:
                row.append(f"NV{links}")
                continue
            level = _try(nvml.nvmlDeviceGetTopologyCommonAncestor, hi, hj)
            row.append(_TOPOLOGY.get(level, "?"))
        matrix.append(row)
    return matrix


def software_inventory() -> dict:
    import torch
    import torch.distributed as dist

    from ..kernels import cuda as cuda_lib

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is an install requirement
        triton_version = None
    backends = {name: bool(_try(getattr(dist, f"is_{name}_available", lambda: False), default=False))
                for name in ("gloo", "nccl", "mpi", "ucc", "xccl")}
    return {
        "python": platform.python_version(), "platform": platform.platform(), "executable": sys.executable,
        "torch": torch.__version__, "triton": triton_version, "cuda_runtime": torch.version.cuda,
        "cuda_available": torch.cuda.is_available(), "backends": backends,
        "cuda_library": {"built": cuda_lib.is_built(), "path": str(cuda_lib.library_path())},
        "settings": settings(),
    }


# Set by other projects' recipes and able to change how our streams overlap: Megatron and
# TransformerEngine ask for CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware queue for all streams, so
# the GPU may serialise work queued behind a cross-stream wait). Not yet measured by this project
# on a GPU; recorded so a result taken under it says so.
FOREIGN_SETTINGS = ("CUDA_DEVICE_MAX_CONNECTIONS",)


def settings() -> dict:
    """The ``OVERLAPKERNELS_*`` environment variables set in this process (the rest keep defaults):
    they change what ops run (auto mode, peer memory, SM reserve, timeouts), so runs record them;
    likewise the other projects' settings in ``FOREIGN_SETTINGS``."""
    return {k: v for k, v in sorted(os.environ.items()) if k.startswith("OVERLAPKERNELS_") or k in FOREIGN_SETTINGS}


def inventory(nvml=None) -> dict:
    return {"software": software_inventory(), "gpu": gpu_inventory(nvml)}


def format_inventory(info: dict) -> str:
    sw, gpu = info["software"], info["gpu"]
    lines = [f"python        {sw['python']} ({sw['platform']})",
             f"torch         {sw['torch']} (CUDA runtime {sw['cuda_runtime'] or 'none'}; "
             f"cuda available: {sw['cuda_available']})",
             f"triton        {sw['triton']}",
             "backends      " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in sw["backends"].items()),
             f"cuda library  {'built' if sw['cuda_library']['built'] else 'not built (make cuda)'}: "
             f"{sw['cuda_library']['path']}",
             "settings      " + (" ".join(f"{k}={v}" for k, v in sw["settings"].items()) or "defaults")]
    if not gpu["available"]:
        lines.append(f"GPU           none: {gpu['reason']}")
        return "\n".join(lines)
    lines.append(f"driver        {gpu['driver']} (CUDA driver API {gpu['cuda_driver']})")
    for g in gpu["gpus"]:
        mem = f"{g['memory_bytes'] / 2**30:.0f} GiB" if g["memory_bytes"] else "?"
        nv = g["nvlink"]
        link = (f"NVLink {nv['active_links']} links v{'/'.join(map(str, nv['versions'])) or '?'}"
                + (f" @ {nv['link_speed_mbps'] / 1000:.1f} GB/s per link" if nv["link_speed_mbps"] else "")
                if nv["active_links"] else "no active NVLink")
        lines.append(f"GPU {g['index']}         {g['name']}, {mem}, SM max {g['sm_clock_max_mhz']} MHz, {link}")
    if len(gpu["gpus"]) > 1:
        lines.append("topology      " + "  ".join(f"GPU{i}".rjust(5) for i in range(len(gpu["gpus"]))))
        for i, row in enumerate(gpu["topology"]):
            lines.append(f"  GPU{i}".ljust(14) + "  ".join(cell.rjust(5) for cell in row))
    return "\n".join(lines)
