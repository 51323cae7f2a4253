"""`overlapkernels info`: exits 0 without a GPU; the NVML path checked against a fake NVML."""
import json
import os
import subprocess
import sys
from types import SimpleNamespace

from overlapkernels.profiling.inventory import format_inventory, gpu_inventory, inventory


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "overlapkernels", *args], capture_output=True, text=True, timeout=120)


def test_info_without_gpu_exits_zero():
    out = _cli("info")
    assert out.returncode == 0, out.stderr
    assert "torch" in out.stdout and "triton" in out.stdout and "gloo=yes" in out.stdout
    assert "cuda library" in out.stdout
    if "GPU           none" not in out.stdout:  # on a GPU machine the GPU lines are there instead
        assert "GPU 0" in out.stdout
    data = json.loads(_cli("info", "--json").stdout)
    assert data["software"]["backends"]["gloo"] is True
    assert isinstance(data["gpu"]["available"], bool)


def test_info_under_torchrun_reports_once_per_node():
    """The inventory is the node's: local rank 0 prints it, the other ranks nothing."""
    launched = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    out = subprocess.run([sys.executable, "-m", "overlapkernels", "info"], env=launched, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout == "", (out.stdout, out.stderr)


def test_info_under_a_launcher_reports_on_each_nodes_first_rank(monkeypatch, capsys):
    """Local rank 0 of every node prints (its inventory is the node's), not only the world's rank 0."""
    from overlapkernels import cli
    from overlapkernels.profiling import inventory as inv

    monkeypatch.setattr(inv, "inventory", lambda: {"node": "this one"})
    monkeypatch.setattr(inv, "format_inventory", lambda info: f"inventory of {info['node']}")
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    printed = []
    for rank, local in (("4", "0"), ("5", "1"), ("0", "0")):  # node 1's first rank, its second, node 0's first
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "8")
        monkeypatch.setenv("LOCAL_RANK", local)
        assert cli.main(["info"]) == 0
        printed.append(capsys.readouterr().out)
    assert printed == ["inventory of this one\n", "", "inventory of this one\n"]


def test_settings_in_effect_are_recorded(monkeypatch):
    """OVERLAPKERNELS_* change what runs (auto mode, SM reserve, ...): info and every bench row say so."""
    from overlapkernels.bench.report import environment
    from overlapkernels.profiling.inventory import settings

    for key in [k for k in os.environ if k.startswith("OVERLAPKERNELS_") or k == "CUDA_DEVICE_MAX_CONNECTIONS"]:
        monkeypatch.delenv(key)
    assert settings() == {} and environment("cpu")["settings"] == ""
    assert "settings      defaults" in format_inventory(inventory())
    monkeypatch.setenv("OVERLAPKERNELS_RESERVED_SMS", "16")
    monkeypatch.setenv("OVERLAPKERNELS_AUTO", "measure")
    monkeypatch.setenv("OTHER_AUTO", "x")
    assert settings() == {"OVERLAPKERNELS_AUTO": "measure", "OVERLAPKERNELS_RESERVED_SMS": "16"}
    assert environment("cpu")["settings"] == "OVERLAPKERNELS_AUTO=measure OVERLAPKERNELS_RESERVED_SMS=16"
    assert "settings      OVERLAPKERNELS_AUTO=measure OVERLAPKERNELS_RESERVED_SMS=16" in format_inventory(inventory())
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # Megatron's recipe: changes how streams overlap
    assert environment("cpu")["settings"] == ("CUDA_DEVICE_MAX_CONNECTIONS=1 OVERLAPKERNELS_AUTO=measure "
                                              "OVERLAPKERNELS_RESERVED_SMS=16")


class FakeNVML:
    """Two H200s joined by 18 NVLink-4 links, one GPU reachable over PCIe only; queries a real
    NVML may refuse (field values on GPU 2) raise NotSupported."""
    NVML_NVLINK_MAX_LINKS = 18
    NVML_FEATURE_ENABLED = 1
    NVML_CLOCK_SM, NVML_CLOCK_MEM = 1, 2
    NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON = 90
    bus = ["00000000:18:00.0", "00000000:2A:00.0", "00000000:3A:00.0"]

    class NotSupported(Exception):
        pass

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return 3
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetName(self, h): return b"NVIDIA H200" if h < 2 else "NVIDIA L4"
    def nvmlDeviceGetMemoryInfo(self, h): return SimpleNamespace(total=141 * 2**30)
    def nvmlDeviceGetMaxClockInfo(self, h, kind): return 1980 if kind == 1 else 3201
    def nvmlDeviceGetPciInfo(self, h): return SimpleNamespace(busId=self.bus[h].encode())
    def nvmlSystemGetDriverVersion(self): return "580.65"
    def nvmlSystemGetCudaDriverVersion(self): return 13000

    def nvmlDeviceGetNvLinkState(self, h, link):
        if h == 2:
            raise self.NotSupported()
        return 1

    def nvmlDeviceGetNvLinkVersion(self, h, link): return 4
    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link): return SimpleNamespace(busId=self.bus[1 - h])

    def nvmlDeviceGetFieldValues(self, h, fields):
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=53125))]

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b): return 50


def test_gpu_inventory_with_fake_nvml():
    inv = gpu_inventory(FakeNVML())
    assert inv["available"] and inv["driver"] == "580.65" and len(inv["gpus"]) == 3
    h200 = inv["gpus"][0]
    assert h200["name"] == "NVIDIA H200" and h200["memory_bytes"] == 141 * 2**30
    assert h200["nvlink"]["active_links"] == 18 and h200["nvlink"]["versions"] == [4]
    assert h200["nvlink"]["link_speed_mbps"] == 53125
    assert inv["gpus"][2]["nvlink"]["active_links"] == 0
    assert inv["topology"] == [["X", "NV18", "SYS"], ["NV18", "X", "SYS"], ["SYS", "SYS", "X"]]
    text = format_inventory({**inventory(FakeNVML())})
    assert "GPU 0         NVIDIA H200, 141 GiB, SM max 1980 MHz, NVLink 18 links v4 @ 53.1 GB/s per link" in text
    assert "GPU 2         NVIDIA L4, 141 GiB, SM max 1980 MHz, no active NVLink" in text
    assert "\n  GPU1         NV18      X    SYS\n" in text


def test_gpu_inventory_without_driver():
    class NoDriver:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    inv = gpu_inventory(NoDriver())
    assert inv == {"available": False, "reason": "no NVIDIA driver/GPU visible to NVML (NVML Shared Library Not Found)",
                   "gpus": []}
    assert "GPU           none: no NVIDIA driver" in format_inventory(inventory(NoDriver()))


class FakeTelemetryNVML(FakeNVML):
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 138, 139
    NVML_TEMPERATURE_GPU = 0

    def __init__(self):
        self.kib = 0

    def nvmlDeviceGetClockInfo(self, h, kind): return 1980
    def nvmlDeviceGetPowerUsage(self, h): return 650_000  # mW
    def nvmlDeviceGetTemperature(self, h, kind): return 61

    def nvmlDeviceGetFieldValues(self, h, fields):
        self.kib += 1024 * 1024  # 1 GiB more per sample
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(ullVal=self.kib)) for _ in fields]


def test_telemetry_summary_with_fake_nvml():
    from overlapkernels.profiling.telemetry import Telemetry

    with Telemetry(0, interval_s=0.01, nvml=FakeTelemetryNVML()) as tel:
        for _ in range(3):
            tel._sample()  # deterministic samples on top of the thread's
    s = tel.summary()
    assert s["sm_clock_mhz"] == 1980 and s["power_w"] == 650.0 and s["temp_c"] == 61
    assert s["nvlink_tx_gbps"] > 0 and s["nvlink_rx_gbps"] > 0


def test_telemetry_nvlink_rate_is_bytes_over_the_sampled_span(monkeypatch):
    from overlapkernels.profiling import telemetry

    clock = iter([10.0, 12.0, 14.0])  # seconds at each sample
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    tel = telemetry.Telemetry(0, nvml=FakeTelemetryNVML())
    tel._handle = "gpu0"  # what __enter__ sets, without starting its sampler thread
    for _ in range(3):
        tel._sample()  # 1, 2, 3 GiB cumulative
    s = tel.summary()
    assert s["nvlink_tx_gbps"] == s["nvlink_rx_gbps"] == round(2 * 2 ** 30 / 4.0 / 1e9, 3)  # 2 GiB in 4 s


def test_telemetry_sums_nvlink_over_every_link_and_finds_its_gpu_by_uuid():
    """NVLink fields read link 0 alone unless their scope asks for all links (UINT_MAX); the GPU is
    NVML's by UUID, since NVML ignores CUDA_VISIBLE_DEVICES (cuda:0 may be NVML's GPU 3); a UUID
    NVML does not know gives empty columns, not another GPU's, and releases NVML's init."""
    from overlapkernels.profiling.telemetry import ALL_LINKS, Telemetry

    class Fake(FakeTelemetryNVML):
        def __init__(self):
            super().__init__()
            self.fields, self.looked_up, self.shutdowns = [], [], 0

        def nvmlDeviceGetHandleByUUID(self, uuid):
            self.looked_up.append(uuid)
            if uuid != b"GPU-4f1e0c2a-0000-0000-0000-000000000003":
                raise RuntimeError("NVML_ERROR_NOT_FOUND")
            return 3

        def nvmlDeviceGetFieldValues(self, h, fields):
            self.fields.append((h, list(fields)))
            return super().nvmlDeviceGetFieldValues(h, fields)

        def nvmlShutdown(self):
            self.shutdowns += 1

    nvml = Fake()
    with Telemetry(0, uuid="4F1E0C2A-0000-0000-0000-000000000003", nvml=nvml) as tel:
        tel._sample()
    assert nvml.looked_up == [b"GPU-4f1e0c2a-0000-0000-0000-000000000003"] and nvml.shutdowns == 1
    assert nvml.fields[0] == (3, [(138, ALL_LINKS), (139, ALL_LINKS)]) and ALL_LINKS == 2**32 - 1
    nvml = Fake()
    with Telemetry(0, uuid="00000000-0000-0000-0000-000000000000", nvml=nvml) as tel:
        pass
    assert tel.summary() == dict.fromkeys(tel.summary()) and nvml.fields == [] and nvml.shutdowns == 1


def test_telemetry_gives_no_nvlink_rate_across_a_counter_reset(monkeypatch):
    from overlapkernels.profiling import telemetry

    clock = iter([10.0, 12.0, 14.0])
    monkeypatch.setattr(telemetry.time, "perf_counter", lambda: next(clock))
    nvml = FakeTelemetryNVML()
    tel = telemetry.Telemetry(0, nvml=nvml)
    tel._handle = "gpu0"
    tel._sample()
    tel._sample()
    nvml.kib = 0  # the driver reset its counters
    tel._sample()
    s = tel.summary()
    assert s["nvlink_tx_gbps"] is s["nvlink_rx_gbps"] is None and s["power_w"] == 650.0


def test_telemetry_summary_averages_clock_and_power_and_takes_the_hottest_reading():
    from overlapkernels.profiling.telemetry import Telemetry

    tel = Telemetry(nvml=object())
    tel.samples = [{"t": 0.0, "sm_clock_mhz": 1000, "power_w": 100.0, "temp_c": 50, "nvlink_kib": None},
                   {"t": 1.0, "sm_clock_mhz": 2000, "power_w": 300.0, "temp_c": 71, "nvlink_kib": None}]
    s = tel.summary()
    assert (s["sm_clock_mhz"], s["power_w"], s["temp_c"]) == (1500.0, 200.0, 71)


def test_telemetry_without_nvml_leaves_columns_empty():
    from overlapkernels.profiling.telemetry import COLUMNS, Telemetry

    class NoDriver:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    with Telemetry(nvml=NoDriver()) as tel:
        pass
    assert tel.summary() == dict.fromkeys(COLUMNS)


def test_gpu_check_script_refuses_a_machine_without_gpu(tmp_path):
    """scripts/gpu_check.sh (make gpu-check) parses, and on a CPU machine stops at once with a
    clear message instead of failing step after step."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PY": sys.executable, "OUT": str(tmp_path)})
    assert out.returncode == 2, out.stdout + out.stderr
    assert "gpu-check: no CUDA GPU visible" in out.stderr


def test_gpu_check_script_runs_every_step_and_reports_failures(tmp_path):
    """With a stand-in python that 'has' a GPU (and nvcc), the script runs all its steps in order,
    carries on after a failing one, names it at the end and exits 1; benchmark rows go to $OUT."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
    fake = tmp_path / "python"
    fake.write_text('#!/bin/bash\ncase "$*" in\n  *bench_reduce*) exit 3;;\n'
                    '  *) echo "ran: $* [loading=${CUDA_MODULE_LOADING:-lazy}]";;\nesac\n')
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                         env={"PATH": "/usr/bin:/bin", "PY": str(fake), "OUT": str(tmp_path)})
    assert out.returncode == 1, out.stdout + out.stderr
    ran = [line.split()[1:3] for line in out.stdout.splitlines() if line.startswith("ran: ")]
    assert ran == [["-c", "import"], ["csrc/build.py", "[loading=lazy]"], ["-m", "overlapkernels"],
                   ["scripts/compile_kernels_sm90.py", "--quick"], ["-m", "pytest"],
                   ["benchmarks/bench_fused_gemm.py", "--csv"], ["-m", "pytest"],
                   ["benchmarks/bench_chunked_gemm.py", "--csv"], ["benchmarks/bench_flash_attn.py", "--csv"],
                   ["benchmarks/bench_one_gpu_ag_matmul.py", "--csv"], ["-m", "pytest"]], ran
    loading = [line.rsplit("[loading=", 1)[1] for line in out.stdout.splitlines() if line.startswith("ran: ")]
    # eager module loading only where ranks share a GPU: the one-GPU worlds' tests and their bench
    assert loading == ["lazy]"] * 6 + ["EAGER]"] + ["lazy]"] * 2 + ["EAGER]", "lazy]"], loading
    assert f"--csv {tmp_path}/gpu-check.csv" in out.stdout
    assert "=== FAILED: bench_reduce (exit 3)" in out.stdout and "all steps passed" not in out.stdout


def test_telemetry_stops_its_sampler_and_samples_once_at_the_end(monkeypatch):
    """Leaving the context stops the sampler thread (it would poll NVML for the rest of the run) and
    takes a last sample, so a run shorter than one interval still has a reading."""
    from overlapkernels.profiling import telemetry

    with telemetry.Telemetry(0, interval_s=0.01, nvml=FakeTelemetryNVML()) as tel:
        thread = tel._thread
    assert thread is not None and not thread.is_alive()

    class Idle:  # a sampler thread that never gets to sample
        def __init__(self, **kwargs):
            pass

        def start(self):
            pass

        def join(self):
            pass

    monkeypatch.setattr(telemetry.threading, "Thread", Idle)
    with telemetry.Telemetry(0, interval_s=60.0, nvml=FakeTelemetryNVML()) as tel:
        pass
    assert len(tel.samples) == 1 and tel.summary()["power_w"] == 650.0


def test_gpu_inventory_counts_only_enabled_links_and_names_pcie_levels():
    """A link NVML reports disabled (state 0) is no link; GPUs without NVLink between them show the
    PCIe/socket level nvidia-smi prints (NODE: one NUMA node, PHB: one host bridge)."""
    class Partial(FakeNVML):
        def nvmlDeviceGetNvLinkState(self, h, link):
            if h == 2:
                raise self.NotSupported()
            return 1 if link < 4 else 0

        def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
            return {frozenset((0, 2)): 40, frozenset((1, 2)): 30}[frozenset((a, b))]

    inv = gpu_inventory(Partial())
    assert [g["nvlink"]["active_links"] for g in inv["gpus"]] == [4, 4, 0]
    assert inv["topology"] == [["X", "NV4", "NODE"], ["NV4", "X", "PHB"], ["NODE", "PHB", "X"]]


def test_telemetry_reads_the_sm_clock_and_the_gpu_temperature_sensor():
    """NVML's clock and temperature queries take which clock / sensor: the SM clock (not memory's),
    the GPU die's sensor."""
    from overlapkernels.profiling.telemetry import Telemetry

    class Fake(FakeTelemetryNVML):
        NVML_TEMPERATURE_GPU = 0

        def nvmlDeviceGetClockInfo(self, h, kind): return {1: 1980, 2: 3201}[kind]
        def nvmlDeviceGetTemperature(self, h, sensor): return {0: 61}[sensor]

    tel = Telemetry(0, nvml=Fake())
    tel._handle = "gpu0"  # what __enter__ sets, without starting its sampler thread
    tel._sample()
    assert (tel.samples[0]["sm_clock_mhz"], tel.samples[0]["temp_c"]) == (1980, 61)
