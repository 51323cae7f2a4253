"""Tables on stdout and rows appended to CSV, each row carrying where and when it was measured."""
from __future__ import annotations

import argparse
import csv
import datetime as _dt
import importlib
import os
import platform
import subprocess
from pathlib import Path


COMMIT_ENV = "OVERLAPKERNELS_COMMIT"


def positive_int(text: str) -> int:
    """argparse type of the benchmark scripts' sizes and counts: an integer >= 1, else a usage error
    naming the value (0 iterations divided by zero, or asked statistics of nothing, after setup)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= 1")
    return value


def git_commit(package_dir: str | os.PathLike | None = None) -> str:
    """``git describe --always --dirty`` of the checkout this package was imported from, or
    'unknown' when the package is not tracked by a git repository (an installed copy, even one
    inside some other repository, must not report that repository's commit).
    $OVERLAPKERNELS_COMMIT, where set, is taken as is: a copy of a checkout without its .git (what a
    remote GPU machine receives) names its commit that way."""
    if given := os.environ.get(COMMIT_ENV, "").strip():
        return given
    package = Path(package_dir) if package_dir is not None else Path(__file__).resolve().parent.parent

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=5, cwd=package)

    try:
        if git("ls-files", "--error-unmatch", "--", "__init__.py").returncode != 0:
            return "unknown"
        return git("describe", "--always", "--dirty", "--abbrev=12").stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def environment(device: str) -> dict[str, str]:
    """Hardware and software a row was measured on. GPU fields come from NVML and stay empty
    on a CPU run, so a CPU figure can never be mistaken for a GPU one."""
    import torch

    from .. import __version__
    from ..profiling.inventory import settings

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:  # pragma: no cover - triton is an install requirement
        triton_version = ""
    gpu_name = driver = nvlink = ""
    if device == "cuda":
        from ..profiling.inventory import gpu_inventory

        inv = gpu_inventory()
        gpu = _this_gpu(inv.get("gpus") or [])
        gpu_name, driver = gpu.get("name", ""), inv.get("driver", "")
        links = gpu.get("nvlink") or {}
        if links.get("active_links"):
            nvlink = f"{links['active_links']} links v{'/'.join(map(str, links.get('versions') or [])) or '?'}"
        elif gpu:
            nvlink = "none"
    return {
        "device": device if device == "cuda" else f"cpu ({platform.processor() or platform.machine()})",
        "gpu_name": gpu_name, "driver": driver, "nvlink": nvlink, "torch": torch.__version__, "triton": triton_version,
        "version": __version__, "commit": git_commit(), "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": " ".join(f"{k}={v}" for k, v in settings().items()),  # OVERLAPKERNELS_* etc. in effect
    }


def _this_gpu(gpus: list[dict]) -> dict:
    """The inventory entry of the GPU this process runs on, by PCI address: NVML numbers GPUs its own
    way, whatever CUDA_VISIBLE_DEVICES says (with CUDA_VISIBLE_DEVICES=4,5,6,7, NVML's GPU 0 is not
    ours). NVML's first GPU where torch gives no PCI address; {} where none matches."""
    import torch

    def address(bus_id: str):  # "00000000:18:00.0" or "0000:18:00.0" -> (domain, bus, device)
        try:
            domain, bus, rest = bus_id.split(":")
            return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
        except (AttributeError, ValueError):
            return None

    try:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        ours = (props.pci_domain_id, props.pci_bus_id, props.pci_device_id)
    except (AttributeError, RuntimeError, AssertionError):
        return gpus[0] if gpus else {}
    return next((g for g in gpus if address(g.get("pci_bus_id")) == ours), {})


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """``columns``: (key, header, format spec). Right-aligned, one header line, like nccl-tests."""
    cells = [["-" if row[key] is None else format(row[key], spec) if spec else str(row[key]) for key, _, spec in columns]
             for row in rows]  # (None: a setting the row's implementation does not have)
    widths = [max(len(header), *(len(c[i]) for c in cells)) if cells else len(header)
              for i, (_, header, _) in enumerate(columns)]
    lines = ["  ".join(h.rjust(w) for (_, h, _), w in zip(columns, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(cell, widths)) for cell in cells]
    return "\n".join(lines)


def append_csv(path: str | os.PathLike, rows: list[dict]) -> None:
    """Append rows to one CSV that several benchmarks share (``bench all``, ``make gpu-check``): when
    the new rows bring columns the file lacks, the file is rewritten under the union of columns,
    so every row stays under its own headers (missing cells empty). A rewrite goes through a
    temporary file and an atomic rename, so an interrupted run never loses earlier rows."""
    if not rows:
        return
    path = Path(os.path.realpath(path))  # a symlinked --csv: the rename below must replace its target
    path.parent.mkdir(parents=True, exist_ok=True)
    columns = list(dict.fromkeys(key for row in rows for key in row))
    old_rows: list[dict] = []
    rewrite = True
    if path.exists() and path.stat().st_size > 0:
        with path.open(newline="", encoding="utf-8-sig") as f:  # (-sig: a header saved with a BOM, as Excel does)
            reader = csv.DictReader(f, restkey="_extra")  # cells past the header (a malformed file)
            old_columns = list(reader.fieldnames or [])
            if set(columns) <= set(old_columns):
                columns, rewrite = old_columns, False
            else:
                old_rows = [{k: v for k, v in row.items() if k != "_extra"} for row in reader]
                columns = list(dict.fromkeys(old_columns + columns))
    if not rewrite:
        with path.open("rb") as f:  # a file whose last line has no newline: the first row must not join it
            f.seek(-1, os.SEEK_END)
            ends_in_newline = f.read(1) in (b"\n", b"\r")
        with path.open("a", newline="") as f:
            if not ends_in_newline:
                f.write("\r\n")  # csv's own line ending
            csv.DictWriter(f, fieldnames=columns, restval="").writerows(rows)
        return
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, restval="")
        writer.writeheader()
        writer.writerows(old_rows)
        writer.writerows(rows)
    os.replace(tmp, path)


class RowLog(list):
    """A benchmark script's rows, each appended to ``csv_path`` (when given) as soon as it is
    measured, with the ``common`` columns (sizes, environment) added. A script stopped by its time
    limit (`make gpu-check` shortens the later steps to fit its deadline) thus keeps every row it
    finished, where writing all rows at the end lost them all."""

    def __init__(self, csv_path: str | os.PathLike | None = None, common: dict | None = None):
        super().__init__()
        self.csv_path, self.common = csv_path, dict(common or {})

    def add(self, row: dict) -> dict:
        row = {**row, **self.common}
        self.append(row)
        if self.csv_path:
            append_csv(self.csv_path, [row])
        return row


def exit_on_sigterm() -> None:
    """Make SIGTERM (a time limit's ``timeout``) raise SystemExit in the main thread: ``finally``
    blocks still run, so a benchmark prints the rows it has before it goes (they are already in its
    CSV: :class:`RowLog`)."""
    import signal

    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


def _json_safe(row: dict) -> dict:
    import math

    # standard JSON has no NaN or infinities: null
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}


def append_jsonl(path: str | os.PathLike, rows: list[dict]) -> None:
    """Append rows as JSON lines (one object per row; NaN written as null)."""
    import json

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(_json_safe(row)) + "\n")


def existing_json_rows(path: str | os.PathLike) -> list:
    """The rows a ``--json`` file already holds: [] for a missing or empty file, else its JSON array
    (ValueError naming the file otherwise, so that a run never ends unable to save its rows)."""
    import json

    path = Path(path)
    try:
        text = path.read_text() if path.is_file() else ""
    except OSError as exc:
        raise ValueError(f"--json {path}: cannot be read ({exc.strerror}); expected a readable file") from exc
    if not text.strip():
        return []
    try:
        rows = json.loads(text)
    except ValueError:
        rows = None
    if not isinstance(rows, list):
        raise ValueError(f"--json {path}: holds no JSON array of rows; expected a new file, one written by "
                         "--json, or a name ending in .jsonl for JSON Lines")
    return rows


def append_json(path: str | os.PathLike, rows: list[dict]) -> None:
    """``--json``: one JSON array of row objects, extended by later runs (``json.load`` reads it),
    or JSON Lines appended when the name ends in ``.jsonl``. NaN is written as null."""
    import json

    path = Path(os.path.realpath(path))  # a symlinked --json: the rename below must replace its target
    if path.suffix == ".jsonl":
        return append_jsonl(path, rows)
    # earlier rows too: a file that Python's json wrote holds NaN, which json.loads reads back
    every = [_json_safe(r) if isinstance(r, dict) else r for r in existing_json_rows(path)] + [
        _json_safe(row) for row in rows]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(every, indent=1, allow_nan=False) + "\n")
    os.replace(partial, path)  # readers see the old rows or all of them, never half a file


def check_output_paths(csv=None, json_out=None, plot=None, profile=None) -> None:
    """Unusable --csv/--json/--plot/--profile paths fail now, before any rank starts, rather than
    after the whole run (losing its rows)."""
    for flag, value, is_dir in (("--csv", csv, False), ("--json", json_out, False), ("--plot", plot, True),
                                ("--profile", profile, True)):
        if not value:
            continue
        path = Path(value)
        want = "a directory (created if missing)" if is_dir else "a file (created if missing, else appended to)"
        if path.exists() and path.is_dir() != is_dir:
            raise ValueError(f"{flag} {value}: is a {'file' if is_dir else 'directory'}; expected {want}")
        nearest = path  # the path itself, or the closest existing folder it would be created under
        while not nearest.exists() and nearest != nearest.parent:
            nearest = nearest.parent
        if nearest != path and not nearest.is_dir():
            raise ValueError(f"{flag} {value}: {nearest} is a file, so {value} cannot be created; expected {want}")
        rewritten = flag == "--json" and path.suffix != ".jsonl"  # a JSON array: replaced through its folder
        writable = path.parent if rewritten and nearest == path else nearest
        if not os.access(writable, os.W_OK):
            raise ValueError(f"{flag} {value}: {writable} is not writable; expected {want}")
        if rewritten:
            existing_json_rows(path)  # a file that is no JSON array of rows: refused now
    if plot:
        try:
            importlib.import_module("matplotlib")  # the optional `bench` extra: a run must not end without its plot
        except ImportError:
            raise ValueError(f"--plot {plot}: needs matplotlib, which is not installed "
                             "(pip install 'overlapkernels[bench]')") from None


def publish_rows(rows: list[dict], device: str, columns, title: str, args) -> int:
    """A bench command's rows, with the environment: a table on stdout, then the CSV, JSON and plot
    its arguments ask for. 1 when there are none (every requested method was skipped)."""
    if not rows:
        print(f"# {title}: no rows (every requested method was skipped, see above)")
        return 1
    env = environment(device)
    rows = [{"bench": args.kind, **row, **env} for row in rows]  # which kind made a row of a shared file
    if getattr(args, "profile", None):  # the profiler slowed every call: such rows must not pass for plain ones
        rows = [{**row, "settings": f"{row['settings']} profiled".strip()} for row in rows]
    first = rows[0]
    print(f"# {title}: {first['world_size']} ranks, backend {first['backend']}, {env['device']}"
          f"{' ' + env['gpu_name'] if env['gpu_name'] else ''}; torch {env['torch']}; median of {args.iters} "
          f"calls after {args.warmup} warm-up")
    print(format_table(rows, columns))
    if args.csv:
        append_csv(args.csv, rows)
        print(f"# appended {len(rows)} rows to {args.csv}")
    if getattr(args, "json_out", None):
        append_json(args.json_out, rows)
        print(f"# appended {len(rows)} rows to {args.json_out}")
    if getattr(args, "plot", None):
        from .plot import plot_rows

        os.makedirs(args.plot, exist_ok=True)
        png = os.path.join(args.plot, f"{args.kind}.png")
        print(f"# plot: {png}" if plot_rows(args.kind, rows, png) else "# plot: matplotlib not installed")
    return 0
