"""A benchmark's measurement in a fresh process: its peak RSS is its own ``ru_maxrss``, read by
``wait4`` (the whole process: Python, torch and the model included), not what an earlier
measurement in the same interpreter left allocated. Inside a process, ``reset_peak_rss`` and
``status_kib("VmHWM")`` measure the peak of one part of it (Linux)."""

from __future__ import annotations

import os
import re
import subprocess
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
