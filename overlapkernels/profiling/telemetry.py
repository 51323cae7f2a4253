"""NVML telemetry during a benchmark: SM clock, power, temperature and NVLink throughput.

A sampler thread polls NVML every ``interval_s`` while the context is open; ``summary()`` gives
one row's worth of columns. Every query is optional (NVML answers differ by GPU and driver);
without NVML or a GPU the columns are empty strings, never made-up numbers.
"""
from __future__ import annotations

import contextlib
import threading
import time

COLUMNS = ("sm_clock_mhz", "power_w", "temp_c", "nvlink_tx_gbps", "nvlink_rx_gbps")


# nvml.h: a field's scopeId of UINT_MAX sums it over every NVLink (the default, 0, reads link 0 only)
ALL_LINKS = 0xFFFFFFFF


class Telemetry:
    def __init__(self, device_index: int = 0, *, uuid: str | None = None, interval_s: float = 0.05, nvml=None):
        """``uuid`` (torch's ``get_device_properties(i).uuid``): the GPU to sample, found by UUID,
        since NVML numbers GPUs its own way, whatever CUDA_VISIBLE_DEVICES says (a rank on cuda:0
        with CUDA_VISIBLE_DEVICES=3 is NVML's GPU 3); ``device_index``, NVML's index, without it."""
        self.device_index, self.uuid, self.interval_s, self._nvml = device_index, uuid, interval_s, nvml
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = None
        self._handle = None

    def __enter__(self) -> "Telemetry":
        nvml = self._nvml
        try:
            if nvml is None:
                import pynvml as nvml
            nvml.nvmlInit()
        except Exception:  # no NVML or driver: empty columns
            return self
        try:
            from ..comm.peer_access import uuid_key  # torch's 'xxxxxxxx-...', NVML's 'GPU-xxxxxxxx-...'

            self._handle = (nvml.nvmlDeviceGetHandleByUUID(("GPU-" + uuid_key(self.uuid)).encode())
                            if self.uuid is not None else nvml.nvmlDeviceGetHandleByIndex(self.device_index))
            self._nvml = nvml
        except Exception:  # a GPU NVML does not list (MIG, a stale UUID): empty columns, not another GPU's
            self._handle = None
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()  # (nvmlInit counts: each init needs its shutdown)
            return self
        self._thread = threading.Thread(target=self._run, name="ok-telemetry", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._sample()  # one at the end, so short runs still get a reading
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass

    def _query(self, fn, *args):
        try:
            return fn(*args)
        except Exception:
            return None

    def _nvlink_kib(self):
        nvml = self._nvml
        tx, rx = (getattr(nvml, name, None) for name in ("NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
                                                         "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX"))
        if tx is None or rx is None:
            return None
        values = self._query(nvml.nvmlDeviceGetFieldValues, self._handle, [(tx, ALL_LINKS), (rx, ALL_LINKS)])
        if not values or any(getattr(v, "nvmlReturn", 1) != 0 for v in values):
            return None
        return tuple(int(v.value.ullVal) for v in values)  # cumulative KiB

    def _sample(self) -> None:
        nvml, h = self._nvml, self._handle
        power = self._query(nvml.nvmlDeviceGetPowerUsage, h)
        self.samples.append({
            "t": time.perf_counter(),
            "sm_clock_mhz": self._query(nvml.nvmlDeviceGetClockInfo, h, getattr(nvml, "NVML_CLOCK_SM", 1)),
            "power_w": power / 1000.0 if power is not None else None,
            "temp_c": self._query(nvml.nvmlDeviceGetTemperature, h, getattr(nvml, "NVML_TEMPERATURE_GPU", 0)),
            "nvlink_kib": self._nvlink_kib()})

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def summary(self) -> dict:
        """Mean SM clock and power, max temperature, NVLink TX/RX GB/s over the sampled span."""
        def values(key):
            return [s[key] for s in self.samples if s.get(key) is not None]

        out = dict.fromkeys(COLUMNS)  # None where NVML offers nothing: JSON null, an empty CSV cell
        for key, agg in (("sm_clock_mhz", lambda v: sum(v) / len(v)), ("power_w", lambda v: sum(v) / len(v)),
                         ("temp_c", max)):
            if values(key):
                out[key] = round(agg(values(key)), 1)
        links = [(s["t"], s["nvlink_kib"]) for s in self.samples if s.get("nvlink_kib")]
        if len(links) >= 2 and links[-1][0] > links[0][0]:
            span_s = links[-1][0] - links[0][0]
            for i, key in enumerate(("nvlink_tx_gbps", "nvlink_rx_gbps")):
                counts = [kib[i] for _, kib in links]
                if all(b >= a for a, b in zip(counts, counts[1:])):  # a counter reset: no rate, not a negative one
                    out[key] = round((counts[-1] - counts[0]) * 1024 / span_s / 1e9, 3)
        return out
