"""A benchmark's measurement in a fresh process: its peak RSS is its own ``ru_maxrss``, read by
``wait4`` (the whole process: Python, torch and the model included), not what an earlier
measurement in the same interpreter left allocated. Inside a process, ``reset_peak_rss`` and
``status_kib("VmHWM")`` measure the peak of one part of it (Linux)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def run_child(cmd: list[str], *, env: dict | None = None, cwd=None) -> tuple[str, float, float]:
    """(the child's stdout, its peak RSS in MiB, its wall time in seconds); a failed child stops
    the benchmark with the tail of its stderr."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=err, text=True)
        _, status, usage = os.wait4(proc.pid, 0)
        seconds = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        if os.waitstatus_to_exitcode(status):
            raise SystemExit(f"{' '.join(map(str, cmd[1:3]))}: the child failed:\n{err.read()[-3000:]}")
        return out.read(), usage.ru_maxrss / 1024, seconds


def status_kib(field: str) -> int:
    """A field of /proc/self/status in KiB: VmRSS (resident now), VmHWM (the peak since the last reset)."""
    return int(re.search(rf"{field}:\s+(\d+)", Path("/proc/self/status").read_text()).group(1))


def reset_peak_rss() -> None:
    """VmHWM := the current RSS (Linux ≥ 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def import_dpregistry() -> None:
    """Import dpregistry, every module of it and of every installed plugin package, and what its
    data path loads lazily, so that a measurement whose baseline is taken afterwards does not count
    library code that a run imports on its way."""
    import encodings.utf_8_sig  # noqa: F401  (the data files' codec)
    import importlib
    import pkgutil
    from importlib.metadata import entry_points

    import datasets  # noqa: F401
    import scipy.io  # noqa: F401  (loaded lazily while a run's data is prepared)
    import torch

    import dpregistry
    from dpregistry.registry import ENTRY_POINT_GROUP

    packages = [dpregistry] + [importlib.import_module(ep.module.split(".")[0])
                               for ep in entry_points(group=ENTRY_POINT_GROUP)]
    for package in packages:
        for m in pkgutil.walk_packages(package.__path__, prefix=f"{package.__name__}."):
            if m.name.endswith(".__main__"):  # importing it would run the CLI
                continue
            if m.name.endswith("_triton") and not torch.cuda.is_available():  # CUDA kernels: Triton, never on a CPU run
                continue
            importlib.import_module(m.name)


def warn_of_window_imports(label: str, imported: list[str]) -> None:
    """Say on stderr which modules a child imported inside its measured window (it reports
    ``sorted(set(sys.modules) - modules_at_its_baseline)``): their memory counts in its peak."""
    if imported:
        print(f"warning: {label} imported {len(imported)} modules inside its measured window (their memory "
              f"counts in its peak): {', '.join(imported[:8])}", file=sys.stderr)
