"""The harness's output files as real users leave them: symlinked paths, a CSV without its last
newline or with Excel's byte-order mark, a --json file Python's json wrote with NaN; and E's noise
floor and the progress bar's stream."""
import csv
import json
import math
import sys

from overlapkernels.bench import metrics, progress
from overlapkernels.bench.report import append_csv, append_json


def _rows(path):
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_a_symlinked_csv_and_json_keep_feeding_their_target(tmp_path):
    for name, append in (("rows.csv", append_csv), ("rows.json", append_json)):
        real, link = tmp_path / name, tmp_path / f"link-{name}"
        append(real, [{"a": 1}])
        link.symlink_to(real)
        append(link, [{"a": 2, "b": 3}])  # a new column: the CSV is rewritten through a temporary file
        assert link.is_symlink(), name
    assert _rows(tmp_path / "rows.csv") == (["a", "b"], [{"a": "1", "b": ""}, {"a": "2", "b": "3"}])
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"a": 1}, {"a": 2, "b": 3}]


def test_rows_of_one_append_with_other_columns_share_one_header(tmp_path):
    """One call's rows need not have the same keys (fsdp's own rows and its peers'): the header is their union."""
    append_csv(tmp_path / "rows.csv", [{"a": 1}, {"a": 2, "b": 3}])
    assert _rows(tmp_path / "rows.csv") == (["a", "b"], [{"a": "1", "b": ""}, {"a": "2", "b": "3"}])


def test_missing_telemetry_is_an_empty_cell_and_a_json_null(tmp_path):
    """Rows without NVML hold None in its columns: the CSV cell stays empty, the JSON value is null
    (it was "", a string where GPU rows hold numbers)."""
    from overlapkernels.profiling.telemetry import COLUMNS, Telemetry

    class NoDriver:
        def nvmlInit(self):
            raise RuntimeError("NVML Shared Library Not Found")

    with Telemetry(nvml=NoDriver()) as tel:
        pass
    row = {"time_us": 1.5, **tel.summary()}
    append_csv(tmp_path / "rows.csv", [row])
    append_json(tmp_path / "rows.json", [row])
    assert _rows(tmp_path / "rows.csv")[1] == [{"time_us": "1.5", **{k: "" for k in COLUMNS}}]
    assert json.loads((tmp_path / "rows.json").read_text()) == [{"time_us": 1.5, **dict.fromkeys(COLUMNS)}]


def test_a_csv_without_its_last_newline_or_with_a_bom_is_extended_row_by_row(tmp_path):
    plain, bom = tmp_path / "plain.csv", tmp_path / "bom.csv"
    plain.write_text("a,b\n1,2")  # saved by an editor that drops the final newline
    bom.write_text("\ufeffa,b\r\n1,2\r\n", encoding="utf-8")  # Excel's UTF-8 CSV
    for path in (plain, bom):
        append_csv(path, [{"a": 3, "b": 4}])
        fields, rows = _rows(path)
        assert [name.lstrip("\ufeff") for name in fields] == ["a", "b"], path.name
        assert rows == [{fields[0]: "1", "b": "2"}, {fields[0]: "3", "b": "4"}], path.name


def test_a_json_file_holding_nan_is_extended_with_nulls(tmp_path):
    """Python's json writes NaN (and reads it back): the earlier rows are made valid JSON too, where
    the append failed after the whole run and lost every row."""
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"e": float("nan"), "t": 1.0}]))
    append_json(path, [{"e": float("inf"), "t": 2.0}])
    assert json.loads(path.read_text(), parse_constant=lambda c: 1 / 0) == [{"e": None, "t": 1.0},
                                                                          {"e": None, "t": 2.0}]


def test_overlap_efficiency_is_undefined_within_the_noise_floor():
    assert math.isnan(metrics.overlap_efficiency(t_method=1.020, t_baseline=1.001, t_gemm=1.0))  # was -19
    assert math.isnan(metrics.overlap_efficiency(t_method=1.0, t_baseline=1.015, t_gemm=1.0))  # 1.5% < 2%
    assert metrics.overlap_efficiency(t_method=1.0625, t_baseline=1.125, t_gemm=1.0) == 0.5  # 12.5% exposed
    # one rank: nothing communicates, so there is nothing to hide (a fake gap read -1.4 before)
    assert math.isnan(metrics.overlap_efficiency(t_method=1.12, t_baseline=1.05, t_gemm=1.0, world_size=1))
    assert metrics.overlap_efficiency(t_method=1.0625, t_baseline=1.125, t_gemm=1.0, world_size=2) == 0.5


def test_the_progress_bar_draws_on_stderr_the_terminal_it_checked(monkeypatch):
    import pytest

    rich_progress = pytest.importorskip("rich.progress")
    seen = {}

    def fake_track(items, **kwargs):
        seen.update(kwargs)
        return items

    monkeypatch.setattr(rich_progress, "track", fake_track)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    assert list(progress.track([1, 2, 3], "sweep")) == [1, 2, 3]
    assert seen["console"].stderr is True


def test_rows_describe_the_gpu_this_process_runs_on_not_nvml_gpu_0(monkeypatch):
    """NVML numbers GPUs its own way (CUDA_VISIBLE_DEVICES=4,5,6,7: cuda:0 is NVML's GPU 4): the
    row's GPU is found by PCI address; no match gives empty fields, not another GPU's."""
    from types import SimpleNamespace

    import torch

    from overlapkernels.bench import report
    from overlapkernels.profiling import inventory

    gpus = [{"name": "NVIDIA H200", "pci_bus_id": "00000000:18:00.0", "nvlink": {"active_links": 18, "versions": [4]}},
            {"name": "NVIDIA H100 80GB HBM3", "pci_bus_id": "00000000:2a:00.0", "nvlink": {"active_links": 0}}]
    monkeypatch.setattr(inventory, "gpu_inventory", lambda: {"driver": "580.65", "gpus": gpus})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for bus, want in ((0x2A, ("NVIDIA H100 80GB HBM3", "none")), (0x18, ("NVIDIA H200", "18 links v4")),
                      (0x3B, ("", ""))):
        props = SimpleNamespace(pci_domain_id=0, pci_bus_id=bus, pci_device_id=0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i, p=props: p)
        env = report.environment("cuda")
        assert (env["gpu_name"], env["nvlink"]) == want and env["driver"] == "580.65"


def test_rows_measured_under_the_profiler_say_so_in_their_settings(tmp_path, monkeypatch, capsys):
    from types import SimpleNamespace

    from overlapkernels.bench import report

    monkeypatch.setattr(report, "environment", lambda device: {"device": "cpu (x86_64)", "gpu_name": "", "torch": "t",
                                                               "settings": "OVERLAPKERNELS_AUTO=measure"})
    for profile, want in ((None, "OVERLAPKERNELS_AUTO=measure"), (str(tmp_path / "traces"),
                                                                   "OVERLAPKERNELS_AUTO=measure profiled")):
        path = tmp_path / f"{bool(profile)}.csv"
        args = SimpleNamespace(kind="collectives", iters=1, warmup=0, csv=str(path), json_out=None, plot=None,
                               profile=profile)
        assert report.publish_rows([{"world_size": 2, "backend": "gloo", "time_us": 1.0}], "cpu",
                                   [("time_us", "t", ".1f")], "collectives", args) == 0
        assert [row["settings"] for row in _rows(path)[1]] == [want]
